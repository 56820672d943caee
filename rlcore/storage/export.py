"""Export weights as a Hugging Face model directory: safetensors shards (+ index), config.json,
generation config and tokenizer files, loadable by `transformers.AutoModelForCausalLM` and vLLM.

Two sources share one writer (`write_hf_dir`, which streams tensors into shards and commits the
directory atomically):

- a checkpoint, offline: ``python -m rlcore.export CHECKPOINT_DIR OUT_DIR`` (`export_checkpoint`);
  the checkpoint carries its model config and tokenizer, so the original model need not exist;
- the live trainer at the end of a run (`checkpoint.export_final`): rank 0 writes the full
  parameters as the trainer group gathers them, one tensor at a time.

Tensor names are the model family's checkpoint names, as `save_pretrained` writes them (what
vLLM's loaders and `from_pretrained` read): transformers fuses the experts of a MoE model in
memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``) and its conversion mapping splits them back
on save (``mlp.experts.{i}.gate_proj.weight`` for Qwen-MoE, DeepSeek-V3, GLM-4.5;
``block_sparse_moe.experts.{i}.w1.weight`` for Mixtral; gpt-oss keeps its fused names);
`hub_named` applies that mapping tensor by tensor (`rlcore.models.checkpoint_names`, shared with
weight sync). Tied weights are written once (as
`save_pretrained` does) and re-tied by the loader from `tie_word_embeddings`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.storage.checkpoint import commit_dir, load_model_weights, temp_dir_for
from rlcore.storage.checkpoint_dirs import HF_DIR, is_complete, latest_checkpoint, plain_load_problem
from rlcore.storage.hf_files import drop_gguf_quantization, save_config_and_tokenizer
from rlcore.storage.location import is_remote, storage_path

DEFAULT_SHARD_BYTES = 5 * 2**30


def exportable_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once) and persistent buffers, by transformers name."""
    persistent = set(model.state_dict().keys())
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if name in persistent:
            yield name, buf


def hub_named(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """`named_tensors` (transformers module names) under the family's checkpoint names, as
    `save_pretrained` writes them (`rlcore.models.checkpoint_names`, the mapping weight sync uses
    too), one tensor at a time so the writer keeps streaming. A dense model's names pass through."""
    from rlcore.models.checkpoint_names import checkpoint_named

    return checkpoint_named(model, named_tensors)


def write_hf_dir(
    out_dir: str | Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config_src: Path | None = None,
    model: torch.nn.Module | None = None,
    tokenizer=None,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write `named_tensors` as safetensors shards plus config and tokenizer, atomically.

    Config and tokenizer come from `config_src` (a directory written by
    `save_config_and_tokenizer`, e.g. a checkpoint's `hf/`) or from `model` + `tokenizer`.
    An existing `out_dir` is replaced only once the new one is complete. In an object store
    (no rename) the folder is written locally, then the old one deleted and the new one uploaded.
    """
    if is_remote(out_dir):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlcore-export-") as local:
            write_hf_dir(Path(local) / "hf", named_tensors, config_src, model, tokenizer, dtype, max_shard_bytes)
            return upload_dir(Path(local) / "hf", out_dir)
    out = Path(out_dir).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(out)
    tmp.mkdir()
    try:
        shards: list[list[str]] = []
        weight_map: dict[str, int] = {}
        current: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush():
            nonlocal current, size
            if current:
                save_file(current, str(tmp / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
                shards.append(list(current))
                current, size = {}, 0

        for name, tensor in named_tensors:
            t = tensor.detach().to("cpu").contiguous()
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > max_shard_bytes:
                flush()
            current[name] = t.clone() if t.data_ptr() == tensor.data_ptr() else t
            weight_map[name] = len(shards)
            size += nbytes
            total += nbytes
        flush()
        # transformers' names: one file is model.safetensors, else model-0000i-of-0000n + index
        n = len(shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            (tmp / f"shard-{i:05d}.safetensors").rename(tmp / name)
            os.chmod(tmp / name, 0o644)  # safetensors creates 0600 files; a model dir is shared
        if n > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: names[i] for k, i in sorted(weight_map.items())},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if config_src is not None:
            for f in Path(config_src).iterdir():
                if f.is_file():
                    (tmp / f.name).write_bytes(f.read_bytes())
            drop_gguf_quantization(tmp / "config.json")  # checkpoints saved before this was dropped
        elif model is not None:
            save_config_and_tokenizer(model, tokenizer, tmp, dtype)
        else:
            raise ValueError("write_hf_dir needs config_src or model for config.json")
        return commit_dir(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


def upload_dir(local: Path, url) -> Path:
    """Replace the object-store folder `url` with the files of `local`; returns its path object."""
    dest = storage_path(url)
    fs, root = dest.fs, dest.path.rstrip("/")
    if fs.exists(root):
        fs.rm(root, recursive=True)
    fs.put(f"{local}/", root, recursive=True)
    return dest


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """A checkpoint (`step_NNNNNNNN/`, in a folder or an object store) -> Hugging Face directory.
    Builds the model on the meta device from the checkpoint's own config, so only the
    checkpoint's tensors take memory."""
    ckpt = storage_path(ckpt_dir)
    if not is_complete(ckpt):
        raise FileNotFoundError(f"{ckpt} is not a complete rlcore checkpoint")
    problem = plain_load_problem(ckpt)
    if problem:
        raise ValueError(problem)
    if is_remote(ckpt):  # transformers reads config and tokenizer from a local folder
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlcore-hf-") as local:
            ckpt.fs.get(f"{(ckpt / HF_DIR).path}/", f"{local}/", recursive=True)
            return _export(ckpt, Path(local), out_dir)
    return _export(ckpt, ckpt / HF_DIR, out_dir)


def _export(ckpt, hf: Path, out_dir) -> Path:
    """Checkpoint `ckpt`'s model, built from the config and tokenizer in local folder `hf`, into `out_dir`."""
    config = AutoConfig.from_pretrained(hf)
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every parameter its own storage: re-tie (lm_head = embeddings)
    load_model_weights(model, ckpt)
    return write_hf_dir(out_dir, hub_named(model, exportable_tensors(model)), config_src=hf)


def used_folder(out: Path) -> str | None:
    """Why writing to `out` would replace something, or None (absent, or an empty directory)."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{str(out)!r} is a file"
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return None
    return f"{str(out)!r} is not empty ({len(entries)} entries, e.g. {entries[0]})"


USAGE = (
    "usage: python -m rlcore.export CHECKPOINT_DIR OUT_DIR [--force]   (CHECKPOINT_DIR: a step_NNNNNNNN "
    "directory, or a checkpoints directory: its newest; --force replaces a non-empty OUT_DIR)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    force = "--force" in argv
    argv = [a for a in argv if a != "--force"]
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if len(argv) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    src = storage_path(argv[0])
    if src.is_dir() and not is_complete(src):
        src = latest_checkpoint(src) or src
    if not is_complete(src):
        print(f"rlcore: export: {argv[0]!r} is not a complete checkpoint", file=sys.stderr)
        return 2
    used = used_folder(storage_path(argv[1]))
    if used and not force:
        print(f"rlcore: export: OUT_DIR {used}; choose another folder, or pass --force to replace it", file=sys.stderr)
        return 2
    try:
        out = export_checkpoint(src, argv[1])
    except ValueError as exc:
        print(f"rlcore: export: {exc}", file=sys.stderr)
        return 2
    print(f"rlcore: exported {src} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
