import torch

from rlcore.weight_sync import TensorMeta, iter_buckets, plan_buckets, unpack_bucket


def metas():
    return [TensorMeta("a", (4, 4), "float32"), TensorMeta("b", (10,), "float32"),
            TensorMeta("c", (3,), "bfloat16"), TensorMeta("d", (100,), "float32")]


def test_buckets_split_by_size_and_dtype_in_order():
    plan = plan_buckets(metas(), bucket_bytes=26 * 4)
    assert [[m.name for m in b.metas] for b in plan.buckets] == [["a", "b"], ["c"], ["d"]]
    assert plan.names == ["a", "b", "c", "d"]
    assert plan.nbytes == (16 + 10 + 100) * 4 + 3 * 2


def test_pack_unpack_roundtrip():
    plan = plan_buckets(metas(), bucket_bytes=1 << 20)
    tensors = {m.name: torch.randn(m.shape).to(getattr(torch, m.dtype)) for m in metas()}
    out = {}
    for bucket, flat in iter_buckets(plan, iter(tensors.items())):
        out.update(dict(unpack_bucket(bucket, flat.clone())))
    for name, t in tensors.items():
        assert torch.equal(out[name], t)


def test_wrong_order_is_an_error():
    plan = plan_buckets(metas(), bucket_bytes=1 << 20)
    tensors = [(m.name, torch.zeros(m.shape)) for m in reversed(metas())]
    try:
        list(iter_buckets(plan, iter(tensors)))
    except ValueError as exc:
        assert "expected 'a'" in str(exc)
    else:
        raise AssertionError("mismatched order accepted")
