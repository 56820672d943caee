"""WeightSync orders a sync's calls from the transport's own flags (rlcore.transfer.base.Sender):
a collective transport waits on the trainer's send and the engines' receive in one call; a
buffered one fills the trainer's buffers first (or takes what the train step pushed) and then
lets the engines read; `every_rank` says whose buffer each engine opens. The groups' remote calls
are recorded here instead of made (the real calls are covered by the integration tests)."""

import pytest

import actors.weights as weights_mod
from actors.weights import WeightSync


class Trainers:
    names = ["trainer rank 0", "trainer rank 1"]

    def __len__(self):
        return 2

    def push(self):
        return [{"sync_bytes": 8, "sync_send_s": 0.1, "rank": i} for i in range(2)]

    def init_weight_group(self, address, port, plan, engines=None):
        return [f"handle{i}" for i in range(2)] if address == "" else [None, None]

    def weight_address(self):
        return "10.0.0.1", 1234


class Rollouts:
    def __init__(self):
        self.opened, self.joined = None, None
        self.needs_reform = True
        self.released = []

    def release(self, actors, version):
        self.released.append((list(actors), version))

    def group_formed(self):
        self.needs_reform = False

    @staticmethod
    def frozen():
        return []

    def __len__(self):
        return 2

    @staticmethod
    def names(actors):
        return [f"rollout actor {i}" for i in actors]

    def pull(self, actors, version):
        return [{"engine": i, "version": version} for i in actors]

    def open_buffers(self, actors, plan, handles):
        self.opened = [(i, handles[i]) for i in actors]
        return [True for _ in actors]

    def join_group(self, actors, address, port, plan):
        self.joined = (list(actors), address, port)
        return [True for _ in actors]


def flags(buffered, every_rank):
    return type("Sender", (), {"buffered": buffered, "every_rank": every_rank})


@pytest.fixture
def calls(monkeypatch):
    """Each `get` of the sync: (what, participant names); refs are the values themselves."""
    seen = []

    def get(refs, timeout_s, what, names=None, stalled=None):
        seen.append((what, list(names or [])))
        return refs

    monkeypatch.setattr(weights_mod, "get", get)
    return seen


def make(transport):
    s = WeightSync.__new__(WeightSync)
    s.trainers, s.rollouts, s.transport, s.timeout_s, s.plan = Trainers(), Rollouts(), transport, 5.0, None
    return s


def test_a_collective_transport_waits_on_both_sides_at_once(calls):
    out = make(flags(False, False))._send(3, [0, 1], None)
    assert calls == [
        ("weight sync to version 3", ["trainer rank 0", "trainer rank 1", "rollout actor 0", "rollout actor 1"])
    ]
    assert [o.get("engine") for o in out] == [None, None, 0, 1]


def test_a_buffered_transport_fills_the_buffers_first_then_the_engines_read(calls):
    make(flags(True, True))._send(3, [1], None)
    assert calls == [
        ("weight sync to version 3 (trainer buffers)", ["trainer rank 0", "trainer rank 1"]),
        ("weight sync to version 3 (engines)", ["rollout actor 1"]),
    ]


def test_what_the_train_step_pushed_leaves_the_engines_receive_alone(calls):
    pushed = [{"sync_bytes": 8, "sync_send_s": 0.0}] * 2
    out = make(flags(True, True))._send(3, [0, 1], pushed)
    assert [w for w, _ in calls] == ["weight sync to version 3 (engines)"] and out[:2] == pushed


def test_every_rank_means_engine_i_opens_rank_i_s_buffer_else_rank_0_s(calls):
    s = make(flags(True, True))
    s.form([0, 1])
    assert s.rollouts.opened == [(0, "handle0"), (1, "handle1")] and not s.rollouts.needs_reform
    s = make(flags(True, False))
    s.form([1])
    assert s.rollouts.opened == [(1, "handle0")]


def test_a_collective_group_forms_on_a_rendezvous_with_the_serving_engines_in_slot_order(calls):
    s = make(flags(False, False))
    s.form([2, 0])
    assert s.rollouts.joined == ([2, 0], "10.0.0.1", 1234)
    assert calls == [("weight group init", ["trainer rank 0", "trainer rank 1", "rollout actor 2", "rollout actor 0"])]


