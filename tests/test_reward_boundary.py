"""Reward workers as a boundary (issue 54): what a reward does reaches neither the rollout actor
(its reply is data, parsed without pickle; signals go through pidfds; deadlines are the actor's),
nor another call's outcome (each call runs in a process of its own, forked from its worker, which
holds no descriptor to the actor; replies are bound to their batch), nor memory past its bound, nor the cluster. Task 0's reward attacks; every other
sample's honest score (0.0) must stay, round after round, for both starters."""

import ctypes
import json
import os
import pickle
import site
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from rlcore.config.reward import RewardRuntimeConfig
from tests.test_env_safety import Scored
from tests.test_reward_workers import scored, started_by

MARK = "/tmp/rlcore-boundary-mark"
PATCHED = {"on": False}
"""A module global a reward patches (read by every call)."""
SHARED = [0.0]
"""A module global a reward mutates in place (its identity unchanged)."""
BASE = float("0")
"""A float object of its own, which a reward overwrites through ctypes."""


class Pwn:
    def __reduce__(self):
        return (os.system, (f"touch {MARK}",))


def _pipes() -> list[int]:
    """The worker's sockets (its pipe to the actor among them)."""
    out = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                out.append(fd)
        except OSError:
            pass
    return out


def _write_all(data: bytes) -> None:
    for fd in _pipes():
        try:
            os.write(fd, data)
        except OSError:
            pass


def _frame(body: bytes) -> bytes:
    return struct.pack("!i", len(body)) + body


class Attacker(Scored):
    bonus = 0.0
    """A class attribute a reward patches."""

    def __init__(self, behaviour, arg="", **kw):
        super().__init__(behaviour, **kw)
        self.arg = arg

    def reward(self, task, completion):
        if task.id != "t/0":  # honest: reads a file (needs a descriptor) and scores 0.0
            os.close(os.open("/dev/null", os.O_RDONLY))
            return BASE + SHARED[0] + type(self).bonus + (1.0 if PATCHED["on"] else 0.0)
        b = self.behaviour
        if b == "reduce":
            return Pwn()
        if b == "forge_later":  # replies for the calls to come, now and from a thread that outlives the call
            from rlcore.isolation import reward_worker_loop as loop
            from rlcore.isolation.safety import Outcome

            def forge():
                # the reply format before issue 54 (a pickle), then this one's for the batches to come
                _write_all(_frame(pickle.dumps(([Outcome(value=1.0)] * 8, False, 0, True))))
                try:
                    from rlcore.isolation.reward_reply import encode_reply
                except ImportError:
                    return
                for bid in range(loop._batch["id"] + 1, loop._batch["id"] + 4):
                    _write_all(_frame(encode_reply(bid, [Outcome(value=1.0)] * 8, 0, True, False)))

            forge()
            threading.Thread(target=lambda: (time.sleep(0.3), forge()), daemon=True).start()
            return 0.0
        if b == "forge_batch":  # this batch's next outcomes, on the pipe, ahead of the worker's own reply
            from rlcore.isolation import reward_worker_loop as loop
            from rlcore.isolation.reward_reply import encode_reply
            from rlcore.isolation.safety import Outcome

            sent = loop._batch["sent"]
            _write_all(_frame(encode_reply(loop._batch["id"], [Outcome(value=1.0)] * (8 - sent), sent, False, False)))
            time.sleep(0.5)  # the actor reads it alone
            return 0.0
        if b == "patch_loop":  # the worker's own loop, past the attribute journal: later calls score 1.0
            from rlcore.isolation import reward_worker_loop as loop
            from rlcore.isolation.safety import Outcome

            vars(loop)["run_one"] = lambda owner, blob: Outcome(value=1.0)
            return 0.0
        if b == "mutate_shared":  # in place: the list is the same object
            SHARED[0] = 1.0
            return 0.0
        if b == "ctypes":  # the float every honest call adds, rewritten in memory
            ctypes.c_double.from_address(id(BASE) + 16).value = 1.0
            return 0.0
        if b == "patch_class":
            type(self).bonus = 1.0
            return 0.0
        if b == "patch_module":
            globals()["PATCHED"] = {"on": True}
            return 0.0
        if b == "progress":  # a victim's pid and a start time in the far future, then overrun
            from rlcore.isolation.reward_worker_loop import STARTED, WORKER_PID
            from rlcore.isolation.reward_worker_progress import Progress

            for fd in map(int, os.listdir("/proc/self/fd")):
                try:
                    link = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("/memfd:rlcore-reward-progress"):
                    p = Progress(fd)
                    p[WORKER_PID], p[STARTED] = float(self.arg), 1e12
            time.sleep(60)
        if b == "half_frame":
            _write_all(struct.pack("!i", 100) + b'{"batch"')
            time.sleep(60)
        if b == "garbage_frame":
            _write_all(_frame(b"\x80\x04not json at all"))
            return 0.0
        if b == "memory":
            escaped = []
            try:
                os.memfd_create("x")
                escaped.append("memfd")
            except OSError:
                pass
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.shmget(0, 1 << 20, 0o1000 | 0o600) >= 0:  # IPC_PRIVATE, IPC_CREAT
                escaped.append("sysv")
            import mmap

            try:
                mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
                escaped.append("shared anonymous mmap")
            except OSError:
                pass
            try:
                with open(f"/dev/shm/rlcore-boundary-{os.getpid()}", "wb") as f:
                    for _ in range(200):
                        f.write(b"\0" * (1 << 20))
                escaped.append("/dev/shm 200 MiB")
            except OSError:
                pass
            if escaped:
                raise RuntimeError(f"escaped: {escaped}")
            return 0.0
        if b == "leak_fds":
            try:
                for _ in range(4000):
                    os.open("/dev/null", os.O_RDONLY)
            except OSError:
                pass
            return 0.0
        if b == "cluster":
            seen = [k for k in os.environ if k.startswith("RAY_") or "TOKEN" in k]
            token = ""
            if self.arg and os.path.exists(self.arg):
                token = open(self.arg).read()
            try:
                socket.create_connection(("127.0.0.1", int(os.environ.get("GCS_PORT", "0")) or 1), timeout=1).close()
                connected = True
            except OSError:
                connected = False
            if seen or token or connected:
                raise RuntimeError(f"reached the cluster: env {seen}, token {token!r}, connected {connected}")
            return 0.0
        return 0.0


