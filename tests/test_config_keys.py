"""Keys and the machine, checked before torch and Ray load: unknown keys (with or without `+`)
and misspelt environment arguments are refused with the nearest valid key; output_dir must be
writable and not hold another run; model.path must exist locally or in the hub cache when
offline; an empty environment split is refused; every problem is reported, the first key first."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config.errors import ConfigError
from rlcore.config.reward import MOVED as MOVED_ENV_ARGS
from rlcore.engine.registry import inert_options
from rlcore.envs import build_env
from rlcore.plan.compose import compose, recipes
from rlcore.plan.validate import validate
from rlcore.run import main

REPO = Path(__file__).resolve().parent.parent


def errors(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "override,first",
    [
        ("+stepz=3", "stepz: unknown key; did you mean 'steps'?"),
        ("stepz=3", "stepz: unknown key; did you mean 'steps'?"),
        ("+trainer.lrr=0.1", "trainer.lrr: unknown key in trainer; did you mean 'trainer.lr'?"),
        (
            "++rollout.sampling.temprature=0.5",
            "rollout.sampling.temprature: unknown key in rollout.sampling; "
            "did you mean 'rollout.sampling.temperature'?",
        ),
        (
            "rollout.sleep_levl=1",
            "rollout.sleep_levl: unknown key in rollout; did you mean 'rollout.vllm.sleep_level'?",
        ),
        (
            "env.args.instrucion=Reverse",
            "env.args.instrucion: not an argument of environment 'reverse_text'; did you mean 'env.args.instruction'?",
        ),
        # a key of another section, named exactly
        ("rollout.batch_groups=2", "rollout.batch_groups: unknown key in rollout; did you mean 'algo.batch_groups'?"),
        # a config group's option: the nearest one and all of them
        (
            "env=revers_text",
            "env: unknown option 'revers_text'; did you mean 'reverse_text'?; choose one of "
            "['alphabet_sort', 'math', 'mini_swe', 'reverse_text', 'shape_count', 'tool_use', "
            "'verifiers', 'wordle']",
        ),
    ],
)
def test_unknown_key_is_refused_with_the_nearest_one(override, first, tmp_path, capsys):
    assert main([override, f"output_dir={tmp_path}", "dry_run=true"]) == 2
    assert errors(capsys) == [f"rlcore: config error: {first}"]


def test_env_args_are_typed_per_environment(tmp_path):
    """`env.args.KEY=...` needs no `+` for an argument of the chosen environment's constructor."""
    cfg = compose(["env.args.instruction=Reverse this:", "+env.args.eval_size=8", f"output_dir={tmp_path}"])
    assert cfg.env.args["instruction"] == "Reverse this:" and cfg.env.args["eval_size"] == 8
    validate(cfg)
    cfg = compose(["env=wordle", "env.args.max_turns=3", f"output_dir={tmp_path}"])
    validate(cfg)


def add_recipe(tmp_path, monkeypatch, name: str, body: str) -> None:
    """A copy of conf/ in `tmp_path` with recipe `name` (`body` under `# @package _global_`),
    which `compose(["+recipe=NAME"])` then reads."""
    import rlcore.plan.compose as run

    conf = tmp_path / "conf"
    shutil.copytree(run.CONF_DIR, conf)  # follows conf/recipe's link to recipes/
    (conf / "recipe" / f"{name}.yaml").write_text("# @package _global_\n" + body)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / f"{name}.yaml").write_text("")
    monkeypatch.setattr(run, "CONF_DIR", conf)
    monkeypatch.setattr(run, "RECIPES_DIR", tmp_path / "recipes")


def test_an_unknown_key_in_a_yaml_file_is_refused(tmp_path, monkeypatch):
    add_recipe(tmp_path, monkeypatch, "typo", "steps: 3\ntrainer:\n  max_grad_nrom: 0.5\n")
    with pytest.raises(
        ConfigError, match=r"trainer.max_grad_nrom: unknown key in trainer; did you mean .trainer.max_grad_norm."
    ):
        compose(["+recipe=typo"])


