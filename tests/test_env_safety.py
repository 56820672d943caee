"""Reward safety: exceptions and hangs in reward / env code never stop the run."""

import os
import sys
import time
from pathlib import Path

import pytest

from rlcore.config.reward import RewardRuntimeConfig
from rlcore.engine.base import Generation, SamplingParams
from rlcore.envs.base import Environment
from rlcore.envs.multiturn import MultiTurnEnvironment
from rlcore.isolation.safety import call_many, call_with_deadline
from rlcore.models.tokenizer import char_tokenizer
from rlcore.types import Task

REPO = Path(__file__).resolve().parent.parent


class EchoEngine:
    """A deterministic engine for safety tests: always samples 'ok' then end-of-turn. The
    token-level behaviour of real engines is covered in test_env_multiturn.py."""

    def __init__(self, tok):
        self.ids = tok("ok", add_special_tokens=False).input_ids + [tok.eos_token_id]

    def generate(self, prompts, params):
        return [Generation(list(self.ids), [-0.5] * len(self.ids), [1] * len(self.ids), "stop") for _ in prompts]


class Scored(Environment):
    def __init__(self, behaviour, **kw):
        super().__init__(**kw)
        self.behaviour = behaviour

    def make_task(self, index, split):
        return Task(id=f"t/{index}", messages=[{"role": "user", "content": "hi"}], answer=str(index))

    def reward(self, task, completion):
        if self.behaviour == "raise":
            raise RuntimeError("broken reward")
        if self.behaviour == "hang":
            time.sleep(30)
        if self.behaviour == "spin":
            while True:
                pass
        if self.behaviour == "nan":
            return float("nan")
        return 1.0


def run(env, n=2):
    tok = char_tokenizer()
    return [
        s
        for g in env.run_groups([env.make_task(0, "train")], n, EchoEngine(tok), tok, SamplingParams(max_new_tokens=4))
        for s in g.samples
    ]


def test_good_reward():
    assert [s.reward for s in run(Scored("ok"))] == [1.0, 1.0]


@pytest.mark.parametrize("behaviour,expect", [("raise", "RuntimeError: broken reward"), ("nan", "not finite")])
def test_reward_error_fails_or_zeroes(behaviour, expect):
    for s in run(Scored(behaviour, reward_runtime=RewardRuntimeConfig(on_error="fail"))):
        assert s.failed and expect in s.error
    for s in run(Scored(behaviour, reward_runtime=RewardRuntimeConfig(on_error="zero"))):
        assert not s.failed and s.reward == 0.0 and expect in s.error


def test_hanging_reward_times_out_concurrently():
    start = time.monotonic()
    samples = run(Scored("hang", reward_runtime=RewardRuntimeConfig(timeout_s=0.5)), n=4)
    assert time.monotonic() - start < 3  # one shared deadline, not 4 x 0.5 s in sequence
    assert all(s.failed and "timeout after 0.5s" in s.error for s in samples)


def test_spinning_reward_is_killed_in_process_isolation():
    start = time.monotonic()
    samples = run(Scored("spin", reward_runtime=RewardRuntimeConfig(timeout_s=0.5, isolation="process")))
    assert time.monotonic() - start < 5
    assert all(s.failed and "timeout" in s.error for s in samples)
    assert [s.reward for s in run(Scored("ok", reward_runtime=RewardRuntimeConfig(isolation="process")))] == [1.0, 1.0]


class BrokenTurns(MultiTurnEnvironment):
    def make_task(self, index, split):
        return Task(id="b", messages=[{"role": "user", "content": "go"}])

    def env_response(self, task, history, state):
        raise ValueError("env bug")

    def score(self, task, history, state):
        return 1.0


def test_env_response_fault_is_recorded():
    samples = run(BrokenTurns(max_turns=3, reward_runtime=RewardRuntimeConfig(on_error="zero")))
    assert all(s.reward == 0.0 and not s.failed and "env_response: ValueError: env bug" in s.error for s in samples)


def test_guarded_calls():
    assert call_with_deadline(lambda x: x + 1, 1, timeout_s=1).value == 2
    out = call_many([(lambda: 1, ()), (lambda: 1 / 0, ())], timeout_s=1)
    assert out[0].value == 1 and "ZeroDivisionError" in out[1].error


@pytest.mark.parametrize(
    "key,value",
    [("timeout_s", -1), ("on_error", "drop"), ("isolation", "gpu"), ("max_abandoned_threads", -1), ("memory_mb", 1.5)],
)
def test_bad_reward_runtime_names_the_key(key, value):
    """A section built in code (tests, benchmarks) is checked against the schema's fields too."""
    with pytest.raises(ValueError, match=f"^env.reward.{key}: "):
        Scored("ok", reward_runtime=RewardRuntimeConfig(**{key: value}))


def test_an_environment_written_before_env_reward_keeps_its_keywords_and_attributes(caplog):
    """Environments written against the old constructor pass `reward_timeout_s=...` and read or
    set `self.reward_isolation`: both reach the reward section, with one warning per keyword and
    process; a keyword that contradicts the section given with it is refused."""

    class OldStyle(Scored):
        def __init__(self, answer, **kwargs):
            super().__init__(answer, reward_timeout_s=3.0, on_reward_error="zero", **kwargs)

    with caplog.at_level("WARNING", logger="rlcore"):
        env = OldStyle("ok")
        OldStyle("ok")
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "OldStyle: keyword reward_timeout_s: moved to env.reward.timeout_s; carried there (write env.reward.timeout_s=3.0)",
        "OldStyle: keyword on_reward_error: moved to env.reward.on_error; carried there (write env.reward.on_error=zero)",
    ]
    assert (env.reward_runtime.timeout_s, env.reward_runtime.on_error) == (3.0, "zero")
    assert (env.reward_timeout_s, env.on_reward_error, env.reward_isolation) == (3.0, "zero", "worker")
    env.reward_isolation = "thread"
    assert env.reward_runtime.isolation == "thread"
    with pytest.raises(ValueError, match=r"^env.args.reward_timeout_s: the old place of env.reward.timeout_s"):
        OldStyle("ok", reward_runtime=RewardRuntimeConfig(timeout_s=5.0))


def test_bad_eval_size_names_the_key():
    with pytest.raises(ValueError, match="env.args.eval_size"):
        Scored("ok", eval_size=0)


def test_a_process_isolated_call_dies_with_the_process_that_made_it(tmp_path):
    """A rollout actor that is killed runs no deadline: the call it forked must not outlive it."""
    import subprocess
    import textwrap

    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import os, threading, time
        from rlcore.isolation.safety import call_many

        def reward():
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(120)

        threading.Thread(target=call_many, args=([(reward, ())], 120.0, "process"), daemon=True).start()
        while not os.path.exists({str(pid_file)!r}) or not open({str(pid_file)!r}).read():
            time.sleep(0.05)
        os._exit(0)  # the actor dies without reaching the call's deadline
    """)
    subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60, check=True)
    child = int(pid_file.read_text())

    def alive() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        os.kill(child, 9)
        raise AssertionError(f"the reward call (pid {child}) outlived the process that made it")
