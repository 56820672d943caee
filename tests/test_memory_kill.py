"""A rollout actor killed by Ray's memory monitor is named for it (who killed it, the node's
figures) and counted as a death, not reported as a broken weight sync; a call reaching a
restarted actor before it rejoined the weight group is a named error, also counted."""

import time

import pytest
import ray

from actors.remote import ActorDied, died, get
from rlcore.report.faults import NotInWeightGroup, memory_kill

RAY_TEXT = (  # the text of Ray's OutOfMemoryError (Ray's docs and the raylet's message)
    "Task was killed due to the node running low on memory.\nMemory on the node (IP: 172.17.0.2, ID: 8c5a14) "
    "where the task (task ID: 41617b, name=RolloutWorker.generate_split, pid=548, memory used=12.18GB) was "
    "running was 21.91GB / 33.28GB (0.658192), which exceeds the memory usage threshold of 0.65. Ray killed "
    "this worker (ID: 0f7695) because it was the most recently scheduled task"
)


def test_the_memory_monitor_s_text_becomes_one_line_with_the_figures():
    assert memory_kill(RAY_TEXT) == (
        "killed by Ray's memory monitor (raylet): node 172.17.0.2 at 21.91GB / "
        "33.28GB (0.66), over the memory usage threshold 0.65; the worker used 12.18GB"
    )
    new = (
        "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 127.0.0.1, ID: "
        "23eb8e) was 4.92GB used / 23.54GB limit (0.208918)\nOOM kill reason: Memory usage 5276835840B exceeded "
        "threshold of 252759888B (1.0% of 25275990016B limit)\n... task name=Hog.work, pid=1742, actual memory "
        "used=0.04GB, worker ID=7d6de4"
    )  # Ray 2.60's text
    assert memory_kill(new) == (
        "killed by Ray's memory monitor (raylet): node 127.0.0.1 at 4.92GB / 23.54GB (0.21), "
        "over the memory usage threshold 0.01; the worker used 0.04GB"
    )
    assert (
        memory_kill("The actor died unexpectedly. Worker exit type: NODE_OUT_OF_MEMORY")
        == "killed by Ray's memory monitor (raylet)"
    )
    assert memory_kill("ValueError: boom") is None


def test_a_call_reaching_a_restarted_actor_counts_as_its_restart():
    exc = ray.exceptions.RayTaskError("pull_weights", "Traceback ...", NotInWeightGroup("rollout actor 0 ..."))
    assert died(exc)
    assert not died(ray.exceptions.RayTaskError("pull_weights", "Traceback ...", AttributeError("receive")))


@ray.remote(max_restarts=0)
class Hog:
    def work(self) -> int:
        time.sleep(60)
        return 1


@pytest.mark.integration
def test_an_actor_killed_by_the_memory_monitor_is_named_for_it():
    # every node is "over" a threshold of 1%: the monitor kills the worker running a task at once
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"memory_usage_threshold": 0.01, "memory_monitor_refresh_ms": 100},
    )
    try:
        hog = Hog.remote()
        with pytest.raises(ActorDied) as caught:
            get([hog.work.remote()], 120, "generate request", ["rollout actor 0"])
        assert caught.value.dead == ["rollout actor 0"]
        assert caught.value.how.startswith("killed by Ray's memory monitor (raylet): node "), caught.value.how
        assert "over the memory usage threshold 0.01" in caught.value.how, caught.value.how
    finally:
        ray.shutdown()
