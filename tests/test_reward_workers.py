"""Reward workers (issue 41): what a reward does to its process stays with its call. Leaks hit a
named memory bound, whatever a call starts dies with it (children, double-forked daemons, also
at a deadline), each call starts from the same directory and environment, overrunning calls
overlap instead of queueing, and the other faults of user code (exits, huge values, closed pipes) cost one
sample each. All through `Environment.run_groups` with the default `worker` isolation."""

import itertools
import os
import subprocess
import sys
import time

import pytest

from rlcore.config.reward import RewardRuntimeConfig
from rlcore.engine.base import SamplingParams
from rlcore.models.tokenizer import char_tokenizer
from rlcore.types import Task
from tests.test_env_safety import EchoEngine, Scored

LEAK: list = []


class Misbehaving(Scored):
    """Tasks whose index is below `bad` misbehave as `behaviour`; the others score 1.0. Pids of
    what the calls start are written under `where`."""

    def __init__(self, behaviour, bad=1, where="", **kw):
        super().__init__(behaviour, **kw)
        self.bad, self.where, self.home = bad, where, os.getcwd()

    def make_task(self, index, split):
        return Task(id=f"t/{index}", messages=[{"role": "user", "content": "hi"}], answer=str(index))

    def note(self, name, pid=None):
        """Note `pid` (default: this process) as the test sees it (the worker has a PID namespace
        of its own; /proc is the host's)."""
        pid = int(os.readlink("/proc/self")) if pid is None else pid
        with open(os.path.join(self.where, f"{name}.{pid}"), "w") as f:
            f.write(f"{time.monotonic()}")

    def daemon(self):
        """Double-fork a process in a session of its own that sleeps; returns once it noted itself."""
        first = os.fork()
        if first == 0:
            os.setsid()
            if os.fork() == 0:
                self.note("daemon")
                time.sleep(300)
            os._exit(0)
        os.waitpid(first, 0)
        while not any(n.startswith("daemon.") for n in os.listdir(self.where)):
            time.sleep(0.01)

    def reward(self, task, completion):
        if int(task.id.split("/")[1]) >= self.bad:
            return 1.0
        b = self.behaviour
        if b == "leak":
            for _ in range(8):
                LEAK.append(bytearray(64 << 20))
        elif b == "child":
            subprocess.Popen(["sleep", "300"])
            me = os.readlink("/proc/self")
            (child,) = [
                int(p)
                for t in os.listdir(f"/proc/{me}/task")
                for p in open(f"/proc/{me}/task/{t}/children").read().split()
            ]
            self.note("child", child)
        elif b == "daemon":
            self.daemon()
        elif b == "daemon_then_hang":  # in Python: asked to stop at the deadline, the worker is reused
            self.daemon()
            time.sleep(300)
        elif b == "daemon_then_spin":  # inside one C call: its worker is killed after the grace
            self.daemon()
            sum(itertools.repeat(1, 10**13))
        elif b == "state":  # 1.0 only if it finds the worker as it started
            clean = os.getcwd() == self.home and "RLCORE_LEAKED" not in os.environ and "/nowhere" not in sys.path
            os.chdir("/")
            os.environ["RLCORE_LEAKED"] = "1"
            sys.path.insert(0, "/nowhere")
            return 1.0 if clean else 0.0
        elif b == "hang":
            self.note("hang")
            time.sleep(300)
        elif b == "gate":  # hangs until the test opens the gate (a hang whose end the test decides)
            self.note("gated")
            while not os.path.exists(os.path.join(self.where, "open")):
                time.sleep(0.01)
        elif b == "has_colorsys":  # 1.0 only if the module was there before the call
            return 1.0 if "colorsys" in sys.modules else 0.0
        elif b == "libc_read":  # a blocking read from C, fed 0.5 s later: EINTR would fail it
            import ctypes
            import threading

            r, w = os.pipe()
            threading.Timer(0.5, os.write, (w, b"x")).start()
            got = ctypes.CDLL(None, use_errno=True).read(r, ctypes.create_string_buffer(1), 1)
            return 1.0 if got == 1 else -float(ctypes.get_errno())
        elif b == "exit":
            os._exit(7)
        elif b == "huge":
            return "x" * (4 << 20)
        elif b == "close_fds":
            os.closerange(3, 4096)
        return 1.0