def test_all_problems_are_reported_first_key_first(tmp_path, capsys):
    assert main(["trainer.lr=-1", "steps=0", "algo.group_size=1", f"output_dir={tmp_path}", "dry_run=true"]) == 2
    err = errors(capsys)
    assert err[0] == "rlcore: config error: steps: must be > 0, got 0"
    assert any(line.startswith("rlcore: config error: trainer.lr: must be > 0") for line in err[1:]), err
    assert any(line.startswith("rlcore: config error: algo.group_size:") for line in err[1:]), err


@pytest.mark.parametrize("path", ["/proc/forbidden/x", "/sys/x"])
def test_output_dir_that_cannot_be_created(path, capsys):
    assert main([f"output_dir={path}"]) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"rlcore: config error: output_dir: '{path}' cannot be"), err


def test_output_dir_below_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main([f"output_dir={tmp_path / 'f' / 'run'}"]) == 2
    assert errors(capsys)[0].startswith("rlcore: config error: output_dir: ")


def test_a_fresh_run_refuses_a_folder_that_holds_a_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    assert main([f"output_dir={tmp_path}"]) == 2
    assert errors(capsys) == [
        f"rlcore: config error: output_dir: '{tmp_path}' already holds a run "
        "(metrics.jsonl); continue it with resume=true, or choose a new output_dir"
    ]
    with pytest.raises(ConfigError, match="checkpoint.resume: true found no complete checkpoint"):
        validate(compose([f"output_dir={tmp_path}", "resume=true"]))  # its rows but no checkpoint: kept, refused
    ck = tmp_path / "checkpoints" / "step_00000001"
    (ck / "trainer").mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    (ck / "trainer" / ".metadata").write_text("")
    validate(compose([f"output_dir={tmp_path}", "resume=true"]))  # continuing it from its checkpoint is fine
    with pytest.raises(ConfigError, match="output_dir: .* already holds a run"):
        validate(compose([f"output_dir={tmp_path}", "mode=eval"]))  # an eval never writes into a run


def test_each_mode_has_its_own_default_output_dir():
    dirs = {mode: compose([f"mode={mode}"]).output_dir for mode in ("rl", "sft", "eval")}
    assert dirs == {"rl": "outputs/rl", "sft": "outputs/sft", "eval": "outputs/eval"}


def test_model_path_offline_not_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["model.path=some-org/not-cached-model", "model.tokenizer=auto", f"output_dir={tmp_path / 'o'}"]) == 2
    err = errors(capsys)
    assert len(err) == 1, err
    assert err[0].startswith(
        "rlcore: config error: model.path: 'some-org/not-cached-model' is not a local "
        "directory and not in the Hugging Face cache (HF_HUB_OFFLINE=1)"
    ), err
    assert "local model directory" in err[0]


def test_model_path_neither_directory_nor_hub_id(tmp_path, capsys):
    assert main(["model.path=no/such/model_dir", "model.tokenizer=auto", f"output_dir={tmp_path / 'o'}"]) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith("rlcore: config error: model.path: 'no/such/model_dir' is neither"), err


@pytest.mark.parametrize("mode", ["rl", "eval"])
def test_an_empty_environment_dataset_is_refused(mode, tmp_path, capsys):
    # the test suite's v1 taskset (tests/test_verifiers_env.py) asked for no tasks
    assert (
        main(
            [
                "env=verifiers",
                "env.args.taskset=test_verifiers_env",
                "env.args.env_config={taskset: {num_tasks: 0}}",
                "env.args.allow_host_tools=true",
                "sft.warmup_steps=0",
                f"mode={mode}",
                f"output_dir={tmp_path}",
            ]
        )
        == 2
    )
    assert errors(capsys) == ["rlcore: config error: env.args.taskset: taskset 'test_verifiers_env' yielded no tasks"]