@pytest.fixture(params=["zygote", "fork"])
def attack(request):
    made = []

    def make(behaviour, arg="", tasks=4, n=2, rounds=2, **kw):
        env = started_by(Attacker(behaviour, arg, **kw), request.param)
        made.append(env)
        out = []
        for _ in range(rounds):
            samples = scored(env, tasks=tasks, n=n)
            attacked, others = samples[:n], samples[n:]
            assert [(s.reward, s.failed, s.error) for s in others] == [(0.0, False, None)] * len(others)
            out.append(attacked)
        return out

    yield make
    for env in made:
        env.reward_pool().close()


def test_a_reply_whose_unpickling_runs_code_runs_nothing_in_the_actor(attack):
    if os.path.exists(MARK):
        os.unlink(MARK)
    for attacked in attack("reduce"):
        assert all(s.failed and "not plain data" in s.error for s in attacked), attacked
    assert not os.path.exists(MARK)


def test_replies_written_for_later_batches_reach_no_other_sample(attack):
    attack("forge_later", rounds=3)


@pytest.mark.parametrize("how", ["patch_class", "patch_module"])
def test_state_a_reward_leaves_in_its_class_or_module_reaches_no_other_task(attack, how):
    attack(how, rounds=3)


@pytest.mark.parametrize("how", ["forge_batch", "patch_loop", "mutate_shared", "ctypes"])
def test_a_reward_cannot_forge_another_call_of_its_batch(attack, how):
    """Each call runs in a process of its own, forked from its worker: frames written on a pipe it
    does not hold, a patched worker loop, an object mutated in place or memory written through
    ctypes reach no other call (the batch's calls after it, or a later batch's)."""
    for attacked in attack(how, rounds=2):
        assert all(s.reward == 0.0 and not s.failed for s in attacked), [(s.reward, s.error) for s in attacked]


def test_progress_memory_names_no_process_and_moves_no_deadline(attack):
    victim = subprocess.Popen(["sleep", "120"])
    try:
        start = time.monotonic()
        for attacked in attack("progress", str(victim.pid), reward_runtime=RewardRuntimeConfig(timeout_s=1)):
            assert all(s.failed and "timeout" in s.error for s in attacked), [(s.reward, s.error) for s in attacked]
        assert time.monotonic() - start < 30
        assert victim.poll() is None, "the actor signalled the pid a reward wrote"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("how,says", [("half_frame", "timeout"), ("garbage_frame", None)])
