"""Weight updates of a vLLM engine, engine side: receive, load, pause and swap.

Weight sync. The NCCL path is vLLM's native weight transfer (``weight_transfer_config =
{"backend": "nccl"}``): :meth:`init_weight_transfer` joins the trainer's group, and
:meth:`receive_weights` runs one of two receive paths around the trainer's broadcast
(the `nccl` transport; the engine's receiver for it is
:class:`rlcore.engine.vllm.vllm_receivers.NCCLReceiver`):

- ``reload="layerwise"`` (vLLM's own): pause(keep) -> start_weight_update -> update_weights ->
  finish_weight_update -> bump version -> resume. The layer-by-layer reload re-materialises and
  re-processes every layer, so quantised or post-processed weights stay correct.
- ``reload="direct"``: one worker call receives the same packed buckets straight into the
  parameters (:class:`rlcore.engine.vllm.direct_receive.DirectReceiver`: vLLM's loader recorded once,
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

Quantized rollout (``quantization="fp8"``, ``rollout.vllm.quantization``). vLLM 0.26 quantizes a
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

:class:`WeightUpdates` is mixed into :class:`rlcore.engine.vllm.vllm_engine.VLLMEngine` (it uses that
class's loop plumbing: ``_call``, ``_rpc``, ``_check``, ``_llm``); the worker half is
:mod:`rlcore.engine.vllm.vllm_worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Iterable, Literal

import torch

from rlcore.engine.base import WeightSyncError
from rlcore.engine.vllm.vllm_codec import pack_tensor, unpack_tensor

Reload = Literal["layerwise", "direct"]
KVOnUpdate = Literal["keep", "recompute"]


def check_reload(reload: str, quantization: str | None) -> None:
    """A quantized engine must receive weights through the layerwise reload (module docstring)."""
    if quantization is not None and reload == "direct":
        raise ValueError(
            f"reload='direct' cannot serve a quantized engine (quantization={quantization!r}): plain "
            "load_weights skips the re-quantization of the synced bf16 weights; use reload='layerwise'"
        )


class WeightUpdates:
    """Weight receive and load for :class:`VLLMEngine` (see the module docstring)."""

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

    def init_weight_transfer(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, timeout_s: float | None = None
    ) -> None:
        """Join the trainer's NCCL weight-transfer group (blocks until every member joined; the
        trainer's `nccl` sender hosts it at the same time). This
        engine's workers take ranks ``rank_offset .. rank_offset + num_workers - 1``."""
        self._check()
        init_info = dict(
            master_address=master_address,
            master_port=int(master_port),
            rank_offset=int(rank_offset),
            world_size=int(world_size),
        )
        timeout = timeout_s or self.rpc_timeout_s
        self._call(
            asyncio.wait_for(self._rpc("init_weight_transfer_engine", init_info=init_info), timeout),
            timeout + 5,
            "init_weight_transfer",
        )

    def receive_weights(self, update_info: dict, version: int, timeout_s: float | None = None) -> dict[str, float]:
        """Receive one NCCL broadcast of the full weights and serve them as policy ``version``.

        ``update_info`` is vLLM's packed description that the trainer's sender made (names, dtypes,
        shapes, bucket layout: it must match what the trainer sends, in order). Call it while the
        trainer calls ``send_weights``. Returns timings (``pause_s``, ``load_s``, ``resume_s``,
        ``total_s``, and per-step ones). Raises :class:`WeightSyncError` on failure or after
        ``timeout_s`` (default ``rpc_timeout_s``); the engine is then unusable (its weights may be
        half updated, or its core still blocked in NCCL): restart the actor.
        """
        self._check()
        check_reload(self.reload, self.quantization)

        async def body() -> dict[str, float]:
            times = {}
            if self.reload == "direct":
                t = time.perf_counter()
                workers = await self._rpc("rlcore_receive_direct", update_info=update_info)
                times["update_s"] = time.perf_counter() - t
                times["worker_s"] = max(w["worker_s"] for w in workers)
                times["fallback_tensors"] = float(max(w["fallback"] for w in workers))
            else:
                for step, kwargs in (
                    ("start_weight_update", {}),
                    ("update_weights", {"update_info": update_info}),
                    ("finish_weight_update", {}),
                ):
                    t = time.perf_counter()
                    await self._rpc(step, **kwargs)
                    times[step.split("_")[0] + "_s"] = time.perf_counter() - t
            return times

        timeout = timeout_s or self.rpc_timeout_s
        try:
            return self._call(
                asyncio.wait_for(self._swap(version, body, pause=self._needs_pause()), timeout),
                timeout + 10,
                "receive_weights",
            )
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
        self._load_and_mark(named_tensors, None)

    def _load_and_mark(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        """`load_weights`, and with `version` its bump inside the same pause (one update)."""
        self._check()
        weights = [(name, pack_tensor(t)) for name, t in named_tensors]

        async def body() -> dict[str, float]:
            layerwise = self.quantization is not None  # a quantized model re-processes loaded weights
            await self._rpc("rlcore_load_weights", weights=weights, layerwise=layerwise)
            return {}

        # without a version the salt stays: clear the caches, whose blocks the old weights computed
        self._call(
            self._swap(self._version if version is None else version, body, clear=True),
            self.rpc_timeout_s,
            "load_weights",
        )

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """:meth:`load_weights` and the bump to `version` in one update (what the rollout actor
        calls): no request is admitted between the new weights and their version (a decode of a
        prefill handle checks the version, `rlcore.engine.vllm.vllm_pd.admits`)."""
        self._load_and_mark(named_tensors, version)

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

        return {
            name: unpack_tensor(packed) for name, packed in self._call(_sd(), self.rpc_timeout_s, "state_dict").items()
        }
