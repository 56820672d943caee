"""launch/slurm/rlcore.sbatch: the Ray cluster it brings up, the run, the teardown.

Slurm is not installed here. The dry run is checked command by command with a fake allocation
(SLURM_* variables), and the real path runs against stand-ins for srun, ray and python that
record what they were asked to do, so the orchestration (order, waiting, exit status, teardown)
is exercised without a cluster.
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


def test_dry_run_prints_head_workers_wait_run_and_teardown():
    py = str(REPO / ".venv" / "bin" / "python")
    ray = str(REPO / ".venv" / "bin" / "ray")
    commands = dry_run("+recipe=qwen30b_swe", "steps=3", "logger.run_name=it's a test")
    assert len(commands) == 5, commands
    (head, head_bg), (workers, workers_bg), (wait, _), (run, run_bg), (stop, _) = commands

    assert head_bg and head[0] == "srun"
    assert option(head, "--nodes") == "1" and option(head, "--nodelist") == "gpu01"
    ray_args = head[head.index(ray) :]
    assert ray_args[:4] == [ray, "start", "--head", "--block"]
    assert "--port=6379" in ray_args and "--num-cpus=16" in ray_args and "--num-gpus=8" in ray_args

    assert workers_bg and workers[0] == "srun"
    assert option(workers, "--nodes") == "2" and option(workers, "--ntasks") == "2"
    assert option(workers, "--nodelist") == "gpu02,gpu10"
    ray_args = workers[workers.index(ray) :]
    assert ray_args[:3] == [ray, "start", "--block"]
    assert "--address=gpu01:6379" in ray_args and "--num-gpus=8" in ray_args

    # The wait asks Ray how many nodes are alive, bounded by a timeout.
    assert wait[:3] == ["timeout", "60", py] and wait[-1] == "gpu01:6379"

    # The run: exactly the arguments given, quoting preserved, with the cluster's address.
    assert not run_bg
    assert run == [
        "env", "RAY_ADDRESS=gpu01:6379", py, "-m", "rlcore.run",
        "+recipe=qwen30b_swe", "steps=3", "logger.run_name=it's a test",
    ]

    # Teardown stops Ray on every node, under a timeout, even though the run "succeeded".
    assert stop[:2] == ["timeout", "120"] and "srun" in stop and "--overlap" in stop
    assert option(stop, "--nodelist") == "gpu01,gpu02,gpu10"
    assert stop[-2:] == ["stop", "--force"]


def test_dry_run_by_environment_variable_matches_the_flag():
    flag = run_script(allocation(), "--dry-run", "steps=3")
    env = run_script(allocation(RLCORE_DRY_RUN="1"), "steps=3")
    assert flag.returncode == env.returncode == 0
    assert flag.stdout == env.stdout


def test_single_node_starts_no_workers():
    commands = dry_run(SLURM_JOB_NODELIST="solo")
    argvs = [argv for argv, _ in commands]
    assert len(argvs) == 4
    assert option(argvs[0], "--nodelist") == "solo"
    assert not any("--address=solo:6379" in a for a in argvs)


def test_overrides_of_ports_and_python():
    commands = dry_run(
        "steps=1", RLCORE_RAY_PORT="7000", RLCORE_PYTHON="/opt/env/bin/python", RLCORE_HEAD_IP="10.1.2.3"
    )
    (head, _), (workers, _), _, (run, _), (stop, _) = commands
    assert "/opt/env/bin/ray" in head and "--node-ip-address=10.1.2.3" in head and "--port=7000" in head
    assert "--address=10.1.2.3:7000" in workers
    assert run[:3] == ["env", "RAY_ADDRESS=10.1.2.3:7000", "/opt/env/bin/python"]
    assert "/opt/env/bin/ray" in stop


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
    stop = commands[-1][0]
    assert option(stop, "--nodelist") == ",".join(expected)
    assert option(commands[0][0], "--nodelist") == expected[0]


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


@pytest.mark.skipif(
    shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    is None,
    reason="shellcheck not installed (it comes with the dev group: uv sync)",
)
def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


# --- the real path, against recording stand-ins --------------------------------------------

FAKE_SRUN = r"""#!/bin/bash
# Runs the command once per task on this machine, forwarding TERM like srun does.
echo "srun $*" >>"$FAKE_LOG"
ntasks=1
while [[ $1 == -* ]]; do
    [[ $1 == --ntasks=* ]] && ntasks=${1#--ntasks=}
    shift
done
pids=()
for ((i = 0; i < ntasks; i++)); do "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
wait "${pids[@]}"
"""

FAKE_RAY = r"""#!/bin/bash
case "$1 $2" in
    "start --head")
        if [[ -n ${FAKE_HEAD_FAILS:-} ]]; then echo "ray head-failed" >>"$FAKE_LOG"; exit 1; fi
        echo "ray head $*" >>"$FAKE_LOG" ;;
    "start --block")
        echo "ray worker $*" >>"$FAKE_LOG" ;;
    "stop --force")
        echo "ray stop" >>"$FAKE_LOG"; exit 0 ;;
