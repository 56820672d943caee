"""A weight sync that fails because an engine died retries once without it, and does not probe
the engine the failed call already saw die: a restarting actor answers a probe only once Ray has
rebuilt it, so probing it cost the probe's whole 10 s per kill (issue 22's chaos run)."""

import pytest

from actors.remote import ActorDied, RunError
from actors.weights import WeightSync


class Rollouts:
    """The rollout group's side of the retry (probes, deaths), recorded instead of made."""

    def __init__(self):
        self.probed, self.lost = [], []

    def dead_engines(self, actors):
        self.probed.append(list(actors))
        return []

    def engine_lost(self, actor, launched_at, cause=None):
        self.lost.append(actor)


class Sync(WeightSync):
    """WeightSync's retry, with the group forming and the sync's remote calls recorded instead of made."""

    def __init__(self, fail: list[Exception]):
        self.fail, self.synced, self.rollouts = fail, [], Rollouts()

    @property
    def probed(self):
        return self.rollouts.probed

    @property
    def lost(self):
        return self.rollouts.lost

    def form(self, actors=None):
        pass

    def _sync(self, version, actors, pushed=None):
        if self.fail:
            raise self.fail.pop(0)
        self.synced.append((version, list(actors)))
        return {"sync_time_s": 0.0}


def test_engine_seen_dying_is_not_probed_and_the_others_get_the_version():
    s = Sync([ActorDied("weight sync to version 3 failed: rollout actor 1 died", ["rollout actor 1"])])
    s._reform_and_sync(3, [0, 1, 2])
    assert s.lost == [1] and s.probed == [[0, 2]] and s.synced == [(3, [0, 2])]


def test_a_failure_without_a_named_engine_probes_all_and_a_second_failure_stops():
    s = Sync([RunError("weight sync to version 3 did not finish within 120s")] * 2)
    with pytest.raises(RunError):
        s._reform_and_sync(3, [0, 1])
    assert s.probed == [[0, 1]] and s.synced == []


def test_a_dead_trainer_rank_stops_the_run_at_once():
    s = Sync([ActorDied("weight sync failed: trainer rank 0 died", ["trainer rank 0"])])
    with pytest.raises(ActorDied):
        s._reform_and_sync(3, [0, 1])
    assert s.probed == [] and s.lost == []


def test_the_retry_warning_is_one_line_however_long_the_remote_traceback(caplog):
    remote = (
        "weight sync to version 3 failed: \x1b[36mray::TrainerRank.push_weights()\x1b[39m (pid=7)\n"
        '  File "rlcore/transfer/broadcast.py", line 49, in broadcast\n'
        "    self.pg.broadcast([tensor], opts).wait(self.timeout)\n"
        "RuntimeError: [gloo/pair.cc:547] Connection closed by peer [127.0.0.1]:52874"
    )
    s = Sync([ActorDied(remote, ["rollout actor 1"])])
    with caplog.at_level("WARNING", logger="rlcore"):
        s._reform_and_sync(3, [0, 1])
    (warning,) = [r.getMessage() for r in caplog.records if "re-forming" in r.getMessage()]
    assert "\n" not in warning and "\x1b" not in warning
    assert warning.startswith("weight sync to version 3 failed: ray::TrainerRank.push_weights()")
    assert "RuntimeError: [gloo/pair.cc:547] Connection closed by peer" in warning
    assert warning.endswith("rollout actor(s) [1] left, re-forming the weight group without them")