def test_a_sync_reads_only_the_push_of_the_step_that_made_its_version():
    """A buffered transport's step writes the weights into the buffers; the sync of that version
    reads them once. A later sync (a resume's, a recovery's) of another version pushes anew."""
    from actors.trainer_group import TrainerGroup

    group = TrainerGroup.__new__(TrainerGroup)
    group._pushed = None
    group._get = lambda refs, what: [{"version": 4, "loss": 0.5, "weights_pushed": {"rank": i}} for i in range(2)]
    result = group.finish_step(["ref0", "ref1"], 4)
    assert result.metrics == {"version": 4, "loss": 0.5} and result.version == 4
    assert group.take_pushed(3) is None  # another version: not this step's buffers
    group.finish_step(["ref0", "ref1"], 4)
    assert group.take_pushed(4) == [{"rank": 0}, {"rank": 1}]
    assert group.take_pushed(4) is None  # read once


def test_a_failed_group_operation_is_given_up_at_its_rendezvous_before_the_group_forms_again(monkeypatch):
    """An engine that died while the group formed (or froze in a sync) leaves the trainer's rank
    0 waiting in that operation until its deadline, and Ray queues the re-formed group's calls
    behind it: the sync tells the old rendezvous to give up (`Sender.abort`) first."""
    from types import SimpleNamespace

    from actors.remote import ActorDied

    events = []

    class Transport:
        buffered, every_rank = False, False

        @classmethod
        def abort(cls, address, port):
            events.append(("abort", address, port))
            return True

    ports = iter([1234, 1235])

    class Rollouts2(Rollouts):
        stalls = SimpleNamespace(answering=lambda i: True)

        def dead_engines(self, actors):
            return []

        def engine_lost(self, actor, launched_at, cause=None):
            events.append(("lost", actor))

    def get(refs, timeout_s, what, names=None, stalled=None):
        events.append((what, tuple(names or [])))
        if what == "weight group init" and "rollout actor 1" in names:
            raise ActorDied("weight group init failed: rollout actor 1 died", ["rollout actor 1"])
        return refs

    monkeypatch.setattr(weights_mod, "get", get)
    s = make(Transport)
    s.rollouts, s.run = Rollouts2(), SimpleNamespace(version=0)
    s.cfg = SimpleNamespace(rollout=SimpleNamespace(canary_prompts=0))
    s._group = None
    s.trainers.weight_address = lambda: ("10.0.0.1", next(ports))
    s._reform_and_sync(7, [0, 1])
    assert events[:3] == [
        ("weight group init", ("trainer rank 0", "trainer rank 1", "rollout actor 0", "rollout actor 1")),
        ("abort", "10.0.0.1", 1234),
        ("lost", 1),
    ]
    assert events[3] == ("weight group init", ("trainer rank 0", "trainer rank 1", "rollout actor 0"))
    assert s.run.version == 7 and s.rollouts.joined == ([0], "10.0.0.1", 1235)
    # only the sync that reached its engines releases the version (P/D: decode of it may start)
    assert s.rollouts.released == [([0], 7)]


# -- the canary beside the next step (rollout.canary_blocking false) ---------------------------

PAIRS = [([1, 2], [3, 4, 5])]
GOOD = [[-1.0, -2.0, -0.5]]


class CanaryTrainers(Trainers):
    def __init__(self, events):
        self.events = events

    def canary(self, pairs):
        self.events.append("trainer canary")
        return [GOOD, GOOD]


class CanaryRollouts(Rollouts):
    """Engines whose sync of a version in `broken` leaves them 3 nats off on the canary's tokens."""

    def __init__(self, events, broken=()):
        super().__init__()
        self.events, self.broken, self.version, self.serving = events, set(broken), None, [0, 1]

    def pull(self, actors, version):
        self.events.append(f"pull {version}")
        self.version = version
        return super().pull(actors, version)

    def canary(self, actors, pairs):
        self.events.append(f"engine canary at {self.version}")
        off = 3.0 if self.version in self.broken else 0.0
        return [[[x - off for x in GOOD[0]]] for _ in actors]

    def dead_engines(self, actors):
        return []


