"""Shared GPU harness for the vLLM engine test and benchmarks (not part of the library).

A "trainer" is a plain torch process on its own GPU holding a random-weight transformers model in
bf16; it can take a fake optimizer step (every weight set to its initial value times
``1 + scale * noise``, fresh noise per step, so steps never compound and the model keeps its
scale), send its weights
through :mod:`rlcore.transfer.nccl`, and compute teacher-forced logprobs for the canary. The
engine side is a :class:`rlcore.engine.vllm.vllm_engine.VLLMEngine` in the calling process, started on
another GPU with ``load_format="dummy"`` from a directory holding only ``config.json``.

The calling process never touches CUDA itself: each process gets its GPU through
``CUDA_VISIBLE_DEVICES`` when it is spawned.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast can wedge the shared host

# Qwen3 dense shapes (public configs of Qwen/Qwen3-0.6B and Qwen/Qwen3-4B).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}


def write_model_dir(shape: str, root: str | None = None, init_std: float = 0.02) -> str:
    """A directory with the ``config.json`` of a Qwen3 model of ``shape`` (no weights)."""
    from transformers import Qwen3Config

    path = tempfile.mkdtemp(prefix=f"rlcore-{shape}-", dir=root)
    cfg = Qwen3Config(**MODEL_SHAPES[shape], max_position_embeddings=4096, initializer_range=init_std)
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_main(conn: Any, model_dir: str, seed: int) -> None:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from rlcore.transfer import nccl
        from rlcore.transfer.plan import update_info_for
        from rlcore.weights.canary import teacher_forced_logprobs

        torch.cuda.set_device(0)
        cfg = AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        torch.set_default_dtype(torch.float32)
        model.eval().requires_grad_(False)
        params = [(n, p.detach()) for n, p in model.named_parameters()]
        # Steps perturb the initial weights afresh: compounding noise blows the logits up within a
        # few steps, and bf16 noise between any two implementations grows with them.
        base = [p.clone() for _, p in params]
        nbytes = sum(p.numel() * p.element_size() for _, p in params)
        sender = None
        conn.send(("ready", nbytes, len(params)))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                if sender is not None:
                    sender.abort("stopped")
                conn.send(("ok",))
                return
            try:
                if cmd == "init_sender":
                    addr, port, world_size, timeout = args
                    t = time.perf_counter()
                    sender = nccl.init_sender(addr, port, world_size, timeout_s=timeout)
                    conn.send(("ok", time.perf_counter() - t))
                elif cmd == "update_info":
                    bucket, nbuf = args
                    conn.send(("ok", update_info_for(params, bucket, nbuf)))
                elif cmd == "step_send":
                    scale, step_seed, send, bucket, nbuf, expect, timeout = args
                    gen = torch.Generator(device="cuda").manual_seed(step_seed)
                    with torch.no_grad():
                        for (_, p), p0 in zip(params, base):  # a fake step, big enough for the canary
                            noise = torch.randn(p.shape, device=p.device, dtype=torch.float32, generator=gen)
                            p.copy_(p0 * (1 + scale * noise).to(p.dtype))
                    torch.cuda.synchronize()
                    t_done = time.time()
                    conn.send(("stepped", t_done))
                    if send:
                        info = nccl.send_weights(
                            params, bucket, sender=sender, num_buffers=nbuf, timeout_s=timeout, expect=expect
                        )
                        conn.send(("sent", time.time(), info["stats"]))
                elif cmd == "send_only":
                    bucket, nbuf, expect, timeout = args
                    info = nccl.send_weights(
                        params, bucket, sender=sender, num_buffers=nbuf, timeout_s=timeout, expect=expect
                    )
                    conn.send(("sent", time.time(), info["stats"]))
                elif cmd == "logprobs":
                    pairs, temperature = args
                    conn.send(("ok", teacher_forced_logprobs(model, pairs, temperature)))
                elif cmd == "tensor":
                    conn.send(("ok", dict(params)[args[0]].to("cpu")))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class TrainerProc:
    """The trainer-like process on GPU ``gpu``; every wait is bounded."""

    def __init__(self, model_dir: str, gpu: str = "0", seed: int = 0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # read by the child at spawn
        try:
            self.proc = ctx.Process(target=_trainer_main, args=(child, model_dir, seed), daemon=True)
            self.proc.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.nbytes = self.num_tensors = None

    def wait_ready(self, timeout: float = 300) -> None:
        _, self.nbytes, self.num_tensors = self.recv(timeout)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float = 120) -> tuple:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise RuntimeError(f"trainer process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer process did not answer within {timeout} s")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError("trainer process: " + msg[1])
        return msg

    def call(self, *msg: Any, timeout: float = 120) -> Any:
        self.send(*msg)
        reply = self.recv(timeout)
        return reply[1] if len(reply) > 1 else None

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=10)
            except Exception:  # noqa: BLE001
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()


def connect(engine: Any, trainer: TrainerProc, timeout: float = 60) -> None:
    """Build the weight-transfer group: trainer rank 0, the engine's workers ranks 1..N."""
    port = free_port()
    world = 1 + engine.num_workers
    trainer.send("init_sender", "127.0.0.1", port, world, timeout)
    engine.init_weight_transfer("127.0.0.1", port, 1, world, timeout_s=timeout)
    trainer.recv(timeout)


