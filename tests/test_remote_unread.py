"""A failed `actors.remote.get` reads the call's other refs once they finish, so a fault the run
handled (one engine's death failing the other engines' half of a weight sync) leaves no
"Unhandled error" traceback from Ray in the driver's console."""

import gc
import time

import pytest
import ray
import ray._private.worker as ray_worker

from actors.remote import ActorDied, get, read_unread

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """One local Ray for the module (a start costs seconds on 2 cores)."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote
def fails_after(seconds: float) -> None:
    time.sleep(seconds)
    raise ValueError("a peer's half of a collective that broke")


def _unhandled_after_failed_get(monkeypatch, read_later: bool) -> list[str]:
    seen: list[str] = []
    # Ray reports an unread error object through this module function when its ref is dropped
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", lambda e: seen.append(type(e).__name__))
    refs = [fails_after.remote(0.0), fails_after.remote(1.0)]
    with pytest.raises(ray.exceptions.RayTaskError):
        if read_later:
            get(refs, 30, "weight sync")
        else:
            ray.get(refs, timeout=30)
    time.sleep(2.0)  # the second ref fails after the call gave up on it
    if read_later:
        assert read_unread() == 0  # finished, read, let go
    del refs
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not seen:
        time.sleep(0.1)
    return seen


def test_failed_get_leaves_no_unhandled_error(monkeypatch):
    # a plain ray.get does print the late failure: the check below can fail
    assert _unhandled_after_failed_get(monkeypatch, read_later=False) == ["RayTaskError"]
    assert _unhandled_after_failed_get(monkeypatch, read_later=True) == []


@ray.remote(max_restarts=0)
class Rank:
    def exit_after(self, seconds: float) -> None:
        time.sleep(seconds)
        import os

        os._exit(1)

    def wait_in_collective(self, seconds: float) -> None:
        time.sleep(seconds)

    def broken_collective(self) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:56005: Connection reset by peer")


def test_a_rank_whose_peer_died_reports_the_death_not_its_broken_collective():
    ranks = [Rank.remote(), Rank.remote()]
    # rank 0 answers first with the transport error; rank 1's death shows a moment later
    refs = [ranks[0].broken_collective.remote(), ranks[1].exit_after.remote(1.0)]
    with pytest.raises(ActorDied, match="trainer rank 1 died") as info:
        get(refs, 60, "train step 3", ["trainer rank 0", "trainer rank 1"])
    assert info.value.dead == ["trainer rank 1"]
    # the same error with no dead peer stays what it was
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection reset"):
        get([ranks[0].broken_collective.remote()], 60, "train step 4", ["trainer rank 0"])


def test_the_clusters_error_reports_go_to_the_run_folder_with_one_console_line(tmp_path, capfd, caplog):
    """Ray prints every error report the cluster publishes (a node declared dead: a 20-line
    raylet traceback) to the driver's console whatever `log_to_driver` says; the run keeps the
    whole text in OUTPUT_DIR/logs/ray-errors.log and says one line."""
    import logging

    from ray._private.utils import publish_error_to_driver

    from actors.logs import route_cluster_errors

    original = ray_worker.print_to_stdstream
    try:
        path = route_cluster_errors(str(tmp_path))
        assert route_cluster_errors(str(tmp_path)) == path  # twice in one process: still one printer
        report = "The node with node id abc has been marked dead\n" + "\n".join(f"  frame {i}" for i in range(20))
        with caplog.at_level(logging.INFO, logger="rlcore"):
            # one killed raylet came as two identical reports: said once; a different one after it is said
            for text in (report, report, "Raylet is terminated\n  last lines"):
                publish_error_to_driver(
                    "node_died",
                    text,
                    ray_worker.global_worker.gcs_client,
                    job_id=ray_worker.global_worker.current_job_id,
                )

            def said() -> list[str]:
                return [r.getMessage() for r in caplog.records if "Ray reported" in r.getMessage()]

            # the printer thread writes the file and then logs: wait for both (CI once read the
            # records between the third report's write and its line)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (
                path.exists() and "last lines" in path.read_text() and any("Raylet" in line for line in said())
            ):
                time.sleep(0.2)
        assert path.read_text().count("frame 19") == 1
        lines = said()
        assert lines == [
            f"Ray reported: The node with node id abc has been marked dead (whole report: {path})",
            f"Ray reported: Raylet is terminated (whole report: {path})",
        ]
        assert "frame 3" not in capfd.readouterr().err
    finally:
        ray_worker.print_to_stdstream = original


def test_a_wait_that_watches_for_frozen_peers_ends_when_a_peer_dies():
    """The weight sync's `get` (given `stalled`, the stall watch): rollout actor 1 dies mid-sync
    while the trainer waits in the broadcast for it, until its own deadline. Before, the wait
    polled for frozen peers only and lasted until every participant had answered (the sync's
    120 s in a run whose engine was killed then); now the death ends it, named, while the
    other participant still waits."""
    ranks = [Rank.remote(), Rank.remote()]
    refs = [ranks[0].wait_in_collective.remote(30.0), ranks[1].exit_after.remote(0.5)]
    with pytest.raises(ActorDied, match="rollout actor 1 died") as info:
        get(refs, 60, "weight sync to version 4", ["trainer rank 0", "rollout actor 1"], stalled=lambda: [])
    assert info.value.dead == ["rollout actor 1"]
    assert ray.wait([refs[0]], timeout=0)[1] == [refs[0]]  # reported before the trainer's wait ended
    ray.kill(ranks[0])
    # the refs a failed get keeps (`_UNREAD`) are process-wide: read them before this module's Ray
    # session ends, or the next session's first `get` asks Ray about an owner it never knew
    deadline = time.monotonic() + 60
    while read_unread() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_unread() == 0


@ray.remote
def answers_after(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def test_a_named_wait_says_what_it_waits_for_within_seconds(monkeypatch, caplog):
    """`get(..., notice=...)` (a checkpoint's write): a wait still open after WAIT_NOTICE_S is one
    line naming the participants not done, where, and how long it will wait."""
    import logging

    import actors.remote as remote

    monkeypatch.setattr(remote, "WAIT_NOTICE_S", 1.0)
    refs = [answers_after.remote(0.0), answers_after.remote(3.0)]
    with caplog.at_level(logging.WARNING, logger="rlcore"):
        assert get(
            refs,
            60,
            "checkpoint save of step 3",
            ["trainer rank 0", "trainer rank 1"],
            notice="writing to /ckpt, checkpoint.timeout_s",
        ) == [1, 1]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "checkpoint save of step 3: waiting for trainer rank 1 (writing to /ckpt, checkpoint.timeout_s); up to"
    ), lines


def test_the_capacity_probe_asks_the_live_cluster_without_blocking():
    """`actors.session.CapacityProbe` on a real (one-node, unlabelled) cluster: the first call
    starts the check and returns at once; then it names the label no alive node has."""
    from actors.session import CapacityProbe
    from rlcore.plan.compose import compose
    from rlcore.plan.layout import group_bundles

    cfg = compose(["cluster.trainer_node_labels.rlcore-group=trainer"])
    probe = CapacityProbe(cfg.cluster, group_bundles(cfg)[0])
    start = time.monotonic()
    assert probe() is None and time.monotonic() - start < 1.0
    deadline = time.monotonic() + 30
    while probe() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (probe() or "").startswith("no alive node has the label rlcore-group=trainer the trainer group asks for")
    assert CapacityProbe(cfg.cluster, [])() is None  # nothing to place: nothing asked
