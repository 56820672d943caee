"""A reward cannot signal the rollout actor (issue 41): every way of naming it (its pid found by
the reward, its parent's parent, its process group, a pidfd, every process the uid may signal,
the reward's own process group) leaves the scoring process alive, round after round, and costs
at most the attacking call's sample, failed with the reward's own error. Run by root and by an
ordinary uid (65534 through `setpriv`), the scoring process a stand-in for the rollout actor in a
session of its own."""

import json
import os
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.config.reward import RewardRuntimeConfig
from rlcore.isolation import reward_worker_ns
from tests.test_env_safety import Scored
from tests.test_reward_workers import scored, started_by

ROOT = Path(__file__).resolve().parents[1]
USER = 65534
USER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


class Attacker(Scored):
    """Task 0's reward attacks the process that scores; the others score 1.0."""

    def __init__(self, behaviour, **kw):
        super().__init__(behaviour, **kw)
        self.actor, self.actor_group = os.getpid(), os.getpgrp()

    def reward(self, task, completion):
        if task.id != "t/0":
            return 1.0
        b = self.behaviour
        if b in ("kill_all", "killpg_own", "kill_parent") and os.getppid() != 1:
            # these reach far beyond the actor outside a PID namespace: never tried there
            raise RuntimeError("not isolated: the reward worker shares the actor's PID namespace")
        if b == "kill_actor":  # its pid, as a reward finds it in /proc
            os.kill(self.actor, signal.SIGKILL)
        elif b == "kill_grandparent":
            with open(f"/proc/{os.readlink('/proc/self')}/stat") as f:
                keeper = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{keeper}/stat") as f:
                os.kill(int(f.read().rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
        elif b == "killpg_actor":
            os.killpg(self.actor_group, signal.SIGKILL)
        elif b == "pidfd":  # a /proc directory is a pidfd to pidfd_send_signal
            signal.pidfd_send_signal(os.open(f"/proc/{self.actor}", os.O_RDONLY), signal.SIGKILL)
        elif b == "kill_all":
            os.kill(-1, signal.SIGKILL)
        elif b == "killpg_own":
            os.killpg(0, signal.SIGKILL)
        elif b == "kill_parent":
            os.kill(os.getppid(), signal.SIGKILL)
        elif b == "kill_keeper":  # where the worker shares the actor's namespace: its parent, the worker
            if os.getppid() == 1:
                raise RuntimeError("isolated: this attack is for a worker without a namespace")
            os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(0.5)  # a signal that hit the actor has landed by now
        return 1.0


ACTOR = """
import json, sys
from rlcore.config.reward import RewardRuntimeConfig
from tests.test_reward_worker_signals import Attacker
from tests.test_reward_workers import scored, started_by
env = started_by(Attacker(sys.argv[1], reward_runtime=RewardRuntimeConfig(timeout_s=10)), sys.argv[2])
print(json.dumps([[(s.reward, s.error, s.failed) for s in scored(env, tasks=2, n=1)] for _ in range(2)]))
"""

ATTACKS = {
    # the pid it names is not in the worker's PID namespace
    "kill_actor": "reward: ProcessLookupError",
    "kill_grandparent": "reward: ProcessLookupError",
    "killpg_actor": "reward: ProcessLookupError",
    "pidfd": "reward: OSError: [Errno 22]",  # a process outside the caller's namespace
    "kill_all": "reward: ProcessLookupError",  # the worker's namespace holds no one else to signal
    # the call's own process group: the call alone (its own process, forked from the worker)
    "killpg_own": "reward: the reward's process was killed by signal 9",
    # its parent is the worker, its namespace's init, which ignores it: the call is scored
    "kill_parent": None,
}
"""What each attack's sample says: the start of its error, None if it is scored."""


def score_as(who: str, attack: str, starter: str) -> list:
    """Two rounds of scoring two tasks by a stand-in actor run as `who`, its workers started by
    `starter` (`tests.test_reward_workers.started_by`); its output."""
    if who == "user" and os.geteuid() != 0:
        pytest.skip("changing to another uid needs root")
    cmd = [sys.executable, "-c", ACTOR, attack, starter]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if who == "user":  # root's interpreter is not readable by 65534: the system's, same minor version
        cmd = [
            "setpriv",
            f"--reuid={USER}",
            f"--regid={USER}",
            "--clear-groups",
            USER_PYTHON,
            "-c",
            ACTOR,
            attack,
            starter,
        ]
        env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "PYTHONPATH": f"{ROOT}:{site.getsitepackages()[0]}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, start_new_session=True)
    assert proc.returncode == 0, f"the scoring process ended with {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("starter", ["zygote", "fork"])
@pytest.mark.parametrize("who", ["root", "user"])
@pytest.mark.parametrize("attack", ATTACKS)
def test_a_reward_cannot_signal_the_rollout_actor(who, attack, starter):
    if who == "user" and sys.version_info[:2] != tuple(
        int(x)
        for x in subprocess.check_output(
            [USER_PYTHON, "-c", "import sys; print(*sys.version_info[:2])"], text=True
        ).split()
    ):
        pytest.skip("the system's Python is another minor version than the venv's")
    for (reward, error, failed), other in score_as(who, attack, starter):
        assert other == [1.0, None, False]
        if ATTACKS[attack] is None:
            assert (reward, error, failed) == (1.0, None, False), error
        else:
            assert failed and error.startswith(ATTACKS[attack]), error


def test_without_a_namespace_a_warning_says_so_and_a_reward_that_kills_its_parent_is_named(monkeypatch, caplog):
    """Where `unshare` is refused (here: made to be) the workers share the actor's namespace: the
    run says so once, and a reward that kills its parent kills its worker, not the scoring
    process; the sample names it."""
    monkeypatch.setattr(reward_worker_ns, "enter", lambda *a: reward_worker_ns.NONE)
    env = started_by(
        Attacker("kill_keeper", reward_runtime=RewardRuntimeConfig(timeout_s=10)), "fork"
    )  # the patch holds in forks only
    try:
        with caplog.at_level("WARNING", logger="rlcore"):
            rounds = [scored(env, tasks=2, n=1) for _ in range(2)]
    finally:
        env.reward_pool().close()
    for attacked, other in rounds:
        assert attacked.failed and "reward worker killed by signal 9 during this call" in attacked.error
        assert (other.reward, other.failed) == (1.0, False)
    assert sum("could not get a PID namespace" in r.getMessage() for r in caplog.records) == 1
