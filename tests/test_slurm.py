"""launch/slurm/rlcore.sbatch: the dry run (command by command, with a fake allocation: SLURM_*
variables), and the real thing on a real two-node Slurm cluster of this machine
(tests/slurm_cluster.py): the README's line trains on both nodes, the job's exit status is the
run's, a lost node fails the job at once, a TERM keeps a checkpoint and a requeue resumes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "launch" / "slurm" / "rlcore.sbatch"
BASH = shutil.which("bash") or "/bin/bash"


def allocation(nodelist: str = "gpu[01-02],gpu10", **extra: str) -> dict[str, str]:
    """A fake allocation; PATH has no scontrol, so the script's own hostlist parser runs."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_CPUS_PER_TASK": "16",
        "SLURM_GPUS_PER_TASK": "8",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    env.update(extra)
    return env


def run_script(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BASH, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def printed_commands(stdout: str) -> list[tuple[list[str], bool]]:
    """The dry run's commands, parsed back as a shell would: (argv, runs in the background)."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("+ "):
            words = shlex.split(line[2:])
            background = words[-1] == "&"
            out.append((words[:-1] if background else words, background))
    return out


def option(argv: list[str], name: str) -> str | None:
    for word in argv:
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
    return None


def dry_run(*args: str, **env_extra: str) -> list[tuple[list[str], bool]]:
    proc = run_script(allocation(**env_extra), "--dry-run", *args)
    assert proc.returncode == 0, proc.stderr
    return printed_commands(proc.stdout)


# --- dry run -------------------------------------------------------------------------------


def test_dry_run_prints_one_step_per_node_the_wait_and_the_run():
    py = str(REPO / ".venv" / "bin" / "python")
    ray = str(REPO / ".venv" / "bin" / "ray")
    commands = dry_run("+recipe=qwen30b_swe", "steps=3", "logger.run_name=it's a test")
    assert len(commands) == 4, commands
    (head, head_bg), *workers, (run, run_bg) = commands

    assert head_bg and head[0] == "srun" and "--overlap" in head
    assert option(head, "--nodes") == "1" and option(head, "--nodelist") == "gpu01"
    ray_args = head[head.index(ray) :]
    assert ray_args[:4] == [ray, "start", "--head", "--block"]
    assert "--port=6379" in ray_args and "--num-cpus=16" in ray_args and "--num-gpus=8" in ray_args
    assert "--temp-dir=/tmp/rlc-0-0" in ray_args

    # one step per worker node, so that the one that exits can be named
    assert [option(w, "--nodelist") for w, _ in workers] == ["gpu02", "gpu10"]
    for i, (worker, background) in enumerate(workers, start=1):
        assert background and option(worker, "--nodes") == "1"
        ray_args = worker[worker.index(ray) :]
        assert ray_args[:3] == [ray, "start", "--block"]
        assert "--address=gpu01:6379" in ray_args and "--num-gpus=8" in ray_args
        assert f"--temp-dir=/tmp/rlc-0-{i}" in ray_args

    # The run: exactly the arguments given, quoting preserved, with the cluster's address and
    # token authentication on (the token itself is never printed).
    assert not run_bg
    assert run == [
        "env",
        "RAY_ADDRESS=gpu01:6379",
        "RAY_AUTH_MODE=token",
        py,
        "-m",
        "rlcore.run",
        "+recipe=qwen30b_swe",
        "steps=3",
        "logger.run_name=it's a test",
    ]


def test_dry_run_by_environment_variable_matches_the_flag():
    flag = run_script(allocation(), "--dry-run", "steps=3")
    env = run_script(allocation(RLCORE_DRY_RUN="1"), "steps=3")
    assert flag.returncode == env.returncode == 0
    assert flag.stdout == env.stdout


def test_single_node_starts_no_workers():
    commands = dry_run(SLURM_JOB_NODELIST="solo")
    argvs = [argv for argv, _ in commands]
    assert len(argvs) == 2
    assert option(argvs[0], "--nodelist") == "solo"
    assert not any("--address=solo:6379" in a for a in argvs)


def test_overrides_of_ports_python_and_ray_arguments():
    commands = dry_run(
        "steps=1",
        RLCORE_RAY_PORT="7000",
        RLCORE_PYTHON="/opt/env/bin/python",
        RLCORE_HEAD_IP="10.1.2.3",
        RLCORE_RAY_HEAD_ARGS="--dashboard-port=9000 --ray-client-server-port=9001",
        RLCORE_RAY_WORKER_ARGS="--object-store-memory=1000000000",
        RAY_TMPDIR="/scratch",
        SLURM_JOB_ID="77",
    )
    (head, _), (w1, _), (w2, _), (run, _) = commands
    assert "/opt/env/bin/ray" in head and "--node-ip-address=10.1.2.3" in head and "--port=7000" in head
    assert head[-3:] == ["--temp-dir=/scratch/rlc-77-0", "--dashboard-port=9000", "--ray-client-server-port=9001"]
    assert "--address=10.1.2.3:7000" in w1 and w2[-2:] == [
        "--temp-dir=/scratch/rlc-77-2",
        "--object-store-memory=1000000000",
    ]
    assert run[:4] == ["env", "RAY_ADDRESS=10.1.2.3:7000", "RAY_AUTH_MODE=token", "/opt/env/bin/python"]


@pytest.mark.parametrize("mode, expected", [("disabled", "disabled"), ("DISABLED", "disabled"), ("token", "token")])
def test_auth_mode_is_passed_on(mode, expected):
    proc = run_script(allocation(RAY_AUTH_MODE=mode), "--dry-run", "steps=1")
    assert proc.returncode == 0, proc.stderr
    run = printed_commands(proc.stdout)[-1][0]
    assert f"RAY_AUTH_MODE={expected}" in run


def test_auth_mode_and_token_file_are_checked(tmp_path):
    proc = run_script(allocation(RAY_AUTH_MODE="k8s"), "--dry-run")
    assert proc.returncode == 2 and "RAY_AUTH_MODE must be 'token' or 'disabled', got 'k8s'" in proc.stderr
    proc = run_script(allocation(RAY_AUTH_TOKEN_PATH=str(tmp_path / "missing")), "--dry-run")
    assert proc.returncode == 2 and f"RAY_AUTH_TOKEN_PATH: cannot read '{tmp_path / 'missing'}'" in proc.stderr
    assert "+ srun" not in proc.stdout


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("n[1,3-4]x", ["n1x", "n3x", "n4x"]),
        ("rack[1-2]-gpu[01-02]", ["rack1-gpu01", "rack1-gpu02", "rack2-gpu01", "rack2-gpu02"]),
        ("a1,b[7,9],c", ["a1", "b7", "b9", "c"]),
        ("node-[098-101]", ["node-098", "node-099", "node-100", "node-101"]),
    ],
)
def test_hostlist_expansion_without_scontrol(nodelist, expected):
    commands = dry_run(SLURM_JOB_NODELIST=nodelist)
    steps = [argv for argv, background in commands if background]
    assert [option(step, "--nodelist") for step in steps] == expected


def test_scontrol_is_preferred_when_present(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "alpha\\nbeta\\n"\n')
    fake.chmod(0o755)
    env = allocation("ignored[1-9]", PATH=f"{tmp_path}:/usr/bin:/bin")
    proc = run_script(env, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    assert option(commands[0][0], "--nodelist") == "alpha"
    assert option(commands[1][0], "--nodelist") == "beta"


@pytest.mark.parametrize(
    "env_change, message",
    [
        ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_JOB_NODELIST": "gpu[01-"}, "unclosed '['"),
        ({"SLURM_JOB_NODELIST": "gpu01]"}, "unbalanced ']'"),
        ({"SLURM_JOB_NODELIST": "gpu[3-1]"}, "descending range"),
        ({"SLURM_JOB_NODELIST": "gpu[a-b]"}, "bad range 'a-b'"),
        ({"SLURM_JOB_NODELIST": "gpu01,,gpu02"}, "empty entry"),
        ({"SLURM_JOB_NUM_NODES": "4"}, "expands to 3 nodes but SLURM_JOB_NUM_NODES=4"),
        ({"SLURM_CPUS_PER_TASK": None}, "SLURM_CPUS_PER_TASK"),
        ({"SLURM_CPUS_PER_TASK": "lots"}, "positive integer"),
        ({"SLURM_GPUS_PER_TASK": "h100:eight"}, "GPUs per node must be a count"),
        ({"RLCORE_RAY_PORT": "0"}, "RLCORE_RAY_PORT must be a positive integer"),
        ({"RLCORE_DRY_RUN": "yes"}, "RLCORE_DRY_RUN must be 0 or 1"),
    ],
)
def test_bad_allocation_gives_one_clear_error(env_change, message):
    env = allocation()
    for key, value in env_change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    # a missing variable is an error of a real run only (a dry run falls back to the #SBATCH shape)
    real = "RLCORE_DRY_RUN" in env_change or None in env_change.values()
    proc = run_script(env, *(() if real else ("--dry-run",)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "+ srun" not in proc.stdout, "nothing may start after a bad allocation"


def test_gpu_count_with_a_type_prefix():
    commands = dry_run(SLURM_GPUS_PER_TASK="h100:4")
    assert "--num-gpus=4" in commands[0][0]


def test_real_run_needs_the_environment(tmp_path):
    proc = run_script(allocation(RLCORE_PYTHON=str(tmp_path / "nope" / "python")))
    assert proc.returncode == 2
    assert "no Python at" in proc.stderr


def test_an_unresolvable_head_names_rlcore_head_ip():
    env = allocation(
        "no-such-host-rlcore-test", SLURM_CPUS_PER_TASK="1", RLCORE_PYTHON=str(REPO / ".venv" / "bin" / "python")
    )
    proc = run_script(env, "steps=1")
    assert proc.returncode == 2
    assert (
        "cannot resolve the head node 'no-such-host-rlcore-test'" in proc.stderr and "set RLCORE_HEAD_IP" in proc.stderr
    )


@pytest.mark.skipif(
    shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}") is None,
    reason="shellcheck not installed (it comes with the dev group: uv sync)",
)
def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


# --- a dry run without Slurm (nodes described by flags) -------------------------------------


def no_slurm() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}


def test_dry_run_without_slurm_describes_the_nodes_with_flags():
    proc = run_script(no_slurm(), "--dry-run", "--nodelist=g[1-2]", "--cpus-per-node=8", "--gpus-per-node=2", "steps=1")
    assert proc.returncode == 0, proc.stderr
    (head, _), (workers, _), (run, _) = printed_commands(proc.stdout)
    assert option(head, "--nodelist") == "g1" and "--num-cpus=8" in head and "--num-gpus=2" in head
    assert option(workers, "--nodelist") == "g2" and "--num-gpus=2" in workers
    assert run[-1] == "steps=1"


def test_dry_run_without_slurm_or_flags_uses_the_sbatch_shape():
    proc = run_script(no_slurm(), "--dry-run", "+recipe=qwen30b_swe")
    assert proc.returncode == 0, proc.stderr
    (head, _), *workers, _ = printed_commands(proc.stdout)
    assert "--num-gpus=8" in head and "--num-cpus=64" in head  # not --num-gpus=0
    assert [option(w, "--nodelist") for w, _ in workers] == ["node2", "node3", "node4"]


def test_node_flags_are_refused_outside_a_dry_run():
    proc = run_script(no_slurm(), "--nodelist=g1", "steps=1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "rlcore.sbatch: error: --nodelist, --cpus-per-node and --gpus-per-node describe "
        "nodes for --dry-run only; a real run uses its allocation"
    )


# --- the real thing: a two-node Slurm cluster of this machine ---------------------------------


@pytest.fixture(scope="module")
def slurm():
    from tests.slurm_cluster import SlurmCluster, missing

    why = missing()
    if why:
        pytest.skip(why)
    # a short path: each node's Ray folder goes under it, and Ray's socket paths must stay short
    root = Path(tempfile.mkdtemp(prefix="slm", dir="/tmp"))
    cluster = SlurmCluster.start(root / "slurm")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit(slurm, tmp_path: Path, *run_args: str, sbatch_args: tuple[str, ...] = (), **env_extra: str):
    """The README's line (RLCORE_HEAD_IP, two nodes of one CPU, no GPU) plus ports of the job's own
    (other Ray clusters may run on this machine). Returns (job id, its output file, dashboard URL)."""
    dash = free_port()
    # a fresh shell's environment (not this process's: conftest set Ray variables for its own Ray)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": os.environ.get("HOME", "/root"),
        "USER": os.environ.get("USER", "root"),
        "RLCORE_HEAD_IP": "127.0.0.1",
        "RLCORE_RAY_PORT": str(free_port()),
        "RLCORE_RAY_HEAD_ARGS": f"--dashboard-host=127.0.0.1 --dashboard-port={dash} "
        f"--ray-client-server-port={free_port()} --dashboard-agent-listen-port={free_port()}",
        "RLCORE_RAY_WORKER_ARGS": f"--dashboard-agent-listen-port={free_port()}",
        "RAY_TMPDIR": str(slurm.root.parent),
        "RAY_USAGE_STATS_ENABLED": "0",
        **env_extra,
    }
    out = tmp_path / "job.out"
    job = slurm.sbatch(
        [
            "--export=ALL",
            "--nodes=2",
            "--gpus-per-task=0",
            "--cpus-per-task=1",
            f"--output={out}",
            *sbatch_args,
            str(SCRIPT),
            *run_args,
        ],
        env,
        cwd=REPO,
    )
    return job, out, f"http://127.0.0.1:{dash}"


def metrics_rows(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(what: str, check, timeout_s: float, job=None, slurm=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if job is not None and slurm.job(job).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job} ended ({slurm.job(job).get('JobState')}) before {what}")
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout_s:.0f} s")


def test_the_readme_line_trains_on_two_slurm_nodes(slurm, tmp_path):
    out_dir = tmp_path / "run"
    job, out, _ = submit(slurm, tmp_path, "steps=5", f"output_dir={out_dir}")
    state, rc = slurm.wait(job, timeout_s=480)
    text = out.read_text()
    assert (state, rc) == ("COMPLETED", 0), text[-3000:]
    assert [row["step"] for row in metrics_rows(out_dir)] == [1, 2, 3, 4, 5]
    assert "Ray token authentication on, a token made for this job" in text
    # trainer on one node, rollout on the other (one CPU each: the placement must spread them)
    placed = dict(re.findall(r"placement: (trainer|rollout) group's 1 bundle\(s\) on node\(s\) (\w+)", text))
    assert set(placed) == {"trainer", "rollout"} and placed["trainer"] != placed["rollout"], text[-3000:]
    # each Slurm node ran its own Ray, in a folder of this job's
    assert sorted(p.name for p in slurm.root.parent.glob(f"rlc-{job}-*")) == [f"rlc-{job}-0", f"rlc-{job}-1"]


def test_bad_arguments_end_the_job_with_the_runs_config_error_before_ray_starts(slurm, tmp_path):
    job, out, _ = submit(slurm, tmp_path, "steps=-1", f"output_dir={tmp_path / 'run'}")
    state, rc = slurm.wait(job, timeout_s=120)
    text = out.read_text()
    assert (state, rc) == ("FAILED", 2), text[-3000:]
    assert "rlcore: config error: steps: must be > 0, got -1" in text
    assert "no Ray was started" in text and "Ray runtime started" not in text
    assert not list(slurm.root.parent.glob(f"rlc-{job}-*"))


def test_a_lost_node_fails_the_job_at_once_and_names_it(slurm, tmp_path):
    """Also: with token authentication off (RAY_AUTH_MODE=disabled) the cluster and the run work."""
    out_dir = tmp_path / "run"
    job, out, _ = submit(
        slurm, tmp_path, "steps=200", "sft.warmup_steps=0", f"output_dir={out_dir}", RAY_AUTH_MODE="disabled"
    )
    wait_for("metrics row", lambda: metrics_rows(out_dir), 300, job, slurm)
    steps = subprocess.run(
        ["squeue", "--steps", f"--jobs={job}", "--noheader", "-o", "%i %N"],
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    worker_step = dict(zip(steps[1::2], steps[0::2]))["n2"]  # the Ray worker's step on n2
    slurm.scancel("--signal=KILL", worker_step)
    killed = time.monotonic()
    state, rc = slurm.wait(job, timeout_s=150)
    took = time.monotonic() - killed
    text = out.read_text()
    assert "Ray token authentication off (RAY_AUTH_MODE=disabled)" in text
    assert (state, rc) == ("FAILED", 1), text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("rlcore.sbatch: error:")]
    assert errors and "the Ray worker step on n2 exited" in errors[0], text[-3000:]
    assert len(metrics_rows(out_dir)) < 200
    assert took < 100, f"the job took {took:.0f} s to end after its worker node was lost"


def test_term_keeps_a_checkpoint_and_a_requeue_resumes(slurm, tmp_path):
    """With the caller's own token (RAY_AUTH_TOKEN_PATH): the cluster demands it, and it lands
    neither in the run's folder nor in the job's output."""
    token = os.urandom(24).hex()
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    (secret / "token").write_text(token + "\n")
    out_dir = tmp_path / "run"
    steps = 12
    job, out, dashboard = submit(
        slurm,
        tmp_path,
        f"steps={steps}",
        "sft.warmup_steps=0",
        "resume=true",
        f"output_dir={out_dir}",
        sbatch_args=("--requeue",),
        RAY_AUTH_TOKEN_PATH=str(secret / "token"),
    )

    def status(headers: dict) -> int:
        try:
            req = urllib.request.Request(f"{dashboard}/api/cluster_status", headers=headers)
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    assert wait_for("dashboard", lambda: status({}), 300, job, slurm) == 401
    assert status({"Authorization": f"Bearer {token}"}) == 200
    assert status({"Authorization": "Bearer not-the-token"}) == 403

    wait_for("metrics row", lambda: metrics_rows(out_dir), 300, job, slurm)
    slurm.scancel("--batch", "--signal=TERM", job)
    state, rc = slurm.wait(job, timeout_s=180)
    first = out.read_text()
    assert rc == 130, first[-3000:]  # the run's own exit status for a stop by signal
    assert "TERM: asking the run to stop" in first
    done = [row["step"] for row in metrics_rows(out_dir)]
    assert done and done == list(range(1, len(done) + 1)) and len(done) < steps, done
    checkpoints = sorted(p.name for p in (out_dir / "checkpoints").glob("step_*"))
    assert checkpoints and checkpoints[-1] == f"step_{done[-1]:08d}", checkpoints

    subprocess.run(["scontrol", "requeue", job], env=slurm.env, check=True, timeout=30)
    # a requeued job is PENDING first, then runs again: wait past that
    wait_for("requeued job to start", lambda: slurm.job(job).get("JobState") in ("RUNNING", "COMPLETED", "FAILED"), 120)
    state, rc = slurm.wait(job, timeout_s=480)
    second = out.read_text()
    assert (state, rc) == ("COMPLETED", 0), second[-3000:]
    assert [row["step"] for row in metrics_rows(out_dir)] == list(range(1, steps + 1))

    leaks = [str(p) for p in [out, *out_dir.rglob("*")] if p.is_file() and token.encode() in p.read_bytes()]
    assert not leaks, f"the token was written to {leaks}"
