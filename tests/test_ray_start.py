"""A Ray start-up failure is one line saying what failed and what to try; a local start is
retried once (a loaded machine can time a node out), a connection to a given address is not."""

import os

import pytest
import ray

from actors.session import RayStartError, start_ray
from rlcore.plan.compose import compose
from rlcore.run import main


class FailingInit:
    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def __call__(self, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise Exception(
                "The current node timed out during startup. This could happen because some of "
                "the raylet failed to startup or the GCS has become overloaded."
            )


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


@pytest.mark.parametrize(
    "env, made",
    [
        ({}, True),  # Ray's default, token: made, owner-only
        ({"RAY_AUTH_MODE": "disabled"}, False),  # the user turned it off
        ({"RAY_AUTH_TOKEN_PATH": "/elsewhere/token"}, False),  # the user gave one
    ],
)
def test_a_local_cluster_runs_with_token_auth_and_a_private_token_file(tmp_path, monkeypatch, env, made):
    from actors.session import local_ray_environment

    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    local_ray_environment()
    token = tmp_path / ".ray" / "auth_token"
    assert os.environ["RAY_AUTH_MODE"] == env.get("RAY_AUTH_MODE", "token")
    assert token.exists() == made
    if made:
        assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
        before = token.read_text()
        local_ray_environment()  # an existing token is kept
        assert token.read_text() == before