def test_a_broken_frame_fails_its_call_alone(attack, how, says):
    """A call's process holds no pipe to the actor: what it writes there goes nowhere (on the code
    before, half a frame blocked the request, a garbage frame failed the pool)."""
    for attacked in attack(how, reward_runtime=RewardRuntimeConfig(timeout_s=1)):
        if says is None:
            assert all(s.reward == 0.0 and not s.failed for s in attacked), attacked
        else:
            assert all(s.failed and says in s.error for s in attacked), attacked


def test_memory_outside_the_heap_is_refused(attack):
    for attacked in attack("memory", reward_runtime=RewardRuntimeConfig(memory_mb=150)):
        assert all(s.error is None for s in attacked), attacked[0].error


def test_a_reward_leaking_descriptors_costs_no_later_call(attack):
    attack("leak_fds", rounds=3)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A stand-in for the run's cluster: Ray's variables, its token file, a listening "GCS"."""
    token = tmp_path / "auth_token"
    token.write_text("secret-token")
    gcs = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{gcs.getsockname()[1]}")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret-token")
    monkeypatch.setenv("GCS_PORT", str(gcs.getsockname()[1]))
    yield str(token)
    gcs.close()


def test_the_cluster_is_out_of_a_rewards_reach(attack, cluster):
    if os.geteuid() != 0:
        pytest.skip("the token file is hidden in a mount namespace (root here; user namespaces elsewhere)")
    for attacked in attack("cluster", cluster):
        assert all(s.error is None for s in attacked), attacked[0].error


def test_reward_runtime_network_opens_the_network(cluster):
    env = started_by(Attacker("cluster", cluster, reward_runtime=RewardRuntimeConfig(network=True)), "fork")
    try:
        attacked = scored(env, tasks=1, n=1)[0]
    finally:
        env.reward_pool().close()
    assert attacked.failed and "connected True" in attacked.error, attacked.error


def test_reward_runtime_network_must_be_a_boolean():
    with pytest.raises(ValueError, match="env.reward.network"):
        Attacker("ok", reward_runtime=RewardRuntimeConfig(network="yes"))


ACTOR = """
import json, subprocess, sys
from rlcore.config.reward import RewardRuntimeConfig
from tests.test_reward_boundary import Attacker
from tests.test_reward_workers import scored, started_by
attack, starter = sys.argv[1:3]
# the victim must not hold this process's stdout: the test reads it to its end (60 s later)
victim = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if attack == "progress" else None
timeout = 1 if attack == "progress" else 10
env = started_by(Attacker(attack, str(victim.pid) if victim else "", reward_runtime=RewardRuntimeConfig(timeout_s=timeout, memory_mb=150)), starter)
rounds = [[(s.reward, s.error, s.failed) for s in scored(env, tasks=4, n=2)] for _ in range(2)]
print(json.dumps({"rounds": rounds, "victim_alive": victim is None or victim.poll() is None}))
if victim is not None:
    victim.kill()
"""


@pytest.mark.parametrize("starter", ["zygote", "fork"])
@pytest.mark.parametrize("attack", ["forge_later", "ctypes", "progress", "memory"])
def test_as_an_ordinary_uid(attack, starter):
    """Attacks by a stand-in actor run as uid 65534 (`setpriv`, as tests/test_reward_worker_signals.py
    does): forged replies, memory written through ctypes, a pid and start time in progress memory,
    memory outside the heap (the
    others do not depend on the uid: run as root above, kept out here for the suite's time)."""
    from tests.test_reward_worker_signals import ROOT, USER, USER_PYTHON

    if os.geteuid() != 0:
        pytest.skip("changing to another uid needs root")
    if subprocess.check_output(
        [USER_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], text=True
    ).strip() != str(sys.version_info[:2]):
        pytest.skip("the system's Python is another minor version than the venv's")
    if os.path.exists(MARK):
        os.unlink(MARK)
    cmd = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", USER_PYTHON, "-c", ACTOR, attack, starter]
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "PYTHONPATH": f"{ROOT}:{site.getsitepackages()[0]}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT, env=env, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for samples in got["rounds"]:
        assert [tuple(s) for s in samples[2:]] == [(0.0, None, False)] * 6, samples
        if attack == "memory":
            assert all(s[1] is None for s in samples[:2]), samples[0][1]
    assert got["victim_alive"] and not os.path.exists(MARK)