def canary_sync(monkeypatch, blocking=False, broken=(), off_policy=1):
    from types import SimpleNamespace

    events = []

    def get(refs, timeout_s, what, names=None, stalled=None):
        if what.startswith("canary"):
            events.append(f"wait {what}")
        return refs

    monkeypatch.setattr(weights_mod, "get", get)
    s = make(type("Sender", (), {"buffered": False, "every_rank": False, "abort": staticmethod(lambda a, p: True)}))
    s.trainers, s.rollouts = CanaryTrainers(events), CanaryRollouts(events, broken)
    s.rollouts.needs_reform = False
    s.rollouts.join_group = lambda actors, address, port, plan: [True for _ in actors]
    s.run, s.sleep_level, s.canary_bounds, s._canary_pairs = SimpleNamespace(version=0), 0, None, PAIRS
    s.cfg = SimpleNamespace(
        rollout=SimpleNamespace(
            canary_prompts=1,
            canary_blocking=blocking,
            canary_multiple=4.0,
            canary_floor=0.05,
            canary_max_floor=0.5,
            canary_calibration_limit=1.0,
            max_mismatch=None,
        ),
        algo=SimpleNamespace(max_off_policy_steps=off_policy),
    )
    return s, events


def test_the_canary_runs_beside_the_next_step_and_is_checked_before_the_next_sync(monkeypatch):
    s, events = canary_sync(monkeypatch)
    first = s._reform_and_sync(0, [0], reform=False)  # the first sync calibrates: it waits
    assert first["canary_version"] == 0 and "wait canary (engines)" in events
    events.clear()
    assert "canary_version" not in s._reform_and_sync(1, [0], reform=False)  # started, not waited for
    assert events == ["pull 1", "trainer canary", "engine canary at 1"]
    events.clear()
    second = s._reform_and_sync(2, [0], reform=False)
    # version 1's canary is checked while the engines still hold version 1, before version 2 is sent
    assert events[:3] == ["wait canary (trainer)", "wait canary (engines)", "pull 2"]
    assert second["canary_version"] == 1 and second["canary_mean_gap"] == 0.0
    assert s.finish_canary()["canary_version"] == 2 and s.finish_canary() == {}  # the run's end


@pytest.mark.parametrize("blocking,off_policy", [(True, 1), (False, 0)])
def test_a_canary_that_waits_is_checked_in_its_own_sync(monkeypatch, blocking, off_policy):
    """canary_blocking=true, and every synchronous run (its next step would generate beside it)."""
    s, events = canary_sync(monkeypatch, blocking=blocking, off_policy=off_policy)
    s._reform_and_sync(0, [0], reform=False)
    assert s._reform_and_sync(1, [0], reform=False)["canary_version"] == 1 and s._canary is None


def test_a_broken_sync_found_a_step_late_is_retried_with_a_canary_that_waits(monkeypatch):
    """Once: the retry re-sends the new version and its canary waits; it passes, so the run goes
    on. Broken every time: the waiting canary fails too and the run stops, as it would have with
    canary_blocking=true."""
    s, events = canary_sync(monkeypatch, broken={1})
    s._reform_and_sync(0, [0], reform=False)
    s._reform_and_sync(1, [0], reform=False)  # broken, not yet known
    out = s._reform_and_sync(2, [0], reform=False)  # finds it, re-forms, sends 2 again, waits on its canary
    assert out["canary_version"] == 2 and s._canary is None and not s._canary_waits
    assert s.run.version == 2
    s, events = canary_sync(monkeypatch, broken={1, 2, 3})
    s._reform_and_sync(0, [0], reform=False)
    s._reform_and_sync(1, [0], reform=False)
    with pytest.raises(weights_mod.RunError, match="canary after sync to version 2"):
        s._reform_and_sync(2, [0], reform=False)


def test_a_trainer_restart_forgets_the_canary_its_dead_ranks_owed(monkeypatch):
    s, events = canary_sync(monkeypatch)
    s._reform_and_sync(0, [0], reform=False)
    s._reform_and_sync(1, [0], reform=False)
    s.drop_canary()
    assert s.finish_canary() == {}


def test_an_engine_that_left_since_is_not_waited_for(monkeypatch):
    s, events = canary_sync(monkeypatch, broken={1})
    s._reform_and_sync(0, [0, 1], reform=False)
    s._reform_and_sync(1, [0, 1], reform=False)  # both broken on version 1
    s.rollouts.serving = [1]  # engine 0 froze and left the serving set
    events.clear()
    with pytest.raises(weights_mod.RunError, match="rollout actor 1"):
        s.finish_canary()
    s._reform_and_sync(2, [1], reform=False)
    s.rollouts.serving = []
    assert s.finish_canary() == {}  # no engine left to compare
