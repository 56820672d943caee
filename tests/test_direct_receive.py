"""DirectReceiver: the recorded-loader replay lands every tensor exactly where vLLM-style weight
loaders put it, and anything it cannot replay stays on the loader."""

import math

import pytest
import torch

from rlcore.engine.vllm.direct_receive import DirectReceiver, bucket_layout


class FusedModel(torch.nn.Module):
    """A vLLM-like model: q/k/v fused into one parameter, a padded embedding, a loader that
    converts one weight (not replayable), and a skipped (tied) weight."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(10, 4))  # q: 6 rows, k: 2, v: 2
        self.embed = torch.nn.Parameter(torch.zeros(8, 4))  # vocabulary 5 padded to 8
        self.scaled = torch.nn.Parameter(torch.zeros(3))
        self.calls = 0

    def load_weights(self, weights):
        for name, w in weights:
            self.calls += 1
            if name in ("q", "k", "v"):
                start = {"q": 0, "k": 6, "v": 8}[name]
                self.qkv.data.narrow(0, start, w.shape[0]).copy_(w)
            elif name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
            elif name == "scaled":  # converts before copying: must stay on the loader
                self.scaled.data.copy_(w.float() * 2)
            elif name == "lm_head":  # tied to embed: the loader skips it
                continue
            else:
                raise KeyError(name)


def trainer_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        ("q", torch.randn(6, 4, generator=g)),
        ("k", torch.randn(2, 4, generator=g)),
        ("v", torch.randn(2, 4, generator=g)),
        ("embed", torch.randn(5, 4, generator=g)),
        ("scaled", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("lm_head", torch.randn(5, 4, generator=g)),
    ]


def info_for(tensors, bucket_bytes, nbuf=2):
    return dict(
        names=[n for n, _ in tensors],
        dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in tensors],
        shapes=[list(t.shape) for _, t in tensors],
        packed=True,
        packed_buffer_size_bytes=bucket_bytes,
        packed_num_buffers=nbuf,
    )


def wire(tensors, bucket_bytes):
    """The packed buckets a sender broadcasts (vLLM's producer rule), as a queue of byte tensors."""
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    return [
        torch.cat([tensors[i][1].contiguous().view(-1).view(torch.uint8) for i in idx])
        for idx in bucket_layout(sizes, bucket_bytes)
    ]


def receive(receiver, tensors, bucket_bytes):
    queue = wire(tensors, bucket_bytes)

    def broadcast(buf):
        src = queue.pop(0)
        assert buf.numel() == src.numel()
        buf.copy_(src)

    stats = receiver.receive(info_for(tensors, bucket_bytes), broadcast)
    assert not queue
    return stats


def expected(tensors):
    ref = FusedModel()
    ref.load_weights(tensors)
    return ref


def test_bucket_layout_follows_the_packed_wire_rule():
    # a bucket closes right after the tensor that takes it past the size
    assert bucket_layout([4, 4, 4, 4, 4], 8) == [[0, 1, 2], [3, 4]]
    assert bucket_layout([10, 1], 8) == [[0], [1]]
    assert bucket_layout([1, 1], 100) == [[0, 1]]


def test_plan_then_replay_matches_the_loader_exactly():
    for bucket_bytes in (40, 10_000):  # several buckets over 2 rotating buffers, and one bucket
        model = FusedModel()
        rx = DirectReceiver(model.load_weights, "cpu")
        for step in range(3):
            tensors = trainer_tensors(step)
            stats = receive(rx, tensors, bucket_bytes)
            ref = expected(tensors)
            for name in ("qkv", "embed", "scaled"):
                assert torch.equal(getattr(model, name), getattr(ref, name)), (bucket_bytes, step, name)
            assert stats["planning"] == (step == 0)
            # q, k, v and embed replay as copies; the converting and the skipped one stay on the loader
            assert (stats["planned"], stats["fallback"]) == (4, 2)
        assert torch.count_nonzero(model.embed[5:]) == 0  # padding rows untouched


def test_replay_calls_the_loader_only_for_unplanned_tensors():
    model = FusedModel()
    rx = DirectReceiver(model.load_weights, "cpu")
    receive(rx, trainer_tensors(0), 10_000)
    model.calls = 0
    receive(rx, trainer_tensors(1), 10_000)
    assert model.calls == 2  # scaled and lm_head


def test_a_new_layout_is_planned_afresh():
    model = FusedModel()
    rx = DirectReceiver(model.load_weights, "cpu")
    receive(rx, trainer_tensors(0), 10_000)
    tensors = trainer_tensors(1)[:3]  # another update layout (q, k, v only)
    stats = receive(rx, tensors, 10_000)
    assert stats["planning"] and stats["planned"] == 3
    assert torch.equal(model.qkv, torch.cat([t for _, t in tensors]))
    assert math.isclose(float(model.scaled.detach().sum()), float(expected(trainer_tensors(0)).scaled.detach().sum()))


def test_a_loader_that_changes_the_weight_after_copying_is_not_replayed():
    class PostProcessed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)
                self.w.data.mul_(2)  # processing after the copy: replaying the copy alone is wrong

    model = PostProcessed()
    rx = DirectReceiver(model.load_weights, "cpu")
    for step in range(2):
        t = torch.randn(4)
        stats = receive(rx, [("w", t)], 10_000)
        assert stats["fallback"] == 1 and torch.equal(model.w.detach(), t * 2)