def test_validation_does_not_import_torch(tmp_path):
    """Values are validated before torch (seconds of import on a loaded machine) is loaded."""
    code = (
        "import sys\nfrom rlcore.run import main\n"
        f"rc = main(['trainer.lr=-1', 'output_dir={tmp_path}'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
        "print(rc, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2 []", (out.stdout, out.stderr[-2000:])
    assert out.stderr.strip().splitlines() == ["rlcore: config error: trainer.lr: must be > 0, got -1.0"]


def test_gguf_packages_are_checked_before_start(tmp_path, monkeypatch):
    """`model.gguf_file` needs gguf and accelerate (locked dependencies); a missing one is a
    config error before Ray starts, not a dead rollout actor after it."""
    import importlib.util

    import rlcore.models.source as source

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "model.gguf").write_bytes(b"GGUF")
    cfg = compose(
        [
            f"model.path={model_dir}",
            "model.gguf_file=model.gguf",
            "model.tokenizer=auto",
            f"output_dir={tmp_path / 'o'}",
        ]
    )
    assert [p for p in validate_problems(cfg) if p[0] == "model.gguf_file"] == []
    real = importlib.util.find_spec
    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    assert [p for p in validate_problems(cfg) if p[0].startswith("model.")] == [
        ("model.gguf_file", "loading a GGUF file needs the package(s) ['gguf']: pip install gguf")
    ]


def validate_problems(cfg):
    from rlcore.plan.validate import problems

    return problems(cfg)


@pytest.mark.parametrize(
    "override,moved",
    [
        ("rollout.tensor_parallel_size=2", "rollout.vllm.tensor_parallel_size"),
        ("rollout.weight_reload=direct", "rollout.vllm.weight_reload"),
        ("rollout.kv_on_update=recompute", "rollout.vllm.kv_on_update"),
        ("rollout.quantization=fp8", "rollout.vllm.quantization"),
        ("rollout.sleep_level=2", "rollout.vllm.sleep_level"),
        ("+rollout.engine_kwargs.enforce_eager=true", "rollout.vllm.engine_kwargs.enforce_eager"),
        ("rollout.engine_kwargs={}", "rollout.vllm.engine_kwargs"),
        ("teacher.tensor_parallel_size=2", "teacher.vllm.tensor_parallel_size"),
        ("+teacher.engine_kwargs.gpu_memory_utilization=0.2", "teacher.vllm.engine_kwargs.gpu_memory_utilization"),
    ],
)
def test_an_engine_option_at_its_old_flat_key_names_its_section(override, moved, tmp_path, capsys):
    """The vLLM options moved from `rollout.*` / `teacher.*` to the engine's own section."""
    old = override.lstrip("+").partition("=")[0]
    assert main([override, "rollout.engine=vllm", f"output_dir={tmp_path}", "dry_run=true"]) == 2
    assert errors(capsys) == [f"rlcore: config error: {old}: moved to {moved} (an engine's own section)"]


def test_a_recipe_with_an_old_flat_key_is_refused_with_its_new_one(tmp_path, monkeypatch):
    add_recipe(tmp_path, monkeypatch, "old", "rollout:\n  engine: vllm\n  sleep_level: 1\n")
    with pytest.raises(ConfigError, match=r"^rollout.sleep_level: moved to rollout.vllm.sleep_level"):
        compose(["+recipe=old"])


OLD_REWARD_VALUES = {
    "reward_timeout_s": 300.0,
    "on_reward_error": "zero",
    "reward_isolation": "thread",
    "max_abandoned_threads": 7,
    "reward_memory_mb": 100,
    "reward_network": True,
}


@pytest.mark.parametrize("old,new", sorted(MOVED_ENV_ARGS.items()))
def test_a_reward_runtime_key_in_env_args_is_carried_to_env_reward_with_one_warning(old, new, capsys):
    """The reward runtime's policy moved from `env.args` to its own section `env.reward`: a config
    that still sets it there keeps its meaning (the value lands in `env.reward`, the environment
    runs with it) and says so in one line naming both keys."""
    value = OLD_REWARD_VALUES[old]
    shown = str(value).lower() if isinstance(value, bool) else value
    cfg = compose([f"env.args.{old}={shown}"])
    assert getattr(cfg.env.reward, new) == value and old not in cfg.env.args
    assert errors(capsys) == [
        f"rlcore: warning: env.args.{old}: moved to env.reward.{new}; carried there (write env.reward.{new}={value})"
    ]
    validate(cfg)
    assert getattr(build_env(cfg.env).reward_runtime, new) == value


