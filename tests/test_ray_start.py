"""A Ray start-up failure is one line saying what failed and what to try; a local start is
retried once (a loaded machine can time a node out), a connection to a given address is not."""

import pytest
import ray

from rlcore.plan.compose import compose
from actors.session import RayStartError, start_ray
from rlcore.run import main


class FailingInit:
    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def __call__(self, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise Exception("The current node timed out during startup. This could happen because some of "
                            "the raylet failed to startup or the GCS has become overloaded.")


def test_local_start_is_retried_once(monkeypatch, tmp_path):
    init = FailingInit(failures=1)
    monkeypatch.setattr(ray, "init", init)
    start_ray(compose([f"output_dir={tmp_path}"]))
    assert init.calls == 2


def test_local_start_that_fails_twice_is_one_line(monkeypatch, tmp_path):
    init = FailingInit(failures=2)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RayStartError) as info:
        start_ray(compose([f"output_dir={tmp_path}"]))
    assert init.calls == 2
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("the local Ray cluster did not start, twice (The current node timed out")
    assert "RAY_ADDRESS" in msg


def test_a_given_address_is_not_retried(monkeypatch, tmp_path):
    init = FailingInit(failures=1)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RayStartError, match="could not connect to the Ray cluster at 10.0.0.1:6379"):
        start_ray(compose([f"output_dir={tmp_path}", "cluster.address=10.0.0.1:6379"]))
    assert init.calls == 1


def test_main_reports_a_failed_start_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", FailingInit(failures=2))
    assert main([f"output_dir={tmp_path}", "cluster.num_cpus=2"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlcore:") or "Traceback" in line]
    assert len(err) == 1 and err[0].startswith("rlcore: error: the local Ray cluster did not start"), err
