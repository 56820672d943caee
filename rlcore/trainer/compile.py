"""``trainer.compile``: torch.compile of the decoder layers, torchtitan style (one block at a time).

Each decoder layer's *instance* ``forward`` is replaced by ``torch.compile(forward)`` (after
activation checkpointing replaced it, before FSDP2 wraps the layer), so:

- parameter names stay the transformers names (no ``_orig_mod.`` prefix; weight sync and
  checkpoints rely on them);
- FSDP2's all-gather / reshard hooks run eagerly in ``nn.Module.__call__`` around the compiled
  body (the layer's parameters are plain unsharded tensors inside it; a one-rank trainer has no
  per-layer units, only the root's);
- every layer runs the same code object, so one compiled graph serves all layers (parameters are
  graph inputs under dynamo's inlined nn-module handling): compile time is one block's, not
  ``layers`` blocks'.

rlcore's variable-length attention is a custom op (``torch_attn::_varlen_attn`` with a fake
kernel and a registered backward), so it traces into the graph without a break. Dense layers
with cp = 1 compile without graph breaks (tested on CPU); Ulysses all-to-alls are functional
collectives and trace too (``fullgraph`` stays off: a break runs eagerly rather than failing). In
MoE layers the attention block, the two norms, the router and the shared experts are compiled, each on its own, and
so are the block's row sums and gated activation (`rlcore.trainer.moe_kernels`, one graph each
for all layers); the rest of the MoE block (router statistics, routing replay, all-to-all split
sizes, experts as their own FSDP unit, ``torch._grouped_mm``) runs eagerly.

Dynamic shapes: the packed token count, the number of samples (size of ``cu_seqlens``) and the
longest sample change from micro-batch to micro-batch. Micro-batches are *not* padded to
buckets; they are compiled with ``dynamic=True`` from the first call: activation sizes are
symbolic, parameters static (dynamo's default), and every size that meets a parameter (hidden,
head dim, vocabulary) is specialised by the shape checks anyway, so only the token count, the
sample count and the longest sample stay symbolic. One compile per code object, no recompile
per micro-batch. The recompile limit is raised so that the few legitimate variants (grad vs
no-grad forwards, a reference model in another dtype) never fall back to eager silently.

`BACKEND` is the torch.compile backend (tests use ``aot_eager``: the same dynamo graphs and
autograd without inductor's C++/Triton code generation, which takes minutes on a small CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from rlcore.models.vision import decoder_layers
from rlcore.trainer.moe import MoEBlock
from rlcore.trainer.moe_kernels import kernels as moe_kernels

_RECOMPILE_LIMIT = 64
BACKEND = "inductor"


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(cfg, name):
            setattr(cfg, name, max(int(getattr(cfg, name)), _RECOMPILE_LIMIT))
            break


def compile_fn(fn, fullgraph: bool = False, dynamic: bool | None = True):
    """``torch.compile`` with rlcore's settings (`BACKEND`; every size symbolic from the first call,
    or with ``dynamic=None`` only the sizes seen to change: a function with no parameters keeps its
    fixed widths static that way, so inductor can vectorize over them)."""
    _raise_recompile_limit()
    return torch.compile(fn, fullgraph=fullgraph, backend=BACKEND, dynamic=dynamic)


def compile_module_forward(module: nn.Module, fullgraph: bool = False) -> None:
    """Replace ``module.forward`` (instance attribute) by its compiled version (idempotent)."""
    if getattr(module, "_rlcore_compiled", False):
        return
    module.forward = compile_fn(module.forward, fullgraph=fullgraph)
    module._rlcore_compiled = True


def compile_layers(model: nn.Module, fullgraph: bool = False) -> None:
    """Compile every decoder layer of a transformers causal LM (a VLM: its language model); in a
    layer whose MLP is an rlcore `MoEBlock`, its attention block, norms and router one by one
    (the MoE dispatch needs host-side split sizes and its experts are their own FSDP unit:
    compiling through it would cut the layer into many small graphs; left eager, the norms and the
    router's softmax / top-k are a dozen memory-bound kernels each)."""
    for layer in decoder_layers(model):
        if isinstance(getattr(layer, "mlp", None), MoEBlock):
            mlp = layer.mlp
            parts = [layer.self_attn, mlp.route_module()]  # the family's router (gate / router)
            parts += [getattr(mlp, mlp.shared_name)] if mlp.shared_name else []  # a dense MLP
            parts += [getattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm") if hasattr(layer, n)]
            for part in parts:
                compile_module_forward(part, fullgraph=fullgraph)
            mlp.experts.kernels = moe_kernels(compiled=True)  # the gathers' sums, the gated activation
        else:
            compile_module_forward(layer, fullgraph=fullgraph)
