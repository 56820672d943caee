"""The code that runs inside vLLM's GPU workers: rlcore's worker extension.

vLLM mixes :class:`RLCoreWorkerExtension` into every worker (the engine passes
:data:`WORKER_EXTENSION` as ``worker_extension_cls``), so the engine reaches the model through
``collective_rpc`` by method name: the direct and IPC receives, the RPC weight load and the
parameter dump. At start the engine has every worker put the family's checkpoint names in front of
its model's ``load_weights`` (:meth:`RLCoreWorkerExtension.rlcore_use_checkpoint_names`), so every
sync path -- vLLM's own NCCL update included -- hands vLLM's loader the names it knows. vLLM is imported lazily: this module imports on a CPU-only machine without vLLM.
"""

from __future__ import annotations

import time

import torch

from rlcore.engine.vllm.direct_receive import DirectReceiver
from rlcore.engine.vllm.vllm_codec import pack_tensor, unpack_tensor
from rlcore.engine.vllm.vllm_colocated import receive_ipc_on_worker

WORKER_EXTENSION = "rlcore.engine.vllm.vllm_worker.RLCoreWorkerExtension"
"""The dotted path vLLM imports the extension by (``worker_extension_cls``)."""


class RLCoreWorkerExtension:
    """Mixed into every vLLM GPU worker (``worker_extension_cls``) so the engine can reach the
    model through ``collective_rpc`` by method name. Method names carry an ``rlcore_`` prefix so
    they never clash with the worker's own (vLLM asserts that)."""

    def _rlcore_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def rlcore_use_checkpoint_names(self) -> bool:
        """Translate every later ``model.load_weights`` call from the trainer's (transformers')
        names to the family's checkpoint names, the mapping export writes with
        (:mod:`rlcore.models.checkpoint_names`): Mixtral's loader knows ``block_sparse_moe``, not
        transformers 5's ``mlp``; DeepSeek-V3's knows per-expert tensors only. vLLM's own weight
        transfer calls the same instance attribute. Returns False when already installed, or for a
        model type transformers does not know (its names pass unchanged)."""
        from rlcore.models.checkpoint_names import CheckpointNames, reference_model, sends_fused_experts

        model = self._rlcore_model()
        if getattr(model, "_rlcore_checkpoint_names", None) is not None:
            return False
        config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        reference = reference_model(config)
        if reference is None:  # a remote-code model type: transformers has no conversion mapping for it
            return False
        names = CheckpointNames(reference, fuse_experts=sends_fused_experts(config))
        load = model.load_weights
        model._rlcore_checkpoint_names = names
        model.load_weights = lambda weights, *args, **kwargs: load(names.named(weights), *args, **kwargs)
        return True

    def rlcore_receive_direct(self, update_info: dict) -> dict:
        """Receive one packed NCCL update straight into the parameters
        (:class:`rlcore.engine.vllm.direct_receive.DirectReceiver`: vLLM's loader is run and recorded
        on the first update of a layout, replayed as batched copies after). Returns the seconds
        spent on this worker and the receiver's counts."""
        engine = getattr(self, "weight_transfer_engine", None)
        group = getattr(engine, "model_update_group", None)
        if group is None:
            raise RuntimeError(
                "weight transfer is not configured on this worker "
                "(build the engine with weight_transfer_config={'backend': 'nccl'} "
                "and call init_weight_transfer first)"
            )
        start = time.perf_counter()
        receiver = getattr(self, "_rlcore_receiver", None)
        if receiver is None:
            model = self._rlcore_model()
            receiver = self._rlcore_receiver = DirectReceiver(
                model.load_weights, group.device, fingerprint=lambda: tuple(p.data_ptr() for p in model.parameters())
            )
        # the stream argument is the bucket's stream, current inside DirectReceiver.receive
        stats = receiver.receive(
            update_info, lambda buf: group.broadcast(buf, src=0, stream=torch.cuda.current_stream())
        )
        return {**stats, "worker_s": time.perf_counter() - start}

    def rlcore_receive_ipc(self, update_info: dict, handle: dict) -> dict:
        """Colocated placement: receive one update from the trainer rank's CUDA IPC buffer
        (:func:`rlcore.engine.vllm.vllm_colocated.receive_ipc_on_worker`)."""
        return receive_ipc_on_worker(self, update_info, handle)

    def rlcore_load_weights(self, weights: list, layerwise: bool = False) -> int:
        """Load full tensors (trainer names, translated by :meth:`rlcore_use_checkpoint_names`; sent as raw bytes, see :func:`pack_tensor`) through
        ``model.load_weights``; returns the count. ``layerwise``: inside vLLM's layerwise reload
        (needed by quantized models: weights are re-processed after loading)."""
        model = self._rlcore_model()
        device = next(p for p in model.parameters() if p.device.type != "meta").device
        named = [(name, unpack_tensor(packed).to(device)) for name, packed in weights]
        torch.accelerator.synchronize()
        if layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

            initialize_layerwise_reload(model)
            model.load_weights(named)
            finalize_layerwise_reload(model, self.model_runner.model_config)  # type: ignore[attr-defined]
        else:
            model.load_weights(named)
        torch.accelerator.synchronize()
        return len(named)

    def rlcore_state_dict(self, names: list | None = None) -> dict:
        """The worker's parameters by vLLM's own names (fused ``qkv_proj``, ``gate_up_proj``, TP
        shards) as raw bytes (:func:`pack_tensor`); only ``names`` when given."""
        wanted = None if names is None else set(names)
        return {
            name: pack_tensor(p)
            for name, p in self._rlcore_model().named_parameters()
            if wanted is None or name in wanted
        }