def scored(env, tasks=1, n=4):
    tok = char_tokenizer()
    groups = env.run_groups(
        [env.make_task(i, "train") for i in range(tasks)], n, EchoEngine(tok), tok, SamplingParams(max_new_tokens=4)
    )
    return [s for g in groups for s in g.samples]


def gone(pid, wait_s=2.0):
    """`pid` is not a live process (gone or a zombie) within `wait_s`."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def pids(where, name):
    return [int(n.split(".")[1]) for n in os.listdir(where) if n.startswith(f"{name}.")]


def started_by(env, starter: str, size: int | None = None):
    """Give `env` a reward pool (of `size`, default: the environment's) whose workers start as
    `starter` says: `zygote` (from the pool's lean process, the default once it is ready: waited
    for here) or `fork` (forks of this process, what a pool does meanwhile and where the
    environment does not pickle)."""
    from rlcore.isolation.reward_workers import WorkerPool

    pool = env._reward_pool = WorkerPool(
        env,
        size or env.reward_pool().size,
        env.reward_runtime.memory_mb,
        zygote=starter == "zygote",
        network=env.reward_runtime.network,
    )
    if starter == "zygote":
        until = time.monotonic() + 60
        while pool.zygote() is None:
            assert time.monotonic() < until, "the reward worker zygote did not start"
            time.sleep(0.01)
    return env


@pytest.fixture(params=["zygote", "fork"])
def env_of(tmp_path, request):
    made = []

    def make(behaviour, size=None, **kw):
        env = started_by(Misbehaving(behaviour, where=str(tmp_path), **kw), request.param, size)
        made.append(env)
        return env

    yield make
    for env in made:
        env.reward_pool().close()


def test_a_leaking_reward_fails_its_sample_at_the_memory_bound_with_a_named_reason(env_of):
    env = env_of("leak", reward_runtime=RewardRuntimeConfig(memory_mb=150), bad=1)
    # task 0: 64 MiB at a time, kept, until one call crosses 150 MiB; each call's memory dies with
    # its process (issue 54), so task 1's calls in the same workers are scored
    samples = scored(env, tasks=2, n=4)
    errors = [s.error for s in samples[:4]]
    assert all(e and "memory bound (env.reward.memory_mb=150)" in e and "MemoryError" in e for e in errors), errors
    assert all(s.reward == 1.0 and not s.failed for s in samples[4:])  # the calls within the bound are scored
    with pytest.raises(ValueError, match="env.reward.memory_mb"):
        Misbehaving("ok", reward_runtime=RewardRuntimeConfig(memory_mb=-1))


def test_a_reward_cannot_fill_the_free_heap_its_worker_inherited_past_the_memory_bound(tmp_path):
    """A worker forked from a process whose heap has ~600 MiB free but mapped (as the actor's
    after a model load): RLIMIT_DATA counts mappings, so on the code before the leaking call
    filled that space with 512 MiB and no MemoryError (errors all None; seen in a two-process
    suite run, where this process's heap had such a hole)."""
    import ctypes

    holes = [bytearray(100 << 10) for _ in range(6000)]  # below glibc's mmap threshold: the heap
    top = bytearray(100 << 10)  # in use above them: the freed space stays mapped
    del holes
    try:
        env = started_by(
            Misbehaving("leak", where=str(tmp_path), reward_runtime=RewardRuntimeConfig(memory_mb=150)), "fork"
        )
        try:
            errors = [s.error for s in scored(env, tasks=1, n=2)]
        finally:
            env.reward_pool().close()
    finally:
        del top
        ctypes.CDLL(None).malloc_trim(0)
    assert all(e and "memory bound (env.reward.memory_mb=150)" in e for e in errors), errors


@pytest.mark.parametrize("behaviour", ["child", "daemon"])
def test_what_a_reward_starts_dies_with_its_call(env_of, tmp_path, behaviour):
    env = env_of(behaviour)
    samples = scored(env, tasks=2, n=2)
    assert [s.reward for s in samples] == [1.0] * 4
    started = pids(tmp_path, behaviour)
    assert len(started) == 2
    for pid in started:
        assert gone(pid), f"{behaviour} {pid} outlived its reward call"


@pytest.mark.parametrize("behaviour", ["daemon_then_hang", "daemon_then_spin"])
def test_a_daemon_started_by_a_call_that_overruns_dies_at_the_deadline(env_of, tmp_path, behaviour):
    env = env_of(behaviour, reward_runtime=RewardRuntimeConfig(timeout_s=1.0))
    samples = scored(env, tasks=2, n=1)
    assert samples[0].failed and "timeout after 1s" in samples[0].error
    assert samples[1].reward == 1.0
    (pid,) = pids(tmp_path, "daemon")
    assert gone(pid), "a double-forked daemon outlived its timed-out call"


def test_each_call_starts_from_the_same_directory_environment_and_sys_path(env_of):
    env = env_of("state", bad=100)
    assert [s.reward for s in scored(env, tasks=2, n=8)] == [1.0] * 16  # 16 calls, 2 workers, reused
    assert "RLCORE_LEAKED" not in os.environ and os.getcwd() == env.home


def test_overrunning_calls_overlap_instead_of_queueing(env_of, tmp_path):
    """12 of 32 calls hang; the pool has 2 warm workers. Every hung call starts before the first
    one reaches its deadline: they run side by side (each in its own worker), not one after
    another, and the others are scored."""
    env = env_of("hang", bad=3, reward_runtime=RewardRuntimeConfig(timeout_s=3.0))
    assert env.reward_pool().size == 2 or os.cpu_count() > 2
    samples = scored(env, tasks=8, n=4)
    hung = [s for s in samples[:12]]
    assert all(s.failed and "timeout after 3s" in s.error for s in hung)
    assert [s.reward for s in samples[12:]] == [1.0] * 20
    starts = sorted(float(open(tmp_path / n).read()) for n in os.listdir(tmp_path) if n.startswith("hang."))
    assert len(starts) == 12 and len(set(pids(tmp_path, "hang"))) == 12
    assert starts[-1] - starts[0] < 3.0, "a hung call waited for another one's deadline"


@pytest.mark.parametrize(
    "behaviour,expect",
    [
        ("exit", "the reward's process exited with code 7 before it sent an outcome"),
        ("huge", "bytes as JSON (limit 1048576)"),
        ("close_fds", "the reward's process exited with code 0 before it sent an outcome"),  # its own pipe
    ],
)
def test_each_fault_of_user_code_costs_its_own_sample(env_of, behaviour, expect):
    env = env_of(behaviour)
    samples = scored(env, tasks=3, n=2)
    assert all(s.failed and expect in s.error for s in samples[:2]), [s.error for s in samples[:2]]
    assert [s.reward for s in samples[2:]] == [1.0] * 4
    assert [s.reward for s in scored(env_of("ok"), tasks=1, n=2)] == [1.0, 1.0]


def test_a_request_streams_each_group_once_scored_so_a_hung_reward_delays_its_own_group_only(env_of, tmp_path):
    """Task 0's reward hangs until the test opens its gate (no clock decides): the three other
    groups of the request come out of `stream_groups` while it hangs, each whole and scored;
    the hung group comes once its reward returns. On the code before, the request's groups came
    only once every reward had returned."""
    env = env_of("gate", reward_runtime=RewardRuntimeConfig(timeout_s=120))
    tok = char_tokenizer()
    tasks = [env.make_task(i, "train") for i in range(4)]
    stream = env.stream_groups(tasks, 4, EchoEngine(tok), tok, SamplingParams(max_new_tokens=4))
    first = [next(stream) for _ in range(3)]
    assert pids(tmp_path, "gated") and not os.path.exists(tmp_path / "open")  # task 0 still hangs
    assert sorted(i for i, _ in first) == [1, 2, 3]
    for i, group in first:
        assert group.task is tasks[i] and [s.reward for s in group.samples] == [1.0] * 4
        assert not any(s.failed for s in group.samples)
    (tmp_path / "open").touch()
    ((i, group),) = list(stream)
    assert i == 0 and [s.reward for s in group.samples] == [1.0] * 4 and not any(s.failed for s in group.samples)


def test_a_storms_extra_idle_workers_do_not_outlive_it(monkeypatch):
    """Idle workers beyond `KEEP_IDLE` that idled past `IDLE_TTL_S` are killed when the pool is
    next used: a hang storm needs many workers at once, not for the rest of the run."""
    import rlcore.isolation.reward_workers as mod

    monkeypatch.setattr(mod, "KEEP_IDLE", 2)
    monkeypatch.setattr(mod, "IDLE_TTL_S", 0.0)
    env = Misbehaving("fine")
    pool = mod.WorkerPool(env, size=1)
    workers = [pool.take() for _ in range(5)]
    try:
        for w in workers:
            pool.give(w)
        assert pool.idle == workers[2:] and pool.live == 3  # the two that idled longest went
        for w in workers[:2]:
            assert not w.proc.is_alive()
        assert all(w.proc.is_alive() for w in workers[2:])
    finally:
        pool.close()


@pytest.mark.parametrize("behind", [0, 2], ids=["hung_call_last", "calls_behind_it"])
def test_outcomes_finished_before_an_overrunning_call_of_their_batch_do_not_wait_for_it(env_of, tmp_path, behind):
    """One worker runs one batch: three cheap calls, then a call that hangs until the test opens
    its gate, then `behind` more. The three outcomes come while the gate is still shut (the
    worker sends them on when the call overruns), and so do those moved to another worker; the
    gated call's comes when it returns. On the code before, every outcome of the batch came with
    the hung call's, at its deadline."""
    env = env_of("gate", size=1, reward_runtime=RewardRuntimeConfig(timeout_s=30))
    pool = env.reward_pool()
    order = [5, 6, 7, 0] + [8 + j for j in range(behind)]  # task 0 is the gated one
    calls = [(env.reward, (env.make_task(i, "train"), "x")) for i in order]
    stream = pool.stream_many(calls, env.reward_runtime.timeout_s)
    early = [next(stream) for _ in range(3 + behind)]
    # the call overruns from when its worker marked it started, before its process ran a line:
    # under load the early outcomes can come before it noted its pid (the gate keeps it running)
    until = time.monotonic() + 10
    while not pids(tmp_path, "gated") and time.monotonic() < until:
        time.sleep(0.01)
    assert pids(tmp_path, "gated") and not os.path.exists(tmp_path / "open")
    assert sorted(i for i, _ in early) == [j for j in range(len(order)) if j != 3]
    assert all(out.error is None and out.value == 1.0 for _, out in early), early
    (tmp_path / "open").touch()
    ((i, out),) = list(stream)
    assert i == 3 and out.error is None and out.value == 1.0


def test_workers_start_from_the_zygote_and_fork_where_the_environment_does_not_pickle():
    """Once the pool's zygote is ready, a worker's keeper is its child (the actor forks nothing);
    an environment that does not pickle (a class made inside a function) gets no zygote, and
    its workers are forks of this process that score the same."""
    from rlcore.isolation.reward_workers import WorkerPool

    def parent_of(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    env = started_by(Misbehaving("ok"), "zygote")
    try:
        assert [s.reward for s in scored(env, tasks=2, n=4)] == [1.0] * 8
        pool = env.reward_pool()
        assert pool.idle and {parent_of(w.pid) for w in pool.idle} == {pool.zygote().pid}
    finally:
        env.reward_pool().close()

    class Local(Misbehaving):
        pass

    local = Local("ok")
    pool = local._reward_pool = WorkerPool(local, 2)
    try:
        assert pool.zygote() is None
        assert [s.reward for s in scored(local, tasks=2, n=4)] == [1.0] * 8
        assert pool.idle and {parent_of(w.pid) for w in pool.idle} == {os.getpid()}
    finally:
        pool.close()

    chosen = ForkedOnPurpose("ok")  # pickles, and still forked: the class says so
    try:
        assert chosen.reward_pool().zygote() is None
        assert [s.reward for s in scored(chosen, tasks=1, n=2)] == [1.0] * 2
        assert {parent_of(w.pid) for w in chosen.reward_pool().idle} == {os.getpid()}
    finally:
        chosen.reward_pool().close()


class ForkedOnPurpose(Misbehaving):
    """An environment whose reward reads state the actor sets at run time (module globals)."""

    reward_zygote = False


class ImportsColorsys(Misbehaving):
    reward_imports = ("colorsys",)


def test_a_zygote_started_worker_has_the_modules_the_environment_names_before_its_first_call():
    """The zygote is a fresh interpreter: what this process imported does not matter, what the
    environment's module imports and what `reward_imports` names does (the second half shows
    that colorsys is not among the former)."""
    env = started_by(ImportsColorsys("has_colorsys", bad=100), "zygote")
    try:
        assert [s.reward for s in scored(env, tasks=2, n=2)] == [1.0] * 4
    finally:
        env.reward_pool().close()
    plain = started_by(Misbehaving("has_colorsys", bad=100), "zygote")  # names none: the zygote has none
    try:
        assert [s.reward for s in scored(plain, tasks=1, n=2)] == [0.0] * 2
    finally:
        plain.reward_pool().close()


@pytest.mark.parametrize("starter", ["zygote", "fork"])
def test_a_hung_call_its_worker_and_the_zygote_die_with_the_actor(tmp_path, starter):
    """A rollout actor that dies (os._exit: no deadline, no cleanup) takes its reward workers
    with it, a call that hangs in one included, and the pool's zygote."""
    script = f"""
import os, sys, threading, time
sys.path.insert(0, {os.getcwd()!r})
from rlcore.config.reward import RewardRuntimeConfig
from tests.test_reward_workers import Misbehaving, scored, started_by
env = started_by(Misbehaving("hang", where={str(tmp_path)!r}, reward_runtime=RewardRuntimeConfig(timeout_s=120)), {starter!r})
zygote = env.reward_pool().zygote()
open({str(tmp_path / "zygote")!r}, "w").write(str(zygote.pid if zygote else 0))
threading.Thread(target=scored, args=(env, 1, 1), daemon=True).start()
while not any(n.startswith("hang.") for n in os.listdir({str(tmp_path)!r})):
    time.sleep(0.02)
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", script], timeout=120, check=True)
    (hung,) = pids(tmp_path, "hang")
    zygote = int((tmp_path / "zygote").read_text())
    assert (zygote != 0) == (starter == "zygote")
    assert gone(hung, 10), "a hung reward call outlived its actor"
    assert zygote == 0 or gone(zygote, 10), "the zygote outlived its actor"


def test_an_environment_the_zygote_cannot_load_is_scored_by_forked_workers(caplog):
    """The environment pickles here but its module does not import in a fresh interpreter (this
    process made it importable by name only): the zygote says why, no other is started, and the
    workers are forks that score it."""
    import types

    from rlcore.isolation.reward_workers import WorkerPool

    module = types.ModuleType("rlcore_only_here")
    sys.modules["rlcore_only_here"] = module
    try:
        cls = type("OnlyHere", (Misbehaving,), {"__module__": "rlcore_only_here"})
        module.OnlyHere = cls
        env = cls("ok")
        pool = env._reward_pool = WorkerPool(env, 2)
        with caplog.at_level("INFO", logger="rlcore"):
            until = time.monotonic() + 60
            while pool.zygotes.starts < 3:
                assert pool.zygote() is None and time.monotonic() < until
                time.sleep(0.01)
            assert [s.reward for s in scored(env, tasks=2, n=2)] == [1.0] * 4
        lines = [r.getMessage() for r in caplog.records if "zygote" in r.getMessage()]
        assert len(lines) == 1 and "could not load the environment" in lines[0] and "ModuleNotFoundError" in lines[0]
        assert "forks of the rollout actor" in lines[0]
        pool.close()
    finally:
        del sys.modules["rlcore_only_here"]


def test_a_zygote_that_dies_is_replaced_and_scoring_goes_on(caplog):
    """The zygote is killed between two requests: its workers die with it, the next request is
    scored all the same (forks while a new zygote starts), one warning says so, and the workers
    after that come from the new zygote."""
    import signal

    env = started_by(Misbehaving("ok"), "zygote")
    pool = env.reward_pool()
    try:
        assert [s.reward for s in scored(env, tasks=2, n=4)] == [1.0] * 8
        first = pool.zygote()
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(10)
        with caplog.at_level("WARNING", logger="rlcore"):
            assert [s.reward for s in scored(env, tasks=2, n=4)] == [1.0] * 8
        assert sum("zygote exited" in r.getMessage() and "new zygote" in r.getMessage() for r in caplog.records) == 1
        until = time.monotonic() + 60
        while (second := pool.zygote()) is None:
            assert time.monotonic() < until
            time.sleep(0.01)
        assert second is not first and second.alive()
    finally:
        pool.close()


def test_a_call_blocked_in_a_c_read_is_not_interrupted_by_the_flush(env_of):
    """Two cheap calls, then one blocked 0.5 s in libc's read (ctypes: no Python retry on EINTR)
    in one worker's batch: the flush asked for at the overrun restarts the read instead of
    failing it (on the code before it returned -EINTR)."""
    env = env_of("libc_read", size=1, reward_runtime=RewardRuntimeConfig(timeout_s=10))
    calls = [(env.reward, (env.make_task(i, "train"), "x")) for i in (5, 6, 0)]  # task 0 reads
    outs = env.reward_pool().call_many(calls, env.reward_runtime.timeout_s)
    assert [o.value for o in outs] == [1.0, 1.0, 1.0], outs


def test_the_zygote_outlives_the_request_thread_that_started_it():
    """A rollout actor's request threads come and go; the zygote dies with the actor's process
    (PR_SET_PDEATHSIG), so it must not be tied to the thread that first needed it."""
    import threading

    from rlcore.isolation.reward_workers import WorkerPool

    env = Misbehaving("ok")
    pool = env._reward_pool = WorkerPool(env, 2)
    try:

        def start_and_wait():  # the thread ends once the zygote is up (it has set its death signal)
            until = time.monotonic() + 60
            while pool.zygote() is None:
                assert time.monotonic() < until, "the zygote did not start"
                time.sleep(0.01)

        starter = threading.Thread(target=start_and_wait)
        starter.start()
        starter.join()
        zygote = pool.zygote()
        time.sleep(0.3)
        assert zygote.alive() and [s.reward for s in scored(env, tasks=2, n=2)] == [1.0] * 4
        assert pool.zygote() is zygote
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_worker_forked_from_an_actor_with_a_sigterm_handler_of_its_own_is_stopped_at_once(tmp_path):
    """The actor forks a worker's keeper and stops it right away (a pool that gives way to its
    zygote), the actor having a SIGTERM handler that does not exit (a run's graceful stop): on the
    code before, a stop that came before the keeper's own handler ran the inherited one, the keeper
    went on, and the actor waited for it with no deadline (`join`'s timeout does not hold once the
    keeper closed its sentinel): a two-process suite run hung 600 s in `pool.give`."""
    import signal

    from rlcore.isolation.reward_worker_process import KEEPER_WAIT_S, Worker

    env = Misbehaving("none", where=str(tmp_path))
    old = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        for _ in range(10):
            worker = Worker(env, env.reward_runtime.memory_mb)
            start = time.monotonic()
            worker.kill()
            took = time.monotonic() - start
            assert worker.proc.exitcode is not None and took < KEEPER_WAIT_S + 2, took
            assert worker.proc.exitcode == 0, worker.proc.exitcode  # its own stop, not the kill at the deadline
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_worker_forked_from_the_actor_gives_way_to_the_zygotes_once_it_is_ready(tmp_path):
    """Workers forked from the actor (while the zygote starts) make every call's process copy the
    actor's page tables: through a rollout actor a cheap reward cost 20 ms a sample in them
    against 3 ms in zygote workers (`benchmarks/reward_overhead.py --part actor`). Once the
    zygote is ready, such a worker is neither kept idle after its batch nor taken again."""
    from rlcore.isolation.reward_worker_process import Worker

    env = started_by(Misbehaving("none", where=str(tmp_path)), "zygote")
    pool = env.reward_pool()
    stale = None
    try:
        forked = Worker(env, env.reward_runtime.memory_mb)  # what the pool forks before its zygote is ready
        assert forked.from_actor
        with pool._lock:
            pool.live += 1
        pool.give(forked)  # after its batch
        assert forked not in pool.idle
        stale = Worker(env, env.reward_runtime.memory_mb)
        with pool._lock:  # one kept idle before the zygote was ready
            pool.live += 1
            pool.idle.append(stale)
        taken = pool.take()
        assert taken is not stale and not taken.from_actor
        pool.give(taken)
        assert taken in pool.idle  # a zygote worker is kept
        assert [s.reward for s in scored(env, tasks=2, n=4)] == [1.0] * 8
    finally:
        if stale is not None:
            stale.kill()
        pool.close()


def test_a_text_environment_imports_no_numpy_into_its_reward_workers():
    """Every call forks a reward worker, and a fork costs what the worker has mapped: numpy
    (images only) took a zygote's resident memory from 17 to 30 MB. rlcore's text environments
    load without it."""
    code = (
        "import sys\n"
        "import rlcore.envs.reverse_text, rlcore.envs.alphabet_sort, rlcore.envs.wordle, rlcore.envs.math_env\n"
        "print(sorted(m for m in ('numpy', 'torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
