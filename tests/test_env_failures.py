"""Bad environment code never stalls the run silently (issue 22): a hung reward costs its own
sample and its timeout, hung threads are counted and bounded, busy loops are killed at the
deadline, every failure has a reason, printed output is kept per sample, not on the console."""

import itertools
import logging
import os
import threading
import time
import uuid
import zlib

import pytest

from rlcore.config.reward import RewardRuntimeConfig
from rlcore.engine.base import SamplingParams
from rlcore.envs.base import EnvironmentStalled
from rlcore.envs.multiturn import MultiTurnEnvironment
from rlcore.isolation.safety import OUTPUT_LIMIT, threads_abandoned
from rlcore.models.tokenizer import char_tokenizer
from rlcore.report.failures import FailureLog, NoProgress
from rlcore.types import Group, Sample, Task
from tests.test_env_safety import EchoEngine, Scored

RELEASE = threading.Event()  # ends the "hung" calls once a test is over (threads are per process)


@pytest.fixture(autouse=True)
def release_hung_threads():
    RELEASE.clear()
    yield
    RELEASE.set()
    deadline = time.monotonic() + 5
    while threads_abandoned() and time.monotonic() < deadline:
        time.sleep(0.05)


def bad(task_id: str, percent: int) -> bool:
    return zlib.crc32(task_id.encode()) % 100 < percent


class Mixed(Scored):
    """Reward that misbehaves (`behaviour`) on `percent`% of tasks, scores 1.0 elsewhere."""

    def __init__(self, behaviour, percent, **kw):
        super().__init__(behaviour, **kw)
        self.percent = percent

    def make_task(self, index, split):
        return Task(id=f"t/{index}", messages=[{"role": "user", "content": "hi"}], answer=str(index))

    def reward(self, task, completion):
        if not bad(task.id, self.percent):
            return 1.0
        if self.behaviour == "sleep_loop":
            while not RELEASE.is_set():
                time.sleep(0.05)
        if self.behaviour == "blocked":  # inside C (a lock): the thread cannot be asked to stop
            RELEASE.wait()
        if self.behaviour == "string":
            return "great"
        if self.behaviour == "print":
            print("x" * (6 << 20))  # 6 MB per call
            return 0.5
        return super().reward(task, completion)


def groups_of(env, first, tasks=4, n=4):
    tok = char_tokenizer()
    return env.run_groups(
        [env.make_task(first + i, "train") for i in range(tasks)],
        n,
        EchoEngine(tok),
        tok,
        SamplingParams(max_new_tokens=4),
    )


def hung_rounds(env, rounds):
    hung = ok = 0
    for r in range(rounds):
        start = time.monotonic()
        groups = groups_of(env, 16 * r)
        # the timeout bounds each sample (a hung reward blocks forever): generous for a loaded machine
        assert time.monotonic() - start < 20.0
        for g in groups:
            for s in g.samples:
                if bad(g.task.id, 30):
                    hung += 1
                    assert s.failed and "timeout after 0.3s" in s.error
                else:
                    ok += 1
                    assert not s.failed and s.reward == 1.0  # the request's other samples are used
    assert hung > 0 and ok > 0


def test_hung_python_rewards_cost_their_sample_and_their_threads_stop():
    before = threads_abandoned()
    env = Mixed("sleep_loop", 30, reward_runtime=RewardRuntimeConfig(timeout_s=0.3))
    hung_rounds(env, 4)
    # asked to stop at the deadline: none left. Threads an earlier test in this process left may
    # end meanwhile (the count falls; a full run under load once saw that), never start
    deadline = time.monotonic() + 5
    while threads_abandoned() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threads_abandoned() <= before


def test_rewards_hung_in_c_leave_a_bounded_number_of_threads(monkeypatch):
    monkeypatch.setattr("rlcore.envs.base.STUCK_AFTER_S", 0.0)  # count them as stuck at once
    bound = threads_abandoned() + 3  # earlier tests in this process may have left some
    env = Mixed(
        "blocked",
        30,
        reward_runtime=RewardRuntimeConfig(timeout_s=0.3, max_abandoned_threads=bound, isolation="thread"),
    )
    hung_rounds(env, 6)
    assert env.reward_runtime.isolation == "process"  # moved once past the bound
    assert threads_abandoned() <= bound + 16  # at most one request's worth over the bound, then none


