"""The nodes of a local cluster (`python -m launch.local_cluster`): what each declares, starting
them one `ray start` at a time, and stopping exactly their processes. The command line is in
:mod:`launch.local_cluster`."""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

BIN = Path(sys.executable).parent
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]
"""`ray` as this interpreter's module: a venv's python run by its path (no `uv run`, no activated
venv, `ray` not on PATH) or a python whose Ray is on PYTHONPATH has no `ray` script beside it."""
REPO_ROOT = Path(__file__).resolve().parent.parent
EXIT_BAD_INPUT = 2
ATTEMPTS = 5
"""Starts of one node before giving up (within `start`'s timeout): Ray gives a raylet 30 s to
register, which a loaded machine can miss, more often the more nodes already run."""


class ClusterError(Exception):
    """A problem the user can fix or a cluster that did not come up; one line, exit status 2."""


def default_state_path() -> Path:
    return Path(tempfile.gettempdir()) / f"rlcore-local-cluster-{getpass.getuser()}.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class NodeSpec:
    """What one node declares: CPUs, GPUs (a resource count, no device needed), custom resources
    and labels."""

    cpus: int
    gpus: int = 0
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Node:
    spec: NodeSpec
    pid: int
    """The `ray start --block` process; the node's daemons are in its process group."""
    node_manager_port: int
    log: str
    node_id: str = ""


@dataclasses.dataclass
class Cluster:
    temp_dir: str
    gcs_address: str
    dashboard_url: str
    nodes: list[Node]
    started_s: float = 0.0
    """Seconds from the first `ray start` to every node registered alive."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Environment variables every node's processes were started with (beyond `ray_env`'s)."""
    token_path: str = ""
    """The cluster's token file (0600, in its 0700 temp dir) when it runs with token
    authentication; empty when it runs without."""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "Cluster":
        raw = json.loads(path.read_text())
        nodes = [Node(spec=NodeSpec(**n.pop("spec")), **n) for n in raw.pop("nodes")]
        return cls(nodes=nodes, **raw)


def ray_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of every `ray start`: this venv first on PATH (jobs' `python` is looked up
    there), the repo importable, Ray kept on loopback and quiet about usage stats, then `extra`
    (e.g. `RAY_max_direct_call_object_size`; every process of the node inherits it)."""
    env = {
        **os.environ,
        **(extra or {}),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        # the nodes run from this venv already: no uv-run runtime env per worker
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        # a private loopback cluster: no token unless `start(auth=True)` passes one in `extra` (a
        # token file other Ray instances on this machine write, ~/.ray/auth_token, would otherwise
        # switch it on and lock out clients that do not send it)
        "RAY_AUTH_MODE": "disabled",
        **(extra or {}),
    }
    if "RAY_AUTH_TOKEN_PATH" in env:  # the cluster's own token file; a caller's RAY_AUTH_TOKEN would win
        env.pop("RAY_AUTH_TOKEN", None)
    return env


def _node_args(spec: NodeSpec, temp_dir: str, port: int) -> list[str]:
    args = [
        f"--num-cpus={spec.cpus}",
        f"--num-gpus={spec.gpus}",
        f"--node-manager-port={port}",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        # every node shares this machine's memory: a small store each keeps N nodes affordable
        f"--object-store-memory={200 * 2**20}",
    ]
    if spec.resources:
        args.append("--resources=" + json.dumps(spec.resources))
    if spec.labels:
        args.append("--labels=" + ",".join(f"{k}={v}" for k, v in spec.labels.items()))
    return args


def _spawn(args: list[str], log_path: Path, env: dict[str, str]) -> int:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*RAY_CLI, "start", "--block", *args],
            env=ray_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return proc.pid


def _wait_dashboard(url: str, pid: int, log: str, deadline: float) -> None:
    """Until the head's dashboard answers, its `ray start` exited (the caller retries), or the
    deadline."""
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=5).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (401 until a token is sent): the dashboard is up
        except OSError:
            time.sleep(0.5)
    raise ClusterError(f"the head was not up within the timeout: {Path(log).read_text()[-1500:]}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


NODE_LABEL = "rlcore-local-node"
"""Label every node gets: its index here, so the launcher can tell its nodes apart in Ray's list."""


def alive_nodes(dashboard_url: str, timeout_s: float, token_path: str = "") -> dict[int, str]:
    """{node index: Ray node id} of the nodes Ray's state API lists alive (asked through the
    dashboard: this process never becomes a driver of the cluster), sending the token of
    `token_path` when given (not this process's own, which may belong to another cluster)."""
    from ray.util.state.api import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    headers = {"Content-Type": "application/json"}
    if token_path:
        headers["Authorization"] = f"Bearer {Path(token_path).read_text().strip()}"
    try:
        nodes = StateApiClient(address=dashboard_url, headers=headers).list(
            StateResource.NODES, ListApiOptions(timeout=max(1, int(timeout_s))), raise_on_missing_output=False
        )
    except Exception as exc:  # the state API raises RayStateApiException, ConnectionError, ...
        raise ClusterError(f"listing the cluster's nodes failed: {str(exc).strip()[-500:]}") from None
    return {
        int(n.labels[NODE_LABEL]): n.node_id for n in nodes if n.state == "ALIVE" and NODE_LABEL in (n.labels or {})
    }


