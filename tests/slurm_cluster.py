"""A real Slurm cluster of two nodes on this one machine, for tests of launch/slurm/rlcore.sbatch.

`munged`, `slurmctld` and two `slurmd -N n1` / `-N n2` run from a temp dir of their own (key,
sockets, spool, state, logs, pid files, free ports), so nothing of a system-wide Slurm or munge is
used or touched; `stop` ends exactly the processes `start` started. Both nodes are this machine
(NodeAddr=127.0.0.1, one CPU each), which is what `slurmd -N` is for. Needs Debian's `slurm-wlm`
and `munge` (.ci/run installs them) and root: slurmd launches job steps as the submitting user.

    cluster = SlurmCluster.start(tmp_dir)
    job = cluster.sbatch(["--nodes=2", "script.sbatch", "arg"], env)
    state, rc = cluster.wait(job, timeout_s=300)
    cluster.stop()
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "sinfo", "scontrol", "scancel", "squeue", "srun")
NODES = ("n1", "n2")
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def missing() -> Optional[str]:
    """Why a cluster cannot start here (one line), None when it can."""
    search = f"/usr/sbin:/usr/bin:/sbin:{os.environ.get('PATH', '')}"
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=search) is None]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} not found): apt-get install slurm-wlm munge (.ci/run does)"
    if os.geteuid() != 0:
        return "a Slurm cluster of this machine needs root (slurmd starts job steps as the submitting user)"
    return None


def _which(name: str) -> str:
    path = shutil.which(name, path=f"/usr/sbin:/usr/bin:/sbin:{os.environ.get('PATH', '')}")
    assert path, name
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(root: Path, ports: dict[str, int]) -> str:
    user = "root"
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} CPUs=1 RealMemory=2000 State=UNKNOWN"
        for n in NODES
    )
    return f"""\
ClusterName=rlcoretest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports["ctld"]}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it starts again (120 s by default)
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# a requeued job becomes eligible after cred_expire; the scheduler's next pass then starts it
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# quick node checks and short waits: a test cluster, not a production one
SlurmdTimeout=60
KillWait=30
MinJobAge=600
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    """Environment for Slurm's client commands: SLURM_CONF names this cluster's slurm.conf."""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    """The daemons `start` started, by name (munged, slurmctld, slurmd-n1, slurmd-n2)."""

    @classmethod
    def start(cls, root: Path, timeout_s: float = 60.0) -> "SlurmCluster":
        """Write the config, start munged, slurmctld and the two slurmd; return when `sinfo`
        lists both nodes idle. Stops what it started when anything fails."""
        root.mkdir(parents=True, exist_ok=True)
        for sub in ("munge", "state", "log", "spool/n1", "spool/n2"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "munge", 0o700)
        ports = {"ctld": _free_port(), **{n: _free_port() for n in NODES}}
        conf = root / "slurm.conf"
        conf.write_text(_conf(root, ports))
        env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"/usr/bin:/usr/sbin:{os.environ.get('PATH', '')}"}
        cluster = cls(root, env)
        try:
            cluster._start_munge()
            cluster._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(conf)])
            for n in NODES:
                cluster._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n, "-f", str(conf)])
            cluster._wait_idle(timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        munge = self.root / "munge"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={munge}/munge.socket",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
        )
        deadline = time.monotonic() + 20
        while not (munge / "munge.socket").exists():
            self._check_alive("munged")
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not create its socket within 20 s")
            time.sleep(0.1)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        proc = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        self.procs[name] = proc

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")

    def log_tail(self, name: str, chars: int = 1500) -> str:
        texts = []
        for path in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if path.exists():
                texts.append(path.read_text(errors="replace")[-chars:])
        return "\n".join(texts)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for name in self.procs:
                self._check_alive(name)
            proc = subprocess.run(
                ["sinfo", "--noheader", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True, timeout=30
            )
            last = (proc.stdout + proc.stderr).strip()
            states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the Slurm nodes were not idle within {timeout_s:.0f} s (sinfo: {last!r}); "
            f"slurmctld: {self.log_tail('slurmctld', 800)}"
        )

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        """Submit; return the job id. `env` is the submitter's environment (SLURM_CONF added)."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**env, "SLURM_CONF": self.env["SLURM_CONF"]},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields of one job."""
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0, proc.stderr
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", proc.stdout))

    def wait(self, job_id: str, timeout_s: float, until: Optional[set[str]] = None) -> tuple[str, int]:
        """Wait until the job reaches a final state (or one of `until`); return (state, exit code)."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            state = fields.get("JobState", "")
            if state in (until or FINAL_STATES):
                return state, int(fields.get("ExitCode", "0:0").split(":")[0])
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f} s")
            time.sleep(1)

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args], env=self.env, check=True, timeout=30)

    def _ours(self) -> list[int]:
        """Every process of this cluster: its daemons, slurmstepd and the jobs' processes (Ray's
        included) all carry this cluster's SLURM_CONF in their environment; nothing else does."""
        mark = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if mark in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return pids

    def stop(self) -> None:
        """End exactly what `start` started and what ran on it: cancel every job (their Ray
        included), stop the daemons (slurmd first), then kill whatever of this cluster is left
        (a slurmstepd outlives its slurmd)."""
        if self.procs:
            subprocess.run(
                ["scancel", "--full", f"--user={os.getuid()}"], env=self.env, capture_output=True, timeout=30
            )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                queue = subprocess.run(
                    ["squeue", "--noheader"], env=self.env, capture_output=True, text=True, timeout=30
                ).stdout.strip()
                if not queue:
                    break
                time.sleep(1)
        for name in sorted(self.procs, key=lambda n: ["slurmd", "slurmctld", "munged"].index(n.split("-")[0])):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for _ in range(3):  # a process may be forked while we sweep
            for pid in self._ours():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