def test_a_reward_runtime_key_set_in_both_places_is_refused_naming_both(tmp_path, capsys, monkeypatch):
    import rlcore.run as run

    monkeypatch.setattr(run, "start_ray", lambda *a, **k: pytest.fail("Ray started"))
    assert main(["env.args.reward_timeout_s=300", "env.reward.timeout_s=5", f"output_dir={tmp_path}"]) == 2
    assert errors(capsys) == [
        "rlcore: config error: env.args.reward_timeout_s: the old place of env.reward.timeout_s, which is set "
        "too (300 here, 5.0 there): keep env.reward.timeout_s only"
    ]


def test_a_recipe_with_a_reward_runtime_key_in_env_args_still_runs_with_it(tmp_path, monkeypatch, capsys):
    add_recipe(tmp_path, monkeypatch, "old", "env:\n  args:\n    reward_timeout_s: 300.0\n")
    cfg = compose(["+recipe=old", f"output_dir={tmp_path / 'out'}"])
    validate(cfg)
    assert cfg.env.reward.timeout_s == 300.0 and "reward_timeout_s" in capsys.readouterr().err
    cfg = compose(["env.reward.timeout_s=300", "env.reward.on_error=zero", f"output_dir={tmp_path / 'new'}"])
    validate(cfg)
    assert (cfg.env.reward.timeout_s, cfg.env.reward.on_error) == (300.0, "zero")
    assert capsys.readouterr().err == ""


def test_an_unset_reward_deadline_is_the_environments_own():
    """`env.reward.timeout_s` unset: 10 s, or what the environment declares (mini_swe runs a
    repo's tests in its reward: 60 s); set, it is the same for every environment."""
    assert compose([]).env.reward.timeout_s is None
    assert build_env(compose([]).env).reward_runtime.timeout_s == 10.0
    assert build_env(compose(["env=mini_swe"]).env).reward_runtime.timeout_s == 60.0
    assert build_env(compose(["env=mini_swe", "env.reward.timeout_s=40"]).env).reward_runtime.timeout_s == 40.0


def test_another_engines_option_is_refused_on_the_command_line_and_warned_from_a_recipe(tmp_path, capsys):
    """Typed now for an engine the run does not select: a mistake (exit 2). Carried by a recipe
    written for another engine (`+recipe=math_qwen3 rollout.engine=hf`): one warning line, ignored."""
    assert main(["rollout.vllm.sleep_level=2", f"output_dir={tmp_path}", "dry_run=true"]) == 2
    assert errors(capsys) == [
        "rlcore: config error: rollout.vllm.sleep_level: an option of the vllm engine "
        "(rollout.engine=vllm), not of rollout.engine=hf: drop it or select that engine"
    ]
    import rlcore.run as run

    cfg = compose(["+recipe=math_qwen3", "rollout.engine=hf"])
    assert cfg.rollout.vllm.engine_kwargs == {"max_model_len": 5120}  # kept, not read
    run.warn_inert(cfg)
    assert errors(capsys) == [
        "rlcore: warning: rollout.vllm.engine_kwargs: an option of the vllm engine "
        "(rollout.engine=vllm), not of rollout.engine=hf: ignored"
    ]
    run.warn_inert(compose(["+recipe=math_qwen3"]))  # its own engine: nothing to say
    assert errors(capsys) == []


@pytest.mark.parametrize("recipe", recipes())
def test_every_recipe_composes_with_its_engines_own_sections(recipe):
    """No recipe carries a flat engine key (refused above) or options of an engine it does not select."""
    assert inert_options(compose([f"+recipe={recipe}"])) == []


def test_a_comma_value_without_multirun_hints_at_m(tmp_path, capsys):
    assert main(["trainer.lr=1e-3,3e-3", f"output_dir={tmp_path}", "dry_run=true"]) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith("rlcore: config error: "), err
    assert err[0].endswith("add -m: python -m rlcore.run -m trainer.lr=1e-3,3e-3"), err
