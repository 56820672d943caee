"""The production rollout engine: one vLLM ``AsyncLLM`` per rollout actor.

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

Versions. Every token carries the policy version of the weights that produced it. A weight update
pauses the scheduler in "keep" mode (requests stay queued), swaps the weights, bumps the version
and resumes. The version boundary of each in-flight request is its token count at the bump, read
from vLLM's output processor (``output_mode="final"``, the default: one output per request, so the
client process does no per-token work beyond vLLM's own) or from the tokens streamed so far plus
those pending in the request's collector (``output_mode="delta"``: public API only, but a Python
object per request per decode step; measured 0.62x of raw vLLM throughput). The bump happens after
the whole weight update has been awaited, by which time every output produced before the pause has
been processed (the engine core sends all of them before answering the pause, and the output
handler runs on this loop during the update's awaits).

Weight sync. The NCCL path is vLLM's native weight transfer (``weight_transfer_config =
{"backend": "nccl"}``): :meth:`init_weight_transfer` joins the trainer's group, and
:meth:`receive_weights` runs one of two receive paths around the trainer's broadcast
(:mod:`rlcore.engine.vllm_sync`):

- ``reload="layerwise"`` (vLLM's own): pause(keep) -> start_weight_update -> update_weights ->
  finish_weight_update -> bump version -> resume. The layer-by-layer reload re-materialises and
  re-processes every layer, so quantised or post-processed weights stay correct.
- ``reload="direct"``: one worker call receives the same packed buckets straight into the
  parameters (:class:`rlcore.engine.direct_receive.DirectReceiver`: vLLM's loader recorded once,
  replayed as batched copies) -> bump version. It runs between two engine steps and needs no
  pause. Only for weights that need no processing after loading; the canary catches a mismatch.

KV cache of requests in flight (``kv_on_update``):

- ``"keep"`` (default, PipelineRL's in-flight update): requests keep the KV they computed under
  the old weights and continue on the new ones. Every request carries the policy version as its
  prefix-cache salt, so no *new* request reuses a block computed under older weights (without
  that isolation a logprob gap of 5.7 nats was seen on the GPU machine). The sampled tokens'
  logprobs are those the engine really sampled from, which is what the loss's importance ratio
  needs.
- ``"recompute"``: the pause clears the KV and prefix caches with ``reset_running_requests``:
  requests in flight are preempted and recompute their prefix on the new weights, so no new token
  attends to keys computed with old weights. Costs a prefill of everything in flight per update.

Multimodal models always clear caches (vLLM's encoder cache is keyed by image, not by weights).

Quantized rollout (``quantization="fp8"``, ``rollout.quantization``). vLLM 0.26 quantizes a
bf16 checkpoint online: its FP8 linear method creates each weight on the meta device in bf16
shape, and once a layer's weights are loaded ``process_weights_after_loading`` replaces them with
an FP8 (e4m3) copy, transposed, plus a per-tensor scale (activations get dynamic per-token
scales). The layerwise reload (``start_weight_update`` -> ``update_weights`` ->
``finish_weight_update``) restores every layer to that bf16 checkpoint layout, buffers the
received bf16 tensors, re-runs ``process_weights_after_loading`` and copies the new FP8 values
into the kernel tensors in place (CUDA graphs keep their pointers). So the trainer always sends
bf16 and each sync re-quantizes. ``reload="direct"`` (plain ``load_weights`` into the already
processed FP8 parameters) is wrong for such a model and is refused; :meth:`load_weights` wraps
its ``load_weights`` in the same layerwise reload when the engine is quantized.

vLLM is imported lazily: this module imports on a CPU-only machine without vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import torch

from rlcore.engine.base import Generation, RolloutEngine, SamplingParams, WeightSyncError
from rlcore.engine.vllm_colocated import ColocatedEngine, receive_ipc_on_worker

log = logging.getLogger(__name__)

Reload = Literal["layerwise", "direct"]
KVOnUpdate = Literal["keep", "recompute"]
OutputMode = Literal["final", "delta"]

_WORKER_EXTENSION = "rlcore.engine.vllm_engine.RLCoreWorkerExtension"


def _check_reload(reload: str, quantization: str | None) -> None:
    """A quantized engine must receive weights through the layerwise reload (module docstring)."""
    if quantization is not None and reload == "direct":
        raise ValueError(f"reload='direct' cannot serve a quantized engine (quantization={quantization!r}): plain "
                         "load_weights skips the re-quantization of the synced bf16 weights; use reload='layerwise'")


class RLCoreWorkerExtension:
    """Mixed into every vLLM GPU worker (``worker_extension_cls``) so the engine can reach the
    model through ``collective_rpc`` by method name. Method names carry an ``rlcore_`` prefix so
    they never clash with the worker's own (vLLM asserts that)."""

    def _rlcore_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def rlcore_receive_direct(self, update_info: dict) -> dict:
        """Receive one packed NCCL update straight into the parameters
        (:class:`rlcore.engine.direct_receive.DirectReceiver`: vLLM's loader is run and recorded
        on the first update of a layout, replayed as batched copies after). Returns the seconds
        spent on this worker and the receiver's counts."""
        engine = getattr(self, "weight_transfer_engine", None)
        group = getattr(engine, "model_update_group", None)
        if group is None:
            raise RuntimeError("weight transfer is not configured on this worker "
                               "(build the engine with weight_transfer_config={'backend': 'nccl'} "
                               "and call init_weight_transfer first)")
        start = time.perf_counter()
        receiver = getattr(self, "_rlcore_receiver", None)
        if receiver is None:
            from rlcore.engine.direct_receive import DirectReceiver

            model = self._rlcore_model()
            receiver = self._rlcore_receiver = DirectReceiver(
                model.load_weights, group.device,
                fingerprint=lambda: tuple(p.data_ptr() for p in model.parameters()))
        # the stream argument is the bucket's stream, current inside DirectReceiver.receive
        stats = receiver.receive(update_info, lambda buf: group.broadcast(buf, src=0, stream=torch.cuda.current_stream()))
        return {**stats, "worker_s": time.perf_counter() - start}

    def rlcore_receive_ipc(self, update_info: dict, handle: dict) -> dict:
        """Colocated placement: receive one update from the trainer rank's CUDA IPC buffer
        (:func:`rlcore.engine.vllm_colocated.receive_ipc_on_worker`)."""
        return receive_ipc_on_worker(self, update_info, handle)

    def rlcore_load_weights(self, weights: list, layerwise: bool = False) -> int:
        """Load full tensors (trainer names; sent as raw bytes, see :func:`_pack_tensor`) through
        ``model.load_weights``; returns the count. ``layerwise``: inside vLLM's layerwise reload
        (needed by quantized models: weights are re-processed after loading)."""
        model = self._rlcore_model()
        device = next(p for p in model.parameters() if p.device.type != "meta").device
        named = [(name, _unpack_tensor(packed).to(device)) for name, packed in weights]
        torch.accelerator.synchronize()
        if layerwise:
            from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                                 initialize_layerwise_reload)
            initialize_layerwise_reload(model)
            model.load_weights(named)
            finalize_layerwise_reload(model, self.model_runner.model_config)  # type: ignore[attr-defined]
        else:
            model.load_weights(named)
        torch.accelerator.synchronize()
        return len(named)

    def rlcore_state_dict(self, names: list | None = None) -> dict:
        """The worker's parameters by vLLM's own names (fused ``qkv_proj``, ``gate_up_proj``, TP
        shards) as raw bytes (:func:`_pack_tensor`); only ``names`` when given."""
        wanted = None if names is None else set(names)
        return {name: _pack_tensor(p) for name, p in self._rlcore_model().named_parameters()
                if wanted is None or name in wanted}


