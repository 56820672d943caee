"""`actors.stall_watch.StallWatch` on a real actor whose process is stopped (SIGSTOP) and
continued: named once silent for `stall_s`, answering again after SIGCONT; a dead actor is not
"answering". Frozen nodes in a run: tests/test_multinode.py -k frozen."""

import os
import signal
import time

import pytest

pytestmark = pytest.mark.integration


def test_a_stopped_actor_is_named_after_stall_s_and_answers_again_after_sigcont():
    import ray

    from actors.stall_watch import StallWatch

    @ray.remote(max_concurrency=2)
    class Engine:
        def ready(self) -> int:
            return 0

        def pid(self) -> int:
            return os.getpid()

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        actors = [Engine.remote(), Engine.remote()]
        pids = ray.get([a.pid.remote() for a in actors])
        watch = StallWatch(actors, stall_s=3.0)

        def poll(seconds: float) -> list:
            seen, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                seen += watch.stalled([0, 1])
                time.sleep(0.2)
            return seen

        assert poll(4.0) == []  # both answer
        assert watch.answering(0) and watch.answering(1)
        os.kill(pids[0], signal.SIGSTOP)
        try:
            time.sleep(2.5)  # the question asked before the stop may have been answered: wait a beat
            seen = poll(8.0)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        assert seen and {i for i, _ in seen} == {0}, seen  # only the stopped one
        assert all(s > 3.0 for _, s in seen)
        assert not watch.answering(0, within_s=2.0) and watch.answering(1)
        end = time.monotonic() + 10.0
        while not watch.answering(0) and time.monotonic() < end:  # back: it answers again
            poll(0.5)
        assert watch.answering(0)
        assert poll(3.0) == []
        ray.kill(actors[1], no_restart=True)
        time.sleep(1.0)
        poll(3.0)
        assert not watch.answering(1, within_s=2.0)  # a dead actor's error is not an answer
    finally:
        ray.shutdown()
