"""The vLLM compile cache across runs (issue 35): the random-weight model's directory is named by
its content (vLLM's compile-cache key holds the model path), vLLM's cache root is per user and per
vLLM/torch versions, and a start says whether the cache was hit. CPU only: no vLLM needed."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlcore.engine.vllm.vllm_cache import CompileCache, compile_cache, compile_key, content_hash, model_dir
from rlcore.engine.vllm.vllm_model_dir import engine_args
from rlcore.plan.compose import compose


def writer(text: str):
    def write(where: str) -> None:
        Path(where, "config.json").write_text(text)

    return write


def test_model_dir_is_named_by_content_and_shared(tmp_path):
    a = model_dir(writer('{"hidden_size": 64}'), tmp_path)
    assert model_dir(writer('{"hidden_size": 64}'), tmp_path) == a  # a second run: the same path
    b = model_dir(writer('{"hidden_size": 128}'), tmp_path)
    assert b != a and Path(b, "config.json").read_text() == '{"hidden_size": 128}'
    with ThreadPoolExecutor(4) as pool:  # engines of one run writing the same model at once
        paths = set(pool.map(lambda _: model_dir(writer('{"hidden_size": 256}'), tmp_path), range(8)))
    assert len(paths) == 1
    assert sorted(p.name for p in (tmp_path / "vllm-models").iterdir()) == sorted(Path(p).name for p in (a, b, *paths))
    assert content_hash(a).startswith(Path(a).name)


def test_random_model_engine_path_repeats_across_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CACHE_DIR", str(tmp_path))
    cfg = compose([f"output_dir={tmp_path}/run"])  # the default job's random-weight model
    first, kwargs = engine_args(cfg.rollout.vllm, cfg.model, seed=1)
    second, _ = engine_args(cfg.rollout.vllm, cfg.model, seed=2)
    assert first == second and Path(first).parent == tmp_path / "vllm-models"
    assert kwargs["load_format"] == "dummy" and (Path(first) / "config.json").is_file()


def test_compile_cache_hit_only_after_a_finished_start(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    args = {"model": "/m", "seed": 1, "max_model_len": 512, "enforce_eager": False}
    cache = compile_cache(args, device="NVIDIA H200")
    root = Path(os.environ["VLLM_CACHE_ROOT"])
    assert root.parent == tmp_path / "vllm" and root.name.startswith("vllm-")
    assert not cache.hit and cache.note().startswith("vLLM compile cache: miss")
    cache.started()
    again = compile_cache({**args, "seed": 7}, device="NVIDIA H200")  # another actor's seed: same graphs
    assert again.hit and again.note().startswith("vLLM compile cache: hit")
    assert not compile_cache({**args, "max_model_len": 1024}, device="NVIDIA H200").hit
    assert not compile_cache(args, device="NVIDIA A100").hit  # graphs of another GPU kind
    eager = compile_cache({**args, "enforce_eager": True}, device="NVIDIA H200")
    assert not eager.hit and "not used" in eager.note()


def test_user_cache_root_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    assert compile_cache({"model": "/m"}, device="").root == tmp_path / "mine"
    assert compile_key({"model": "/m", "seed": 1}) == compile_key({"model": "/m", "seed": 2})
    assert CompileCache(tmp_path, "k").marker == tmp_path / "rlcore_started" / "k"


def test_gated_deltanet_without_flashinfer_takes_the_triton_prefill(tmp_path, monkeypatch):
    # vLLM's sm90 default for Gated DeltaNet prefill imports flashinfer; where it is absent the
    # engine would die at start, so the args name the Triton kernel (an explicit choice wins)
    monkeypatch.setenv("RLCORE_CACHE_DIR", str(tmp_path))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    for name, hybrid in (
        ("tiny_qwen3_next", True),
        ("tiny_qwen3_5", True),
        ("tiny_nemotron_h", False),
        ("tiny_char", False),
    ):
        cfg = compose([f"model={name}"])
        _, kwargs = engine_args(cfg.rollout.vllm, cfg.model)
        assert kwargs.get("gdn_prefill_backend") == ("triton" if hybrid else None), name
    cfg = compose(
        ["model=tiny_qwen3_next", "rollout.engine=vllm", "+rollout.vllm.engine_kwargs.gdn_prefill_backend=flashinfer"]
    )
    assert engine_args(cfg.rollout.vllm, cfg.model)[1]["gdn_prefill_backend"] == "flashinfer"
