"""The production rollout engine: one vLLM ``AsyncLLM`` per rollout actor.

(Over 400 lines: the engine's request paths, generate, prefill/decode and score, share its
private loop and request book-keeping; what stands alone lives beside it: `vllm_pd`, NIXL's
request flow; `vllm_versions`, token versions; `vllm_updates`, the weight receive.)

Threading model. ``AsyncLLM`` is asyncio-native; the rollout actor calls the engine from plain
worker threads (several ``generate`` calls and a weight update can be in flight at once). So the
engine owns a private event loop running in a daemon thread, and every public method submits a
coroutine to it with ``run_coroutine_threadsafe`` and waits with a timeout. Calling a public
method from inside that loop thread would deadlock and raises instead.

Outputs. Token ids go in (``TokensPrompt``; no tokenizer is loaded), token ids come out with the
logprob of each sampled token under the distribution it was sampled from: the engine is built
with ``logprobs_mode="processed_logprobs"``, which makes vLLM report log-softmax of the logits
*after* temperature and top-p (see vLLM ``v1/sample/ops/topk_topp_sampler.py``). ``score`` uses
prompt logprobs, which are always the raw (temperature 1) ones.

The engine's other jobs live next to it, one module each: per-token versions of requests in
flight (:mod:`rlcore.engine.vllm.vllm_versions`), weight receive and load with the KV-cache and
quantization rules (:mod:`rlcore.engine.vllm.vllm_updates`), colocated IPC receive and sleep mode
(:mod:`rlcore.engine.vllm.vllm_colocated`), its receivers for the `nccl` and `ipc` transports
(:mod:`rlcore.engine.vllm.vllm_receivers`), the code that runs inside vLLM's workers
(:mod:`rlcore.engine.vllm.vllm_worker`), the tensor codec of its RPC channel
(:mod:`rlcore.engine.vllm.vllm_codec`), the model directory built from a run config
(:mod:`rlcore.engine.vllm.vllm_model_dir`) and the per-user compile cache
(:mod:`rlcore.engine.vllm.vllm_cache`).

vLLM is imported lazily: this module imports on a CPU-only machine without vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
from typing import Any, Literal

from rlcore.engine.base import Generation, Prefilled, RolloutEngine, SamplingParams, StalePrefill, WeightSyncError
from rlcore.engine.vllm import warm_core
from rlcore.engine.vllm.vllm_cache import compile_cache
from rlcore.engine.vllm.vllm_colocated import ColocatedEngine
from rlcore.engine.vllm.vllm_model_dir import engine_args
from rlcore.engine.vllm.vllm_pd import (
    admits,
    decode_overrides,
    decoded_on_prefill_version,
    kv_transfer_config,
    prefill_overrides,
    prefilled_handle,
)
from rlcore.engine.vllm.vllm_receivers import RECEIVERS
from rlcore.engine.vllm.vllm_updates import KVOnUpdate, Reload, WeightUpdates, check_reload
from rlcore.engine.vllm.vllm_versions import InFlightRequest, VersionMarks
from rlcore.engine.vllm.vllm_worker import WORKER_EXTENSION
from rlcore.models.vision import collapse_image_tokens
from rlcore.report.profiling import read_new
from rlcore.weights.protocol import Receiver, Seat

log = logging.getLogger(__name__)

OutputMode = Literal["final", "delta"]
PREFILL_TRIES = 3
"""Prefills of one batch before a handle of one version is given up on (each retry follows a
weight update that landed inside the batch; three in a row is a sync storm, the caller's to see)."""


class VLLMEngine(WeightUpdates, VersionMarks, ColocatedEngine, RolloutEngine):
    """One vLLM ``AsyncLLM`` (tensor parallel inside) behind the :class:`RolloutEngine` contract.

    Thread-safe: every public method may be called from any thread but the engine's own loop
    thread. ``generate`` submits all prompts at once (vLLM batches them continuously with the
    requests of other concurrent calls); a weight update may land while it runs and the remaining
    tokens then carry the new version.
    """

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        load_format: str = "auto",
        enable_prefix_caching: bool = True,
        reload: Reload = "layerwise",
        kv_on_update: KVOnUpdate = "keep",
        quantization: str | None = None,
        fast_pause: bool = True,
        output_mode: OutputMode = "final",
        extra_sampling: dict[str, Any] | None = None,
        request_timeout_s: float = 3600.0,
        rpc_timeout_s: float = 300.0,
        startup_timeout_s: float = 1200.0,
        vision: Any = None,
        profile_dir: str | None = None,
        profile_with_stack: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine (blocks until vLLM is ready, at most ``startup_timeout_s``).

        ``model`` is a Hugging Face id or directory (with ``load_format="dummy"`` a directory
        holding only ``config.json`` is enough: weights then arrive by sync). ``reload`` picks the
        receive path of :meth:`receive_weights` (module docstring). ``quantization``: vLLM's online
        quantization (``"fp8"``; None = serve in ``dtype``); it needs ``reload="layerwise"``.
        ``kv_on_update``: what happens to the KV cache of requests in flight at a weight update
        (module docstring). ``fast_pause`` pauses through the engine core directly, skipping the 20 ms settling sleep
        of ``AsyncLLM.pause_generation`` (not needed here, see the module docstring on versions).
        ``output_mode``: how token versions are tracked (module docstring). ``extra_sampling`` is
        merged into every request's vLLM ``SamplingParams`` (e.g. ``{"ignore_eos": True}`` for benchmarks).
        ``profile_dir``: the folder vLLM's workers write their torch.profiler traces to between
        :meth:`start_profile` and :meth:`stop_profile` (None: the engine records nothing).
        Other keyword arguments go to vLLM's ``AsyncEngineArgs``.
        """
        if reload not in ("layerwise", "direct"):
            raise ValueError(f"reload must be 'layerwise' or 'direct', got {reload!r}")
        if kv_on_update not in ("keep", "recompute"):
            raise ValueError(f"kv_on_update must be 'keep' or 'recompute', got {kv_on_update!r}")
        self.kv_on_update: KVOnUpdate = kv_on_update
        check_reload(reload, quantization)
        if output_mode not in ("final", "delta"):
            raise ValueError(f"output_mode must be 'final' or 'delta', got {output_mode!r}")
        self.output_mode: OutputMode = output_mode
        # VisionSpec of a vision-language model: prompts may carry images (then the engine needs
        # skip_tokenizer_init=False: vLLM's multimodal processor reads placeholder ids from it)
        self.vision = vision
        # Fork is unsafe once this process holds threads (our loop) or CUDA; vLLM forces spawn
        # in some cases only. The spawned engine core gets this process's sys.path.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast can wedge shared GPUs
        self.reload: Reload = reload
        self.quantization = quantization
        self.fast_pause = fast_pause
        self.request_timeout_s = request_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.num_workers = tensor_parallel_size * int(engine_kwargs.get("pipeline_parallel_size", 1))
        self._extra_sampling = dict(extra_sampling or {})
        self._ids = itertools.count()
        self._active: dict[str, InFlightRequest] = {}
        self._version = 0
        self.policy_version = 0
        self._broken: str | None = None
        self._engine_args = dict(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            load_format=load_format,
            enable_prefix_caching=enable_prefix_caching,
            skip_tokenizer_init=True,  # token ids in and out; the actor owns the tokenizer
            logprobs_mode="processed_logprobs",  # logprobs of the tempered / top-p distribution
            weight_transfer_config={"backend": "nccl"},
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
        )
        if quantization is not None:
            self._engine_args["quantization"] = quantization
        if vision is not None:
            self._engine_args["limit_mm_per_prompt"] = {"image": 4, "video": 0}
        self._profile_dir, self._profile_seen = profile_dir, set()
        if profile_dir is not None:  # the workers' own profiler; the front end (this process) is left out
            self._engine_args["profiler_config"] = {
                "profiler": "torch",
                "torch_profiler_dir": profile_dir,
                "torch_profiler_with_stack": profile_with_stack,
                "ignore_frontend": True,
                "torch_profiler_dump_cuda_time_total": False,
            }
        self._engine_args.update(engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._update_lock: asyncio.Lock | None = None
        cache = compile_cache(self._engine_args)  # before vLLM starts: it sets VLLM_CACHE_ROOT
        self.startup_note = cache.note()
        """One line on the compile cache (hit, miss, not used), said before the engine started."""
        log.info("%s", self.startup_note)
        try:
            self._llm = self._call(self._start(), startup_timeout_s, "engine startup")
        except BaseException:
            self._stop_loop()
            raise
        cache.started()

    @classmethod
    def from_config(
        cls,
        options: Any,
        model: Any,
        *,
        seed: int = 0,
        tokenizer: Any = None,
        device: str = "cuda",
        pd_role: str | None = None,
        pd_connector: str | None = None,
        **overrides: Any,
    ) -> "VLLMEngine":
        """Build from its section ``options`` (``rollout.vllm``, a :class:`VLLMOptions`) and the
        model config (:func:`rlcore.engine.vllm.vllm_model_dir.engine_args`); ``overrides`` go to
        the constructor; ``device`` is always CUDA. A random-weight model (``model.path`` null) is
        started from its ``arch`` config with dummy weights: the first sync fills them. ``pd_role``
        (`prefill` / `decode`) with ``pd_connector``: the engine's KV transfer config
        (:func:`rlcore.engine.vllm.vllm_model_dir.kv_transfer_config`)."""
        path, kwargs = engine_args(options, model, seed=seed, tokenizer=tokenizer)
        if pd_role is not None:
            kwargs["kv_transfer_config"] = kv_transfer_config(pd_connector or "nixl")
        kwargs.update(overrides)
        return cls(path, **kwargs)

    # ---------------------------------------------------------------- loop plumbing

    async def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._update_lock = asyncio.Lock()
        warm_core.use_for_vllm()  # where the actor started the warm server (else vLLM's spawn)
        args = dict(self._engine_args)
        if isinstance(args.get("profiler_config"), dict):  # EngineArgs converts no dict of this one
            from vllm.config import ProfilerConfig

            args["profiler_config"] = ProfilerConfig(**args["profiler_config"])
        # Created on the loop so AsyncLLM starts its output handler on this loop.
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        # every weight load from here on arrives under the family's checkpoint names (vllm_worker)
        await llm.collective_rpc("rlcore_use_checkpoint_names", timeout=self.rpc_timeout_s)
        return llm

    def _call(self, coro: Any, timeout_s: float | None, what: str) -> Any:
        """Run ``coro`` on the engine loop and wait at most ``timeout_s`` (None: no limit)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("VLLMEngine's blocking methods cannot run on its own event loop")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # cancels the task on the loop; generate's tasks abort their requests
            raise TimeoutError(f"vLLM engine: {what} took longer than {timeout_s} s") from None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _check(self) -> None:
        if self._broken:
            raise WeightSyncError(f"engine unusable after a failed weight update: {self._broken}")

    # ---------------------------------------------------------------- generation

    def _vllm_params(self, params: SamplingParams, index: int, **overrides: Any) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        kwargs: dict[str, Any] = dict(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop_token_ids=list(params.stop_token_ids) or None,
            # One seed per prompt: a group's samples of the same prompt must differ.
            seed=None if params.seed is None else params.seed + index,
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,  # a handful of lists per request instead of one dict per token
            # "final": one output per request (fast); "delta": a streamed output per decode step
            output_kind=RequestOutputKind.FINAL_ONLY if self.output_mode == "final" else RequestOutputKind.DELTA,
            detokenize=False,
        )
        kwargs.update(self._extra_sampling)
        kwargs.update(overrides)  # prefill/decode disaggregation: max_tokens, the KV transfer params
        if self.vision is not None:  # never sample an image token (see HFEngine.generate), whatever the user's bias
            image = {self.vision.image_token_id: -100.0, self.vision.image_token_id + 1: -100.0}
            kwargs["logit_bias"] = {**(kwargs.get("logit_bias") or {}), **image}
        return VSamplingParams(**kwargs)

    def _prompt(self, prompt: list[int], images: list | None) -> Any:
        from vllm.inputs import TokensPrompt

        if not images:
            return TokensPrompt(prompt_token_ids=list(prompt), cache_salt=self._cache_salt())
        if self.vision is None:
            raise ValueError("prompts have images but the engine's model is text-only")
        from PIL import Image

        # With token prompts vLLM applies the prompt update itself (one <|image_pad|> -> the
        # image's token count, vllm/multimodal/processing/processor.py): hand it one per image.
        # It expands to the same count our samples hold (processor-ready images, same grid).
        ids = collapse_image_tokens(prompt, self.vision.image_token_id)
        return TokensPrompt(
            prompt_token_ids=ids,
            multi_modal_data={"image": [Image.fromarray(a) for a in images]},
            cache_salt=self._cache_salt(),
        )

    async def _one(
        self, prompt: list[int], sp: Any, images: list | None = None, prefilled: Prefilled | None = None
    ) -> Generation:
        return (await self._run(prompt, sp, images, prefilled)).result()

    async def _run(
        self, prompt: list[int], sp: Any, images: list | None = None, prefilled: Prefilled | None = None
    ) -> InFlightRequest:
        # a decode request enters only on its prefill's version; checked in the same loop step that
        # reads the version and the cache salt below (an update bumps them on this loop too)
        admits(prefilled, self._version, self._update_lock is not None and self._update_lock.locked())
        req = InFlightRequest(rid=f"rlcore-{next(self._ids)}", version=self._version)
        self._active[req.rid] = req
        try:
            req.collector = await self._llm.add_request(req.rid, self._prompt(prompt, images), sp)
            while not req.finished:
                out = req.collector.get_nowait() or await req.collector.get()
                req.absorb(out)
            problem = req.expansion_problem(len(prompt)) if images else None
            if problem:  # a shifted sample (and routing replay's rows) would train silently wrong
                raise ValueError(problem)
            return req
        finally:
            self._active.pop(req.rid, None)
            if not req.finished:  # cancelled (timeout) or failed: stop spending compute on it
                with contextlib.suppress(Exception):
                    await self._llm.abort(req.rid)
            if req.collector is not None:
                req.collector.close()

    async def _generate(
        self, prompts: list[list[int]], params: SamplingParams, images=None, prefilled: Prefilled | None = None
    ) -> list[Generation]:
        images = images or [None] * len(prompts)
        if prefilled is not None:  # each request pulls its prompt's KV blocks from the prefill engine (NIXL)
            sps = [self._vllm_params(params, i, **decode_overrides(prefilled, i)) for i in range(len(prompts))]
        else:
            # vLLM clones a request's params on submission, so unseeded prompts share one object
            # (building it costs about as much as submitting the request); seeded ones differ by index.
            shared = self._vllm_params(params, 0) if params.seed is None else None
            sps = [shared if shared is not None else self._vllm_params(params, i) for i in range(len(prompts))]
        tasks = [asyncio.ensure_future(self._one(p, sp, im, prefilled)) for p, sp, im in zip(prompts, sps, images)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        images=None,
        timeout_s: float | None = None,
        prefilled: Prefilled | None = None,
    ) -> list[Generation]:
        """Sample one completion per prompt; all prompts are submitted at once. Raises
        ``TimeoutError`` after ``timeout_s`` (default ``request_timeout_s``), aborting the rest.
        ``prefilled`` (a decode engine, `rollout.pd.*`): :meth:`prefill`'s handle of these prompts
        from a prefill engine; each request pulls its KV blocks over the connector. Raises
        `StalePrefill` when this engine does not hold the handle's version, is receiving weights,
        or an update landed before a request's first token (`vllm_pd`: one version per sample)."""
        self._check()
        if not prompts:
            return []
        if prefilled is not None and [list(p) for p in prompts] != prefilled.prompts:
            raise ValueError("prefilled: the handle is of other prompts")
        gens = self._call(
            self._generate(prompts, params, images, prefilled), timeout_s or self.request_timeout_s, "generate"
        )
        return gens if prefilled is None else decoded_on_prefill_version(gens, prefilled)

    async def _prefill(self, prompts: list[list[int]], params: SamplingParams, images=None) -> list[InFlightRequest]:
        images = images or [None] * len(prompts)
        sps = [self._vllm_params(params, i, **prefill_overrides()) for i in range(len(prompts))]  # vllm_pd's flow
        return list(await asyncio.gather(*(self._run(p, sp, im) for p, sp, im in zip(prompts, sps, images))))

    def prefill(self, prompts: list[list[int]], params: SamplingParams, images=None) -> Prefilled:
        """A prefill engine (`kv_transfer_config` with kv_role `kv_both`): run the prompts for a
        remote decode; the handle holds each prompt's `kv_transfer_params` (where its KV blocks
        wait) and the one version of the weights that computed them: a batch a weight update
        split is prefilled again (at most `PREFILL_TRIES` times)."""
        self._check()
        for attempt in range(1, PREFILL_TRIES + 1):
            reqs = self._call(self._prefill(prompts, params, images), self.request_timeout_s, "prefill")
            try:
                return prefilled_handle(prompts, reqs)
            except StalePrefill:
                if attempt == PREFILL_TRIES:
                    raise
        raise AssertionError("unreachable")

    def cache_stats(self) -> dict[str, float]:
        """vLLM's prefix-cache counters in this process (`vllm:prefix_cache_queries` / `_hits`, and
        the KV connector's `external_` ones: offload, NIXL), name -> value; empty unless the engine
        logs stats (`engine_kwargs.disable_log_stats: false`)."""
        from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

        out: dict[str, float] = {}
        for m in get_metrics_snapshot():
            if isinstance(m, Counter) and "prefix_cache" in m.name:
                out[m.name] = out.get(m.name, 0.0) + float(m.value)
        return out

    def tokens_in_flight(self) -> list[int]:
        """Tokens generated so far by each request in flight (for metrics and tests)."""

        async def _counts() -> list[int]:
            return [self._tokens_so_far(r) for r in list(self._active.values()) if not r.finished]

        return self._call(_counts(), self.rpc_timeout_s, "tokens_in_flight")

    def abort(self) -> None:
        """Finish every request in flight now, with reason ``abort`` (tokens so far are kept)."""

        async def _abort() -> None:
            rids = list(self._active)
            if rids:
                await self._llm.abort(rids)

        self._call(_abort(), self.rpc_timeout_s, "abort")

    # ---------------------------------------------------------------- scoring

    async def _score_one(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ids = list(prompt_ids) + list(completion_ids)
        sp = VSamplingParams(
            max_tokens=1,
            temperature=1.0,
            prompt_logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        rid = f"rlcore-score-{next(self._ids)}"
        collector = await self._llm.add_request(
            rid, TokensPrompt(prompt_token_ids=ids, cache_salt=self._cache_salt()), sp
        )
        try:
            out = await collector.get()
            while not out.finished:
                out = await collector.get()
        finally:
            collector.close()
        plp = out.prompt_logprobs  # position 0 has none; position i: logprob of ids[i] | ids[:i]
        start = len(prompt_ids)
        return [plp[i][ids[i]].logprob for i in range(start, len(ids))]

    async def _score_many(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        return list(await asyncio.gather(*(self._score_one(p, c) for p, c in pairs)))

    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """Teacher-forced logprobs (temperature 1) of ``completion_ids`` after ``prompt_ids``.
        ``prompt_ids`` must be non-empty. Prompt-logprob requests bypass the prefix cache."""
        return self.score_batch([(prompt_ids, completion_ids)])[0]

    def score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """:meth:`score` for several (prompt, completion) pairs at once (the canary's prompt set)."""
        self._check()
        if any(len(p) == 0 for p, _ in pairs):
            raise ValueError("score needs at least one prompt token before the completion")
        return self._call(self._score_many(pairs), self.request_timeout_s, "score")

    # ---------------------------------------------------------------- weight receive (the rest: vllm_updates)

    def receiver(self, transport: str, seat: Seat) -> Receiver | None:
        """Its own receiver for `nccl` or `ipc` (:mod:`rlcore.engine.vllm.vllm_receivers`),
        joined at `seat`; None for any other transport (then the weights arrive through
        :meth:`apply_weights`, the slow RPC path)."""
        cls = RECEIVERS.get(transport)
        return None if cls is None else cls(seat, self)

    # ---------------------------------------------------------------- worker calls

    def start_profile(self, label: str, with_stack: bool = False, cpu_ops: bool = True) -> None:
        """The engine core's workers start their profiler (the engine was built with
        `profile_dir`; `with_stack` was fixed then; vLLM's workers always record CPU ops too)."""
        if self._profile_dir is None:
            raise RuntimeError("this vLLM engine was built without profile_dir: it cannot record a trace")
        self._call(self._llm.start_profile(profile_prefix=label), self.rpc_timeout_s, "start_profile")

    def stop_profile(self) -> list[tuple[str, bytes]]:
        """The workers stop and write their traces; returns the files they wrote since the last call."""
        if self._profile_dir is None:
            return []
        self._call(self._llm.stop_profile(), self.rpc_timeout_s, "stop_profile")
        return read_new(self._profile_dir, self._profile_seen)

    async def _rpc(self, method: str, **kwargs: Any) -> list:
        return await self._llm.collective_rpc(method, timeout=self.rpc_timeout_s, kwargs=kwargs or None)

    def shutdown(self) -> None:
        """Stop the engine core and the loop thread (idempotent)."""
        if not self._thread.is_alive():
            return
        llm = getattr(self, "_llm", None)
        if llm is not None:

            async def _shutdown() -> None:
                llm.shutdown()

            with contextlib.suppress(Exception):
                self._call(_shutdown(), 60, "shutdown")
        self._stop_loop()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