def test_stateful_calls_fail_in_one_line_past_the_bound(monkeypatch):
    monkeypatch.setattr("rlcore.envs.base.STUCK_AFTER_S", 0.0)

    class Stuck(MultiTurnEnvironment):
        def make_task(self, index, split):
            return Task(id=f"s/{index}", messages=[{"role": "user", "content": "go"}])

        def env_response(self, task, history, state):
            RELEASE.wait(10)  # blocked in C: cannot be asked to stop
            return [], True

        def score(self, task, history, state):
            return 1.0

    env = Stuck(
        max_turns=2, reward_runtime=RewardRuntimeConfig(timeout_s=0.2, max_abandoned_threads=threads_abandoned() + 1)
    )
    groups_of(env, 0, tasks=1, n=4)  # 4 hung env_response threads
    with pytest.raises(EnvironmentStalled, match=r"init_state: \d+ calls missed .*max_abandoned_threads"):
        groups_of(env, 0, tasks=1, n=2)


def _alive(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(pid)
        except OSError:
            pass
    return found


def test_busy_loop_costs_the_timeout_in_process_isolation():
    marker = f"{uuid.uuid4().int % 10**6}.5"

    class Spin(Scored):
        def reward(self, task, completion):
            import subprocess

            subprocess.Popen(["sleep", marker])  # a child of the reward: killed with it
            while True:
                pass

    env = Spin("spin", reward_runtime=RewardRuntimeConfig(timeout_s=0.5, isolation="process"))
    start = time.monotonic()
    samples = [s for g in groups_of(env, 0, tasks=2, n=2) for s in g.samples]
    took = time.monotonic() - start
    assert took < 3.0 and all("timeout after 0.5s" in s.error for s in samples)
    time.sleep(0.2)
    assert _alive(marker) == []  # the reward's child died with it
    spinning = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == os.getpid() and _state(p) == "R"]
    assert spinning == []  # no forked reward keeps burning CPU after its deadline


