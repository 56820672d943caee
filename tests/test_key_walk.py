"""A key walks from the schema to the code that acts on it (`python -m rlcore.plan.walk KEY`):
each key is read through its section object in a bounded set of places, one meaning per section."""

import dataclasses

from rlcore.config import HFOptions, VLLMOptions
from rlcore.plan.reference import keys
from rlcore.plan.walk import main, module_reads, read_sites, sections


def functions(key: str) -> set[str]:
    return {f"{site.path}:{site.function}" for site in read_sites(key)}


def test_max_requests_per_actor_has_one_meaning_per_section():
    """The rollout's key is its engine's generation slots: every number derived from it (requests
    kept at an actor, its threads, a prefill actor's threads) comes from one place; the teacher's
    key is its own field, the score calls in flight at a teacher actor."""
    assert functions("rollout.max_requests_per_actor") == {"rlcore/engine/slots.py:RequestLimits.of"}
    assert functions("teacher.max_requests_per_actor") == {"actors/teacher.py:TeacherStage.__init__"}


def test_the_staleness_bound_is_read_in_a_bounded_set_of_places():
    """`algo.max_off_policy_steps`: the driver's buffer and launch rule (the rule itself is
    `rlcore.batch.staleness`, handed the number), the weight sync's canary, and the plan's
    memory, placement and printed plan."""
    assert functions("algo.max_off_policy_steps") <= {
        "actors/driver.py:Driver.__init__",
        "actors/driver.py:Driver.launch",
        "actors/weights.py:WeightSync.check_canary",
        "rlcore/plan/memory.py:max_sequences_per_engine",
        "rlcore/plan/placement.py:placement_problems",
        "rlcore/plan/layout.py:format_plan",
    }


def test_every_key_of_the_schema_is_read_somewhere():
    """Every key but an engine's own options (the engine reads its section whole, by option name:
    `rlcore.engine.registry`) is read through its section object somewhere in the code."""
    engine_sections = {path for path, cls in sections().items() if cls in (VLLMOptions, HFOptions)}
    unread = [key for key, *_ in keys() if not read_sites(key) and key.rpartition(".")[0] not in engine_sections]
    assert unread == []


def test_the_walk_follows_aliases_typed_parameters_and_members():
    source = """
from rlcore.config import RolloutConfig

def a(cfg):
    r = cfg.rollout
    return r.max_requests_per_actor

def b(rollout: RolloutConfig):
    return getattr(rollout, "tasks_per_request")

class C:
    def __init__(self, cfg):
        self.pd = cfg.rollout.pd
    def d(self, other):
        return self.pd.retry_after_s + other.max_requests_per_actor
"""
    reads = {k: [f"{s.function}:{s.line}" for s in v] for k, v in module_reads(source, "x.py").items()}
    assert reads["rollout.max_requests_per_actor"] == ["a:6"]  # not `other.` (an unknown object)
    assert reads["rollout.tasks_per_request"] == ["b:9"]
    assert reads["rollout.pd.retry_after_s"] == ["C.d:15"]


def test_the_walk_follows_a_section_built_copied_or_chosen_in_code():
    """An environment keeps its own copy of `env.reward` (or the defaults when none is given):
    `x if c else y`, `dataclasses.replace(section)` and `RewardRuntimeConfig()` hold that section."""
    source = """
import dataclasses
from rlcore.config.reward import RewardRuntimeConfig

class E:
    def __init__(self, reward_runtime=None):
        runtime = RewardRuntimeConfig() if reward_runtime is None else dataclasses.replace(reward_runtime)
        self.runtime = runtime
    def f(self):
        return self.runtime.timeout_s
"""
    reads = {k: [f"{s.function}:{s.line}" for s in v] for k, v in module_reads(source, "x.py").items()}
    assert reads["env.reward.timeout_s"] == ["E.f:10"]


def test_the_walk_command_prints_the_sites(capsys):
    assert main(["rollout.max_requests_per_actor"]) == 0
    assert "rlcore/engine/slots.py" in capsys.readouterr().out
    assert main(["rollout.no_such_key"]) == 1
    assert all(dataclasses.is_dataclass(cls) for cls in sections().values())
