"""Property test: random wrong types, out-of-range values and impossible layouts each give a
first line naming the key (further problems follow on their own lines) and exit code 2, before anything starts (`dry_run=true` would print a plan
and exit 0 for a valid config; nothing here may reach that)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore.run import main

POSITIVE_INT = [
    "steps",
    "trainer.world_size",
    "trainer.micro_batch_tokens",
    "rollout.num_actors",
    "rollout.tasks_per_request",
    "rollout.max_requests_per_actor",
    "rollout.sampling.max_new_tokens",
    "algo.batch_groups",
    "sft.batch_examples",
]
POSITIVE_FLOAT = [
    "trainer.lr",
    "trainer.cpus_per_rank",
    "trainer.step_timeout_s",
    "rollout.cpus_per_actor",
    "rollout.generate_timeout_s",
    "rollout.weight_sync_timeout_s",
    "rollout.sync_bucket_mb",
    "cluster.placement_timeout_s",
]
NON_NEGATIVE = [
    "trainer.max_grad_norm",
    "trainer.weight_decay",
    "algo.clip_eps_low",
    "algo.clip_eps_high",
    "algo.max_off_policy_steps",
    "rollout.sampling.temperature",
    "trainer.gpus_per_rank",
    "trainer.max_restarts",
]
ENUMS = [
    "rollout.engine",
    "algo.name",
    "algo.loss",
    "model.dtype",
    "mode",
    "trainer.activation_checkpointing",
    "trainer.lr_schedule",
    "trainer.param_dtype",
]
NUMERIC = POSITIVE_INT + POSITIVE_FLOAT + NON_NEGATIVE

wrong_type = st.sampled_from(["abc", "[1,2]", "{a:1}", "true_ish", "1e400x"])
garbage_name = st.text(alphabet="qxzjkw_", min_size=3, max_size=8)


def check(overrides: list[str], keys: tuple[str, ...], capsys) -> None:
    rc = main([*overrides, "dry_run=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (overrides, err)
    assert err and all(line.startswith("rlcore: config error: ") for line in err), err
    assert err[0].startswith(tuple(f"rlcore: config error: {k}" for k in keys)), (overrides, err[0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(NUMERIC), value=wrong_type)
def test_wrong_type(key, value, capsys):
    check([f"{key}={value}"], (key,), capsys)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(POSITIVE_INT + POSITIVE_FLOAT), value=st.integers(min_value=-(10**6), max_value=0))
def test_not_positive(key, value, capsys):
    check([f"{key}={value}"], (key,), capsys)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(NON_NEGATIVE), value=st.floats(min_value=-1e6, max_value=-1e-3))
def test_negative(key, value, capsys):
    check([f"{key}={value}"], (key,), capsys)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(ENUMS), value=garbage_name)
def test_unknown_choice(key, value, capsys):
    check([f"{key}={value}"], (key,), capsys)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(2, 16), cp=st.integers(2, 8), ep=st.integers(2, 8))
def test_impossible_layouts(world, cp, ep, capsys):
    """dp * cp must equal the world size and ep must divide it; an MoE-free model rejects ep > 1."""
    overrides = [
        f"trainer.world_size={world}",
        f"trainer.cp={cp}",
        f"trainer.ep={ep}",
        f"trainer.dp={world // cp + 1}",
        "cluster.nodes=64",
    ]
    check(overrides, ("trainer.dp", "trainer.cp", "trainer.ep", "trainer.world_size"), capsys)
