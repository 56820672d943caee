"""launch/slurm/rlcore.sbatch: the dry run (command by command, with a fake allocation: SLURM_*
variables), and the real thing on a real two-node Slurm cluster of this machine
(tests/slurm_cluster.py): the README's line trains on both nodes, the job's exit status is the
run's, a lost node fails the job at once, a TERM keeps a checkpoint and a requeue resumes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
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
    assert len(commands) == 5, commands
    (head, head_bg), *workers, (wait, _), (run, run_bg) = commands

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

    # The wait asks Ray how many nodes are alive, bounded by a timeout.
    assert wait[:3] == ["timeout", "60", py] and wait[-1] == "gpu01:6379"

    # The run: exactly the arguments given, quoting preserved, with the cluster's address and
    # token authentication on (the token itself is never printed).
    assert not run_bg
    assert run == [
        "env", "RAY_ADDRESS=gpu01:6379", "RAY_AUTH_MODE=token", py, "-m", "rlcore.run",
        "+recipe=qwen30b_swe", "steps=3", "logger.run_name=it's a test",
    ]


def test_dry_run_by_environment_variable_matches_the_flag():
    flag = run_script(allocation(), "--dry-run", "steps=3")
    env = run_script(allocation(RLCORE_DRY_RUN="1"), "steps=3")
    assert flag.returncode == env.returncode == 0
    assert flag.stdout == env.stdout


def test_single_node_starts_no_workers():
    commands = dry_run(SLURM_JOB_NODELIST="solo")
    argvs = [argv for argv, _ in commands]
    assert len(argvs) == 3
    assert option(argvs[0], "--nodelist") == "solo"
    assert not any("--address=solo:6379" in a for a in argvs)


def test_overrides_of_ports_python_and_ray_arguments():
    commands = dry_run(
        "steps=1", RLCORE_RAY_PORT="7000", RLCORE_PYTHON="/opt/env/bin/python", RLCORE_HEAD_IP="10.1.2.3",
        RLCORE_RAY_HEAD_ARGS="--dashboard-port=9000 --ray-client-server-port=9001",
        RLCORE_RAY_WORKER_ARGS="--object-store-memory=1000000000", RAY_TMPDIR="/scratch", SLURM_JOB_ID="77",
    )
    (head, _), (w1, _), (w2, _), _, (run, _) = commands
    assert "/opt/env/bin/ray" in head and "--node-ip-address=10.1.2.3" in head and "--port=7000" in head
    assert head[-3:] == ["--temp-dir=/scratch/rlc-77-0", "--dashboard-port=9000", "--ray-client-server-port=9001"]
    assert "--address=10.1.2.3:7000" in w1 and w2[-2:] == ["--temp-dir=/scratch/rlc-77-2", "--object-store-memory=1000000000"]
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
    env = allocation("no-such-host-rlcore-test", SLURM_CPUS_PER_TASK="1", RLCORE_PYTHON=str(REPO / ".venv" / "bin" / "python"))
    proc = run_script(env, "steps=1")
    assert proc.returncode == 2
    assert "cannot resolve the head node 'no-such-host-rlcore-test'" in proc.stderr and "set RLCORE_HEAD_IP" in proc.stderr


@pytest.mark.skipif(
    shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    is None,
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
    (head, _), (workers, _), _, (run, _) = printed_commands(proc.stdout)
    assert option(head, "--nodelist") == "g1" and "--num-cpus=8" in head and "--num-gpus=2" in head
    assert option(workers, "--nodelist") == "g2" and "--num-gpus=2" in workers
    assert run[-1] == "steps=1"


def test_dry_run_without_slurm_or_flags_uses_the_sbatch_shape():
    proc = run_script(no_slurm(), "--dry-run", "+recipe=qwen30b_swe")
    assert proc.returncode == 0, proc.stderr
    (head, _), *workers, _, _ = printed_commands(proc.stdout)
    assert "--num-gpus=8" in head and "--num-cpus=64" in head  # not --num-gpus=0
    assert [option(w, "--nodelist") for w, _ in workers] == ["node2", "node3", "node4"]


def test_node_flags_are_refused_outside_a_dry_run():
    proc = run_script(no_slurm(), "--nodelist=g1", "steps=1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("rlcore.sbatch: error: --nodelist, --cpus-per-node and --gpus-per-node describe "
                                   "nodes for --dry-run only; a real run uses its allocation")