esac
sleep 300 & sleeper=$!
trap 'echo "ray exit" >>"$FAKE_LOG"; kill $sleeper; exit 0' TERM
wait $sleeper
"""

FAKE_PYTHON = r"""#!/bin/bash
if [[ $1 == -c ]]; then
    # Alive nodes: the ray starts recorded so far.
    grep -c '^ray \(head\|worker\) ' "$FAKE_LOG" || true
elif [[ "$1 $2" == "-m rlcore.run" ]]; then
    shift 2
    echo "run RAY_ADDRESS=$RAY_ADDRESS $*" >>"$FAKE_LOG"
    exit "${FAKE_RC:-0}"
fi
"""


@pytest.fixture
def fakes(tmp_path):
    bindir, venv = tmp_path / "bin", tmp_path / "venv" / "bin"
    bindir.mkdir()
    venv.mkdir(parents=True)
    for path, text in ((bindir / "srun", FAKE_SRUN), (venv / "ray", FAKE_RAY), (venv / "python", FAKE_PYTHON)):
        path.write_text(textwrap.dedent(text))
        path.chmod(0o755)
    log = tmp_path / "log"
    log.touch()
    env = allocation(
        PATH=f"{bindir}:/usr/bin:/bin",
        RLCORE_PYTHON=str(venv / "python"),
        RLCORE_HEAD_IP="127.0.0.1",
        FAKE_LOG=str(log),
    )
    return env, log


def run_real(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    # A process group of its own, so whatever a broken script leaves behind can be ended here.
    proc = subprocess.Popen(
        [BASH, str(SCRIPT), *args], env=env, cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - start


def test_real_run_brings_up_runs_tears_down_and_returns_the_run_status(fakes):
    env, log = fakes
    proc, took = run_real({**env, "FAKE_RC": "7"}, "+recipe=r", "steps=2")
    assert proc.returncode == 7, proc.stderr
    lines = log.read_text().splitlines()
    heads = [line for line in lines if line.startswith("ray head")]
    workers = [line for line in lines if line.startswith("ray worker")]
    assert len(heads) == 1 and "--node-ip-address=127.0.0.1" in heads[0]
    assert len(workers) == 2 and all("--address=127.0.0.1:6379" in w for w in workers)
    run_at = lines.index("run RAY_ADDRESS=127.0.0.1:6379 +recipe=r steps=2")
    assert run_at > max(lines.index(line) for line in heads + workers), "ran before the cluster was up"
    stop_at = lines.index("ray stop")
    assert stop_at > run_at
    # The teardown's srun runs `ray stop` once per node, then every ray-start step is ended.
    assert lines.count("ray stop") == 3
    assert lines.count("ray exit") == 3, lines
    assert took < 30


def test_real_run_fails_fast_when_the_head_dies(fakes):
    env, log = fakes
    proc, took = run_real({**env, "FAKE_HEAD_FAILS": "1", "RLCORE_RAY_WAIT_S": "60"}, "steps=1")
    assert proc.returncode == 2
    assert "the Ray head step on gpu01 exited" in proc.stderr
    lines = log.read_text().splitlines()
    assert not any(line.startswith("run ") for line in lines), "the run started without a head"
    assert "ray stop" in lines, "no teardown after the failure"
    assert took < 30


# --- a dry run without Slurm (nodes described by flags) -------------------------------------


def no_slurm() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}


def test_dry_run_without_slurm_describes_the_nodes_with_flags():
    proc = run_script(no_slurm(), "--dry-run", "--nodelist=g[1-2]", "--cpus-per-node=8", "--gpus-per-node=2", "steps=1")
    assert proc.returncode == 0, proc.stderr
    (head, _), (workers, _), _, (run, _), _ = printed_commands(proc.stdout)
    assert option(head, "--nodelist") == "g1" and "--num-cpus=8" in head and "--num-gpus=2" in head
    assert option(workers, "--nodelist") == "g2" and "--num-gpus=2" in workers
    assert run[-1] == "steps=1"


def test_dry_run_without_slurm_or_flags_uses_the_sbatch_shape():
    proc = run_script(no_slurm(), "--dry-run", "+recipe=qwen30b_swe")
    assert proc.returncode == 0, proc.stderr
    (head, _), (workers, _), *_ = printed_commands(proc.stdout)
    assert "--num-gpus=8" in head and "--num-cpus=64" in head  # not --num-gpus=0
    assert option(workers, "--nodelist") == "node2,node3,node4"


def test_node_flags_are_refused_outside_a_dry_run():
    proc = run_script(no_slurm(), "--nodelist=g1", "steps=1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("rlcore.sbatch: error: --nodelist, --cpus-per-node and --gpus-per-node describe "
                                   "nodes for --dry-run only; a real run uses its allocation")