# vLLM's RPC channel (msgpack) returns tensors inside utility-call arguments and results as plain
# [dtype, shape, data] lists, not tensors: ship them as explicit (dtype, shape, bytes) triples.
def _pack_tensor(t: torch.Tensor) -> list:
    t = t.detach().to("cpu").contiguous()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()]


def _unpack_tensor(packed: list) -> torch.Tensor:
    dtype, shape, data = packed
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


@dataclass
class _Request:
    """Book-keeping of one in-flight request."""

    rid: str
    version: int
    collector: Any = None  # vLLM RequestOutputCollector, once add_request returned
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (first token index, version)
    mark_i: int = 0
    finished: bool = False
    finish_reason: str = "abort"

    def pending_tokens(self) -> int:
        """Tokens the output handler has delivered to the collector but we have not read yet."""
        out = getattr(self.collector, "output", None)
        outputs = getattr(out, "outputs", None)
        return len(outputs[0].token_ids) if outputs else 0

    def absorb(self, out: Any) -> None:
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        for tok, lp in zip(tokens, _sampled_logprobs(tokens, comp.logprobs)):
            pos = len(self.token_ids)
            while self.mark_i < len(self.marks) and self.marks[self.mark_i][0] <= pos:
                self.version = self.marks[self.mark_i][1]
                self.mark_i += 1
            self.token_ids.append(tok)
            self.logprobs.append(lp)
            self.versions.append(self.version)
        if out.finished:
            self.finished = True
            self.finish_reason = _finish_reason(comp.finish_reason)

    def result(self) -> Generation:
        return Generation(token_ids=self.token_ids, logprobs=self.logprobs, versions=self.versions,
                          finish_reason=self.finish_reason)