def step_and_sync(
    engine: Any,
    trainer: TrainerProc,
    info: dict,
    version: int,
    *,
    scale: float = 0.5,
    seed: int = 0,
    send: bool = True,
    timeout: float = 120,
) -> dict:
    """Trainer step, then (if ``send``) trainer broadcast + engine receive, concurrently.
    ``e2e_s``: trainer step done (after its CUDA sync) -> ``receive_weights`` returned (engine
    resumed on the new weights)."""
    trainer.send(
        "step_send", scale, seed, send, info["packed_buffer_size_bytes"], info["packed_num_buffers"], info, timeout
    )
    _, t_done = trainer.recv(timeout)
    if not send:
        return {}
    times = engine.receive_weights(info, version, timeout_s=timeout)
    t_served = time.time()
    _, _, stats = trainer.recv(timeout)
    return dict(e2e_s=t_served - t_done, **times, **{f"trainer_{k}": v for k, v in stats.items()})


def canary(engine: Any, trainer: TrainerProc, pairs: list, **limits: Any) -> Any:
    """Engine vs trainer teacher-forced logprobs on ``pairs`` (result, never raises)."""
    from rlcore.weights.canary import compare_logprobs

    eng = engine.score_batch(pairs)
    ref = trainer.call("logprobs", pairs, 1.0)
    return compare_logprobs(eng, ref, raise_on_fail=False, **limits)


@contextlib.contextmanager
def trainer_and_engine(shape: str, bucket: int, engine_gpu: str = "1", **engine_kwargs: Any):
    """A trainer process on GPU 0 and an eager ``VLLMEngine`` (dummy weights) on ``engine_gpu``,
    joined in one weight-transfer group. Yields the state the GPU tests share: ``engine``,
    ``trainer``, ``info`` (update info for ``bucket``-byte buckets, 2 buffers), ``version``,
    ``step`` and the canary ``pairs``; shuts both down on exit."""
    from rlcore.engine.vllm.vllm_engine import VLLMEngine
    from rlcore.weights.canary import canary_prompts

    model_dir = write_model_dir(shape)
    trainer = TrainerProc(model_dir, gpu="0")  # builds its model while the engine starts
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu  # inherited by vLLM's engine-core process
    try:
        engine = VLLMEngine(
            model_dir,
            **{
                **dict(
                    load_format="dummy",
                    enforce_eager=True,
                    gpu_memory_utilization=0.4,
                    max_model_len=2048,
                    rpc_timeout_s=120,
                ),
                **engine_kwargs,
            },
        )
    except BaseException:
        trainer.close()
        raise
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    try:
        trainer.wait_ready()
        connect(engine, trainer)
        info = trainer.call("update_info", bucket, 2)
        yield dict(
            engine=engine,
            trainer=trainer,
            info=info,
            version=0,
            step=0,
            pairs=canary_prompts(151936, num_prompts=4, prompt_len=16, completion_len=16),
        )
    finally:
        engine.shutdown()
        trainer.close()