def _ppid(pid):
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _state(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_every_failure_has_a_reason_logged_once_then_counted(caplog):
    failures = FailureLog(stop_after=0)
    envs = [Mixed("raise", 30), Mixed("string", 30)]
    with caplog.at_level(logging.WARNING, logger="rlcore"):
        for step in range(2):
            for env in envs:
                failures.request_done(groups_of(env, 16 * step), actor=0)
            counts = failures.step_metrics()["failed_by_reason"]
            assert counts.keys() == {"reward: RuntimeError: broken reward", "reward: reward is not a number ('great')"}
            assert all(v > 0 for v in counts.values())
    firsts = [r.getMessage() for r in caplog.records if "first of its kind" in r.getMessage()]
    assert len(firsts) == 2 and all("on task t/" in m for m in firsts)  # once each, with a task id


def test_printed_output_is_kept_per_sample_not_on_the_console(capfd):
    for isolation in ("thread", "process"):
        env = Mixed("print", 100, reward_runtime=RewardRuntimeConfig(isolation=isolation))
        samples = [s for g in groups_of(env, 0, tasks=1, n=2) for s in g.samples]
        assert all(s.reward == 0.5 and not s.failed for s in samples)
        assert all(
            OUTPUT_LIMIT <= len(s.env_output) < OUTPUT_LIMIT + 100 and "dropped" in s.env_output for s in samples
        )
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 1000  # not 4 x 6 MB


def test_liveness_stops_with_the_most_frequent_failure():
    failures = FailureLog(stop_after=3)
    env = Mixed("raise", 100)
    failures.request_done(groups_of(env, 0), actor=0)
    failures.request_done([Group(Task(id="ok", messages=[]), [Sample([1], [2], [0.0], [0], [1])])], actor=0)
    for r in range(2):  # a request with a success broke the streak: 2 more are not enough
        failures.request_done(groups_of(env, 16 * r), actor=0)
        failures.check()
    failures.request_lost(8, "engine: RayActorError: the actor died")
    with pytest.raises(NoProgress, match=r"last 3 generate requests .* RuntimeError: broken reward"):
        failures.check()


@pytest.mark.parametrize("behaviour", ["raise", "string", "nan"])
def test_the_stop_rule_follows_launch_order_not_finish_order(behaviour):
    """Requests 0, 1 fail in every sample, 2 succeeds, 3 fails: never 3 in a row in launch order.
    Whichever order they finish in (a fast reward, a slow one), the run is not stopped; with 3
    failing requests launched in a row it is, again whatever the finish order."""
    import itertools

    env = Mixed(behaviour, 100)
    failed, ok = (
        groups_of(env, 0, tasks=1, n=2),
        [Group(Task(id="ok", messages=[]), [Sample([1], [2], [0.0], [0], [1])])],
    )
    for outcome, results in ((False, [failed, failed, ok, failed]), (True, [failed, ok, failed, failed, failed])):
        for order in itertools.permutations(range(len(results))):
            failures = FailureLog(stop_after=3)
            failures.resume_at(0)
            stopped = False
            for seq in order:
                failures.request_done(results[seq], actor=seq % 2, seq=seq)
                try:
                    failures.check()
                except NoProgress:
                    stopped = True
            assert stopped is outcome, (behaviour, order)


def test_thread_counter_counts_only_live_threads():
    stop = threading.Event()
    before = threads_abandoned()
    env = Scored("ok", reward_runtime=RewardRuntimeConfig(timeout_s=0.2, isolation="thread"))
    env.reward = lambda task, completion: stop.wait(5)
    groups_of(env, 0, tasks=1, n=2)
    assert threads_abandoned() == before + 2
    stop.set()
    time.sleep(0.2)
    assert threads_abandoned() == before


def test_busy_loop_in_a_thread_is_stopped_at_the_deadline():
    before = threads_abandoned()
    start = time.monotonic()
    samples = [
        s
        for g in groups_of(
            Scored("spin", reward_runtime=RewardRuntimeConfig(timeout_s=0.3, isolation="thread")), 0, tasks=2, n=2
        )
        for s in g.samples
    ]
    assert time.monotonic() - start < 10.0 and all("timeout after 0.3s" in s.error for s in samples)
    time.sleep(0.3)
    assert threads_abandoned() == before  # no thread keeps spinning (and holding the GIL)


class BusyInC(Mixed):
    """Tasks below 100 busy-loop inside one C call (which no request to stop reaches), the
    others score 1.0."""

    def reward(self, task, completion):
        if int(task.id.split("/")[1]) < 100:
            return sum(itertools.repeat(1, 10**13))
        return 1.0


def test_an_overrunning_busy_reward_is_killed_and_the_next_one_runs_promptly():
    """Default isolation: each overrunning call's own process (a fork of its worker) is killed at
    the deadline and reaped, C loop included, so no worker keeps a spinning child and no thread
    keeps spinning; the workers stay and the next reward answers within the same 0.3 s deadline."""
    before = threads_abandoned()
    env = BusyInC("ok", 0, reward_runtime=RewardRuntimeConfig(timeout_s=0.3))
    samples = [s for g in groups_of(env, 0, tasks=2, n=2) for s in g.samples]
    assert all(s.failed and s.error == "reward: timeout after 0.3s" for s in samples), [s.error for s in samples]
    pool = env.reward_pool()
    workers = [w.pid for w in pool.idle] + pool.killed_pids
    assert workers, "no reward worker ran the calls"
    # nothing under any worker keeps spinning: a call left running in C would burn a core
    descendants = [d for pid in workers for d in _descendants(pid)]
    first = _cpu_ticks(descendants)
    time.sleep(0.5)
    assert _cpu_ticks(descendants) - first <= 5, [(d, _state(d)) for d in descendants]
    assert threads_abandoned() == before
    samples = [s for g in groups_of(env, 100, tasks=1, n=2) for s in g.samples]
    assert [(s.reward, s.error) for s in samples] == [(1.0, None), (1.0, None)]
    pool.close()


def test_a_reward_whose_arguments_do_not_pickle_still_runs_under_its_deadline():
    env = Scored("ok", reward_runtime=RewardRuntimeConfig(timeout_s=5))
    lock = threading.Lock()  # not picklable: it cannot be sent to a worker
    out = env.guarded(
        [(env.score, (env.make_task(0, "train"), [{"role": "assistant", "content": "x"}], {"l": lock}))], "score"
    )
    assert [(o.value, o.error) for o in out] == [(1.0, None)]
    env.reward_pool().close()


def test_discard_forgets_what_a_trainer_restart_goes_back_before():
    """Counts since the last row, the streak and requests waiting on an earlier launch number
    belong to steps a restart cuts back: the next row counts only what fails after it."""
    failures = FailureLog(stop_after=3)
    failures.resume_at(10)
    failures.request_lost(8, "engine: ActorDiedError", seq=10)
    failures.request_lost(8, "engine: ActorDiedError", seq=12)  # waits for 11, which was dropped
    failures.discard()
    failures.resume_at(10)  # the checkpoint hands out launch numbers 10, 11, 12 again
    assert failures.step_metrics()["failed_by_reason"] == {}
    env = Mixed("raise", 100)
    for seq in (10, 11, 12):
        failures.request_done(groups_of(env, 0, tasks=1, n=2), actor=0, seq=seq)
        assert failures.streak == seq - 9  # the stale result of 12 was not applied
    assert failures.step_metrics()["failed_by_reason"] == {"reward: RuntimeError: broken reward": 6}


def test_a_withdrawn_request_lets_the_later_ones_take_their_turn_in_the_streak():
    """A frozen engine's requests are taken back (their tasks go to another engine): neither a
    failure nor a success, and without their turn the streak would wait for them forever."""
    failures = FailureLog(stop_after=2)
    failures.resume_at(0)
    failures.request_lost(8, "engine: ActorDiedError", seq=1)
    failures.request_lost(8, "engine: ActorDiedError", seq=2)
    assert failures.streak == 0  # both wait for launch number 0
    failures.request_withdrawn(0)
    assert failures.streak == 2  # 0 changed nothing; 1 and 2 applied in order
    with pytest.raises(NoProgress):
        failures.check()


def test_a_few_failed_samples_per_reason_are_kept_for_the_samples_table():
    """The page's failure filter: `take_examples` hands over at most EXAMPLES_PER_REASON failed
    samples per reason since the last call (with the task and its token data), a lost request's
    with no completion; `failed_rows` turns them into samples.jsonl rows with a null reward."""
    from rlcore.batch.meta import group_meta
    from rlcore.report.failures import EXAMPLES_PER_REASON
    from rlcore.report.samples import failed_rows

    def failed(error, ids):
        return Sample([1], ids, [-0.5] * len(ids), [2] * len(ids), [1] * len(ids), failed=True, error=error)

    task = Task(id="t/7", messages=[{"role": "user", "content": "reverse abc"}])
    group = Group(
        task=task,
        samples=[failed(f"reward: ValueError: bug {i}", [10 + i, 2]) for i in range(5)]
        + [failed("reward: not a number: 'good'", [30]), Sample([1], [40], [-0.1], [2], [1], reward=1.0)],
    )
    meta = group_meta(group, data=group.samples)
    flog = FailureLog(0)
    flog.request_done([meta], actor=0)
    flog.request_lost(8, "engine: ActorDiedError", "the actor died", task=task)
    examples = flog.take_examples()
    assert [e.reason for e in examples] == ["reward: ValueError: bug #"] * EXAMPLES_PER_REASON + [
        "reward: not a number: 'good'",
        "engine: ActorDiedError",
    ]
    assert flog.take_examples() == []  # handed over once
    rows = failed_rows(examples, lambda ids: "".join(f"<{i}>" for i in ids))
    assert [r["completion"] for r in rows] == ["<10><2>", "<11><2>", "<30>", ""]
    assert all(r["reward"] is None and r["version"] is None for r in rows)
    assert rows[0]["prompt"] == "reverse abc" and rows[0]["error"] == "reward: ValueError: bug 0"
    assert rows[0]["tokens"] == ["<10>", "<2>"] and "tokens" not in rows[3] and rows[3]["prompt"] == "reverse abc"
    assert rows[3]["failed_reason"] == "engine: ActorDiedError" and "the actor died" in rows[3]["error"]
    flog.request_done([meta], actor=0)
    flog.discard()  # a trainer restart goes back before them
    assert flog.take_examples() == []


def _descendants(pid: int) -> list[int]:
    """Every live process under `pid` (its children, theirs, ...)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for child in _children(p):
            found.append(child)
            todo.append(child)
    return found


def _cpu_ticks(pids: list[int]) -> int:
    """User and system clock ticks `pids` used so far (a process gone counts 0)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _children(pid: int) -> list[int]:
    """The live children of process `pid` (none once it is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    found: list[int] = []
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                found += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return found