def _finish_reason(reason: str | None) -> str:
    if reason in ("length", "abort"):
        return reason
    return "stop"  # "stop" (eos / stop token); vLLM's other reasons end the sample the same way


def _sampled_logprobs(token_ids: list[int], lps: Any) -> list[float]:
    """Logprob of each sampled token from vLLM's per-position logprobs (``logprobs=0`` asks for
    the sampled token only). Fast path for ``FlatLogprobs`` with one entry per position."""
    if lps is None:
        raise RuntimeError("vLLM returned no logprobs; the request must set logprobs=0")
    flat = getattr(lps, "logprobs", None)
    if flat is not None and len(flat) == len(token_ids) == len(lps) and list(lps.token_ids) == token_ids:
        return list(flat)
    return [position[tok].logprob for tok, position in zip(token_ids, lps)]


class VLLMEngine(ColocatedEngine, RolloutEngine):
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
        Other keyword arguments go to vLLM's ``AsyncEngineArgs``.
        """
        if reload not in ("layerwise", "direct"):
            raise ValueError(f"reload must be 'layerwise' or 'direct', got {reload!r}")
        if kv_on_update not in ("keep", "recompute"):
            raise ValueError(f"kv_on_update must be 'keep' or 'recompute', got {kv_on_update!r}")
        self.kv_on_update: KVOnUpdate = kv_on_update
        _check_reload(reload, quantization)
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
        self._active: dict[str, _Request] = {}
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
            worker_extension_cls=_WORKER_EXTENSION,
            disable_log_stats=True,
        )
        if quantization is not None:
            self._engine_args["quantization"] = quantization
        if vision is not None:
            self._engine_args["limit_mm_per_prompt"] = {"image": 4, "video": 0}
        self._engine_args.update(engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._update_lock: asyncio.Lock | None = None
        try:
            self._llm = self._call(self._start(), startup_timeout_s, "engine startup")
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def from_config(cls, cfg: Any, seed: int = 0, **overrides: Any) -> "VLLMEngine":
        """Build from a :class:`rlcore.config.RunConfig`. A random-weight model (``model.path``
        null) is started from its ``arch`` config with dummy weights: the first sync fills them."""
        quantization = cfg.rollout.quantization
        reload = cfg.rollout.weight_reload
        if reload == "auto":  # the fast direct receive unless weights are processed after loading
            reload = "layerwise" if quantization else "direct"
        kwargs: dict[str, Any] = dict(tensor_parallel_size=cfg.rollout.tensor_parallel_size, seed=seed,
                                      reload=reload, kv_on_update=cfg.rollout.kv_on_update)
        if quantization is not None:
            kwargs["quantization"] = quantization
        if cfg.rollout.sleep_level:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(cfg.rollout.engine_kwargs)
        path = cfg.model.path
        if path is None:
            from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                                MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

            from rlcore.models.build import build_tokenizer, random_model_config

            model_type = cfg.model.arch.get("model_type")
            tokenizer = build_tokenizer(cfg.model)
            vision = tokenizer.rlcore_vision
            if vision is not None:
                names, kind = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "an image-text-to-text"
            else:
                names, kind = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "a causal-LM"
            if model_type not in names:
                raise ValueError(f"model.arch.model_type: vLLM needs {kind} model_type, got {model_type!r}")
            # the same config the trainer builds (vocabulary sized to the tokenizer)
            hf_config = random_model_config(cfg.model, tokenizer)
            hf_config.architectures = [names[model_type]]  # vLLM picks its class by this
            path = tempfile.mkdtemp(prefix="rlcore-vllm-model-")
            hf_config.save_pretrained(path)
            kwargs["load_format"] = "dummy"
            if vision is not None:
                # vLLM's multimodal processor needs the tokenizer (placeholder ids) and the image
                # processor config next to config.json, and a tokenizer-enabled engine
                tokenizer.save_pretrained(path)
                vision.save(path)
                kwargs.update(skip_tokenizer_init=False, vision=vision)
        kwargs.update(overrides)
        return cls(path, **kwargs)

    # ---------------------------------------------------------------- loop plumbing

    async def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._update_lock = asyncio.Lock()
        # Created on the loop so AsyncLLM starts its output handler on this loop.
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args))

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

    def _vllm_params(self, params: SamplingParams, index: int) -> Any:
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
        if self.vision is not None:  # never sample an image token (see HFEngine.generate)
            kwargs["logit_bias"] = {self.vision.image_token_id: -100.0, self.vision.image_token_id + 1: -100.0}
        kwargs.update(self._extra_sampling)
        return VSamplingParams(**kwargs)

    def _prompt(self, prompt: list[int], images: list | None) -> Any:
        from vllm.inputs import TokensPrompt

        if not images:
            return TokensPrompt(prompt_token_ids=list(prompt), cache_salt=self._cache_salt())
        if self.vision is None:
            raise ValueError("prompts have images but the engine's model is text-only")
        from PIL import Image

        from rlcore.models.vision import collapse_image_tokens
        # With token prompts vLLM applies the prompt update itself (one <|image_pad|> -> the
        # image's token count, vllm/multimodal/processing/processor.py): hand it one per image.
        # It expands to the same count our samples hold (processor-ready images, same grid).
        ids = collapse_image_tokens(prompt, self.vision.image_token_id)
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [Image.fromarray(a) for a in images]},
                            cache_salt=self._cache_salt())

    async def _one(self, prompt: list[int], sp: Any, images: list | None = None) -> Generation:
        req = _Request(rid=f"rlcore-{next(self._ids)}", version=self._version)
        self._active[req.rid] = req
        try:
            req.collector = await self._llm.add_request(req.rid, self._prompt(prompt, images), sp)
            while not req.finished:
                out = req.collector.get_nowait() or await req.collector.get()
                req.absorb(out)
            return req.result()
        finally:
            self._active.pop(req.rid, None)
            if not req.finished:  # cancelled (timeout) or failed: stop spending compute on it
                with contextlib.suppress(Exception):
                    await self._llm.abort(req.rid)
            if req.collector is not None:
                req.collector.close()

    async def _generate(self, prompts: list[list[int]], params: SamplingParams, images=None) -> list[Generation]:
        images = images or [None] * len(prompts)
        tasks = [asyncio.ensure_future(self._one(p, self._vllm_params(params, i), im))
                 for i, (p, im) in enumerate(zip(prompts, images))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def generate(self, prompts: list[list[int]], params: SamplingParams, images=None,
                 timeout_s: float | None = None) -> list[Generation]:
        """Sample one completion per prompt; all prompts are submitted at once. Raises
        ``TimeoutError`` after ``timeout_s`` (default ``request_timeout_s``), aborting the rest."""
        self._check()
        if not prompts:
            return []
        return self._call(self._generate(prompts, params, images), timeout_s or self.request_timeout_s, "generate")

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
        sp = VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, flat_logprobs=True,
                             detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        rid = f"rlcore-score-{next(self._ids)}"
        collector = await self._llm.add_request(rid, TokensPrompt(prompt_token_ids=ids, cache_salt=self._cache_salt()), sp)
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

    # ---------------------------------------------------------------- weights

    async def _rpc(self, method: str, **kwargs: Any) -> list:
        return await self._llm.collective_rpc(method, timeout=self.rpc_timeout_s, kwargs=kwargs or None)

    def _cache_salt(self) -> str:
        """Prefix-cache namespace of the current weights: a request only reuses cached KV blocks
        computed under the same policy version."""
        return f"rlcore-v{self._version}"

    def _clears_cache(self) -> bool:
        """Whether an update must clear the KV / encoder caches: always for ``recompute``; for
        multimodal models too, since vLLM's encoder cache is keyed by image, not by weights."""
        model_config = getattr(self._llm, "model_config", None)
        return self.kv_on_update == "recompute" or bool(getattr(model_config, "is_multimodal_model", False))

    def _needs_pause(self) -> bool:
        """The direct receive replaces weights in place between two engine steps (vLLM runs
        utility calls on the engine-core thread, and the receive synchronises the device first),
        so it needs no pause unless caches must be cleared; the layerwise reload re-materialises
        layers and always does."""
        return self.reload == "layerwise" or self._clears_cache()

    async def _pause(self, clear: bool) -> None:
        core = getattr(self._llm, "engine_core", None)
        if self.fast_pause and hasattr(core, "pause_scheduler_async"):
            # Same engine-core call pause_generation makes, minus its 20 ms cosmetic sleep.
            await core.pause_scheduler_async(mode="keep", clear_cache=clear)
        else:
            await self._llm.pause_generation(mode="keep", clear_cache=clear)

    def _tokens_so_far(self, req: _Request) -> int:
        """Tokens the engine has produced for ``req`` and this process has processed."""
        if self.output_mode == "delta":
            return len(req.token_ids) + req.pending_tokens()
        collector = req.collector
        if collector is None:  # add_request still in flight: nothing generated yet
            return len(req.token_ids)
        # vLLM's output processor keeps one state per unfinished request (by internal id) whose
        # detokenizer accumulates every output token even when only the final output is sent.
        state = self._llm.output_processor.request_states.get(collector.request_id)
        if state is not None:
            return state.detokenizer.num_output_tokens()
        return len(req.token_ids) + req.pending_tokens()  # finished; final output maybe unread

    def _bump_version(self, version: int) -> None:
        """Runs on the loop while paused: tokens after each request's current count are new."""
        for req in self._active.values():
            if not req.finished:
                req.marks.append((self._tokens_so_far(req), version))
        self._version = version
        self.policy_version = version

    async def _swap(self, version: int, body: Any, pause: bool = True, clear: bool | None = None) -> dict[str, float]:
        """pause(keep) -> body() -> [reset prefix cache] -> bump version -> resume; returns
        timings. Without ``pause``: body() -> bump version (new requests get the new cache salt)."""
        assert self._update_lock is not None
        async with self._update_lock:
            times: dict[str, float] = {}
            t0 = time.perf_counter()
            if not pause:
                times.update(await body())
                times["load_s"] = time.perf_counter() - t0
                self._bump_version(version)
                times["total_s"] = time.perf_counter() - t0
                return times
            clear = self._clears_cache() if clear is None else clear
            await self._pause(clear)
            times["pause_s"] = time.perf_counter() - t0
            resumed = False
            try:
                t1 = time.perf_counter()
                times.update(await body())
                times["load_s"] = time.perf_counter() - t1
                t2 = time.perf_counter()
                if clear:
                    # The pause already cleared caches; a second reset, after the new weights are
                    # in and before anything is scheduled, costs little and keeps the invariant local.
                    await self._llm.reset_prefix_cache()
                self._bump_version(version)
                await self._llm.resume_generation()
                resumed = True
                times["resume_s"] = time.perf_counter() - t2
            finally:
                if not resumed:  # failed update: do not leave requests frozen forever
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(asyncio.shield(self._llm.resume_generation()), 5.0)
            times["total_s"] = time.perf_counter() - t0
            return times

    def init_weight_transfer(self, master_address: str, master_port: int, rank_offset: int,
                             world_size: int, timeout_s: float | None = None) -> None:
        """Join the trainer's NCCL weight-transfer group (blocks until every member joined; the
        trainer calls :func:`rlcore.engine.vllm_sync.init_sender` at the same time). This
        engine's workers take ranks ``rank_offset .. rank_offset + num_workers - 1``."""
        self._check()
        init_info = dict(master_address=master_address, master_port=int(master_port),
                         rank_offset=int(rank_offset), world_size=int(world_size))
        timeout = timeout_s or self.rpc_timeout_s
        self._call(asyncio.wait_for(self._rpc("init_weight_transfer_engine", init_info=init_info), timeout),
                   timeout + 5, "init_weight_transfer")

    def receive_weights(self, update_info: dict, version: int, timeout_s: float | None = None) -> dict[str, float]:
        """Receive one NCCL broadcast of the full weights and serve them as policy ``version``.

        ``update_info`` comes from :func:`rlcore.engine.vllm_sync.update_info_for` (names, dtypes,
        shapes, bucket layout: it must match what the trainer sends, in order). Call it while the
        trainer calls ``send_weights``. Returns timings (``pause_s``, ``load_s``, ``resume_s``,
        ``total_s``, and per-step ones). Raises :class:`WeightSyncError` on failure or after
        ``timeout_s`` (default ``rpc_timeout_s``); the engine is then unusable (its weights may be
        half updated, or its core still blocked in NCCL): restart the actor.
        """
        self._check()
        _check_reload(self.reload, self.quantization)

        async def body() -> dict[str, float]:
            times = {}
            if self.reload == "direct":
                t = time.perf_counter()
                workers = await self._rpc("rlcore_receive_direct", update_info=update_info)
                times["update_s"] = time.perf_counter() - t
                times["worker_s"] = max(w["worker_s"] for w in workers)
                times["fallback_tensors"] = float(max(w["fallback"] for w in workers))
            else:
                for step, kwargs in (("start_weight_update", {}), ("update_weights", {"update_info": update_info}),
                                     ("finish_weight_update", {})):
                    t = time.perf_counter()
                    await self._rpc(step, **kwargs)
                    times[step.split("_")[0] + "_s"] = time.perf_counter() - t
            return times

        timeout = timeout_s or self.rpc_timeout_s
        try:
            return self._call(asyncio.wait_for(self._swap(version, body, pause=self._needs_pause()), timeout),
                              timeout + 10, "receive_weights")
        except (TimeoutError, asyncio.TimeoutError) as exc:
            self._broken = f"receive_weights timed out after {timeout} s"
            raise WeightSyncError(self._broken) from exc
        except Exception as exc:
            # Some buckets may have landed: the weights are neither old nor new. Refuse to serve.
            self._broken = f"receive_weights failed: {type(exc).__name__}: {exc}"
            raise WeightSyncError(self._broken) from exc

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Non-NCCL path: ship full tensors (trainer names) through the engine's RPC channel (CPU
        copies, msgpack) and load them under a keep-mode pause. Slow (host memory round trip);
        meant for tests and small models. The version is unchanged until :meth:`set_version`."""
        self._check()
        weights = [(name, _pack_tensor(t)) for name, t in named_tensors]

        async def body() -> dict[str, float]:
            layerwise = self.quantization is not None  # a quantized model re-processes loaded weights
            await self._rpc("rlcore_load_weights", weights=weights, layerwise=layerwise)
            return {}

        # the version (and so the prefix-cache salt) only moves at set_version: clear the caches
        self._call(self._swap(self._version, body, clear=True), self.rpc_timeout_s, "load_weights")

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """:meth:`load_weights` then :meth:`set_version` (what the rollout actor calls)."""
        self.load_weights(named_tensors)
        self.set_version(version)

    def set_version(self, version: int) -> None:
        """Mark the weights loaded so far as policy ``version`` (for the :meth:`load_weights`
        path; :meth:`receive_weights` sets the version itself)."""
        async def _set() -> None:
            self._bump_version(version)
        self._call(_set(), self.rpc_timeout_s, "set_version")

    def state_dict(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Worker 0's parameters by **vLLM's** names (fused ``qkv_proj`` / ``gate_up_proj``, TP
        shards) on CPU, all or only ``names``: vLLM keeps no inverse map to trainer names (names
        that are not fused, like ``model.norm.weight``, coincide). For tests and checks."""
        async def _sd() -> dict:
            return (await self._rpc("rlcore_state_dict", names=names))[0]
        return {name: _unpack_tensor(packed) for name, packed in self._call(_sd(), self.rpc_timeout_s, "state_dict").items()}

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