def _wait_registered(cluster: Cluster, index: int, deadline: float) -> bool:
    """Wait until node `index` is listed alive (True) or its `ray start` exited (False)."""
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            ids = alive_nodes(
                cluster.dashboard_url, min(30.0, max(1.0, deadline - time.monotonic())), cluster.token_path
            )
        except ClusterError as exc:  # the dashboard's state API starts a little after the dashboard
            last, ids = str(exc), {}
        if index in ids:
            cluster.nodes[index].node_id = ids[index]
            return True
        if not _alive(cluster.nodes[index].pid):
            return False
        time.sleep(0.5)
    raise ClusterError(
        f"node {index} did not register within the timeout ({last}): "
        f"{Path(cluster.nodes[index].log).read_text()[-800:]}"
    )


def start(
    specs: Sequence[NodeSpec], timeout_s: float = 180.0, env: Optional[dict[str, str]] = None, auth: bool = False
) -> Cluster:
    """Start a head (specs[0]) and one worker node per further spec, one after the other (a
    loaded machine times out raylets started all at once: Ray gives each 30 s to register), each
    retried (ATTEMPTS in all) when its `ray start` gives up; return when every node is registered alive. Stops
    whatever it started when anything fails. `auth`: Ray's token authentication, with a token of
    the cluster's own in `Cluster.token_path` (clients set RAY_AUTH_MODE=token and
    RAY_AUTH_TOKEN_PATH to it); without, the nodes run with RAY_AUTH_MODE=disabled."""
    if not specs:
        raise ClusterError("--nodes must be at least 1")
    temp_dir = tempfile.mkdtemp(prefix="rlc", dir="/tmp")  # AF_UNIX paths inside must stay short
    gcs_port, dash_port = free_port(), free_port()
    cluster = Cluster(
        temp_dir=temp_dir,
        gcs_address=f"127.0.0.1:{gcs_port}",
        dashboard_url=f"http://127.0.0.1:{dash_port}",
        nodes=[],
        env=dict(env or {}),
    )
    if auth:
        # mkdtemp's folder is 0700; the file is the owner's only as well
        cluster.token_path = os.path.join(temp_dir, "auth_token")
        fd = os.open(cluster.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        cluster.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=cluster.token_path)
    began = time.monotonic()
    deadline = began + timeout_s
    try:
        for spec in specs:
            _start_node(cluster, spec, deadline)
    except BaseException:
        stop(cluster)
        raise
    cluster.started_s = time.monotonic() - began
    return cluster


def _start_node(cluster: Cluster, spec: NodeSpec, deadline: float) -> Node:
    """Start the cluster's next node (the head when it has none) and wait until Ray lists it alive,
    retrying its `ray start` up to ATTEMPTS times. Raises ClusterError past the deadline."""
    i = len(cluster.nodes)
    spec = dataclasses.replace(spec, labels={**spec.labels, NODE_LABEL: str(i)})
    gcs_port = cluster.gcs_address.rsplit(":", 1)[1]
    dash_port = cluster.dashboard_url.rsplit(":", 1)[1]
    for attempt in range(1, ATTEMPTS + 1):
        port = free_port()
        log = Path(cluster.temp_dir) / f"node-{i}-{attempt}.log"
        role = (
            ["--head", f"--port={gcs_port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}"]
            if i == 0
            else [f"--address={cluster.gcs_address}"]
        )
        # a temp dir per node: each node's runtime-env agent unpacks and deletes job working
        # dirs under its own, as on separate machines (a shared one pulls a driver's code
        # from under it when another node sets up the same job's env)
        node_dir = cluster.temp_dir if i == 0 else os.path.join(cluster.temp_dir, f"n{i}")
        os.makedirs(node_dir, exist_ok=True)
        args = role + [f"--dashboard-agent-listen-port={free_port()}"] + _node_args(spec, node_dir, port)
        node = Node(spec, _spawn(args, log, cluster.env), port, str(log))
        cluster.nodes[i:] = [node]
        if i == 0:
            _wait_dashboard(cluster.dashboard_url, node.pid, str(log), deadline)
        if _wait_registered(cluster, i, deadline):
            return node
        try:  # what the attempt left running (its `ray start` gave up, its daemons may not)
            os.killpg(node.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    raise ClusterError(f"`ray start` of node {i} exited {ATTEMPTS} times: {log.read_text()[-1500:]}")


def add_node(cluster: Cluster, spec: NodeSpec, timeout_s: float = 180.0) -> Node:
    """Join one more worker node to a running cluster (as an operator replaces a dead machine);
    it is numbered after the existing ones, dead ones included, and `stop` ends it with the rest."""
    return _start_node(cluster, spec, time.monotonic() + timeout_s)


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def node_tree(node: Node) -> list[int]:
    """Every process of a node: its `ray start --block` process and all its descendants."""
    out, todo = [], [node.pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(child_pids(pid))
    return out


def raylet_pid(node: Node) -> Optional[int]:
    """The pid of the node's raylet (a child of its `ray start --block` process), None when gone."""
    for child in child_pids(node.pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == "raylet":
                return child
        except OSError:
            continue
    return None


def _under(temp_dir: str) -> list[int]:
    """Processes of this cluster: its daemons name the temp dir on their command line; drivers and
    workers of its jobs run in working dirs unpacked inside it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if temp_dir in cmdline or cwd.startswith(temp_dir):
            pids.append(int(entry.name))
    return pids


def stop(cluster: Cluster) -> int:
    """Kill every node's process group, then every process left under the cluster's temp dir;
    remove the temp dir. Returns how many processes were signalled. Throwaway cluster: nothing is
    drained."""
    killed = 0
    for node in reversed(cluster.nodes):
        try:
            os.killpg(node.pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    for _ in range(3):  # a worker may be forked while we sweep
        for pid in _under(cluster.temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.3)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    return killed
