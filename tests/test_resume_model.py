"""A checkpoint carries its model config: `mode=eval resume=CKPT` and `resume=true` build the
checkpoint's model, not the default one; a model key set to something else on the command line
is one config error before Ray starts (it used to end in a RayTaskError size mismatch)."""

import json

import pytest

from rlcore.config.errors import ConfigError
from rlcore.plan.compose import compose
from rlcore.run import main
from rlcore.storage.checkpoint_dirs import META, TRAINER_DIR


def fake_checkpoint(root, step=3, **model_changes):
    """A complete checkpoint directory whose meta.json records a model unlike the default."""
    saved = compose([f"output_dir={root}"])
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.structured(saved))
    config["model"]["arch"].update(model_changes)
    path = root / "checkpoints" / f"step_{step:08d}"
    (path / TRAINER_DIR).mkdir(parents=True)
    (path / TRAINER_DIR / ".metadata").write_text("")
    (path / META).write_text(json.dumps({"step": step, "mode": "rl", "config": config}))
    return path


def test_eval_of_a_checkpoint_uses_its_model(tmp_path):
    path = fake_checkpoint(tmp_path / "rl", hidden_size=64, num_hidden_layers=1)
    cfg = compose(["mode=eval", f"resume={path.parent}", f"output_dir={tmp_path / 'eval'}"])
    assert cfg.model.arch["hidden_size"] == 64 and cfg.model.arch["num_hidden_layers"] == 1


def test_resume_uses_the_checkpoint_model(tmp_path):
    fake_checkpoint(tmp_path / "rl", hidden_size=64)
    cfg = compose(["resume=true", f"output_dir={tmp_path / 'rl'}"])
    assert cfg.model.arch["hidden_size"] == 64


def test_a_conflicting_model_override_is_one_config_error(tmp_path, capsys):
    path = fake_checkpoint(tmp_path / "rl", hidden_size=64)
    with pytest.raises(ConfigError, match=r"^model.arch: the checkpoint .* was saved with model.arch="):
        compose(["mode=eval", f"resume={path}", "model.arch.hidden_size=128", f"output_dir={tmp_path / 'e'}"])
    assert main(["mode=eval", f"resume={path}", "model=qwen3_06b_char", f"output_dir={tmp_path / 'e'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlcore: config error: model.arch: the checkpoint"), err


def test_a_setting_may_differ_from_the_checkpoint(tmp_path):
    path = fake_checkpoint(tmp_path / "rl", hidden_size=64)
    cfg = compose(["mode=eval", f"resume={path}", "model.dtype=bfloat16", f"output_dir={tmp_path / 'e'}"])
    assert cfg.model.dtype == "bfloat16" and cfg.model.arch["hidden_size"] == 64