def test_reallocated_parameters_are_planned_afresh():
    model = FusedModel()
    rx = DirectReceiver(model.load_weights, "cpu", fingerprint=lambda: tuple(p.data_ptr() for p in model.parameters()))
    receive(rx, trainer_tensors(0), 10_000)
    model.qkv.data = torch.zeros(10, 4)  # e.g. a layerwise reload re-materialised the layer
    tensors = trainer_tensors(1)
    stats = receive(rx, tensors, 10_000)
    assert stats["planning"]
    assert torch.equal(model.qkv.detach(), expected(tensors).qkv.detach())


def test_in_place_receive_reads_straight_from_a_shared_flat_buffer():
    """Colocated (CUDA IPC) receive: the trainer's flat buffer holds every bucket back to back;
    planned copies read from it directly, so rewriting it and receiving again lands new weights."""
    for bucket_bytes in (40, 10_000):
        model = FusedModel()
        rx = DirectReceiver(model.load_weights, "cpu")
        tensors = trainer_tensors(0)
        flat = torch.cat(wire(tensors, bucket_bytes))  # one persistent buffer, as the sender keeps it
        for step in range(3):
            tensors = trainer_tensors(step)
            flat.copy_(torch.cat(wire(tensors, bucket_bytes)))  # the sender's fill
            stats = rx.receive_in_place(info_for(tensors, bucket_bytes), flat)
            ref = expected(tensors)
            for name in ("qkv", "embed", "scaled"):
                assert torch.equal(getattr(model, name), getattr(ref, name)), (bucket_bytes, step, name)
            assert stats["planning"] == (step == 0) and (stats["planned"], stats["fallback"]) == (4, 2)
        other = flat.clone()  # another buffer (a rebuilt sender): planned afresh, not replayed from the old one
        assert rx.receive_in_place(info_for(tensors, bucket_bytes), other)["planning"]


def test_in_place_receive_refuses_a_buffer_smaller_than_the_update():
    """The trainer's buffer (mapped over CUDA IPC) must hold every bucket: a short one is refused
    before anything is loaded, naming both sizes."""
    model = FusedModel()
    rx = DirectReceiver(model.load_weights, "cpu")
    tensors = trainer_tensors(0)
    flat = torch.cat(wire(tensors, 10_000))
    info = info_for(tensors, 10_000)
    with pytest.raises(RuntimeError, match=f"holds {flat.numel() - 4} bytes, the update needs {flat.numel()}"):
        rx.receive_in_place(info, flat[:-4])
    assert model.calls == 0
