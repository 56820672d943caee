"""The Ray session of a run: where it connects (`cluster.address`, RAY_ADDRESS, or a local
cluster this process starts), the settings a local cluster gets before `ray` is imported, the
start itself (retried once), and the live nodes a placement is checked against."""

from __future__ import annotations

import logging
import os
import secrets
import threading
from pathlib import Path

from actors.logs import route_cluster_errors
from rlcore.config import ClusterConfig, RunConfig
from rlcore.plan.node_fit import NodeCapacity, capacity_gone
from rlcore.plan.overrides import one_line
from rlcore.report.console import quiet_ray_environment

REPO = Path(__file__).resolve().parent.parent


def local_ray_environment() -> None:
    """Settings for a single-node Ray started by this process; Ray reads them at import."""
    # the cluster shares this interpreter and checkout: keep Ray's `uv run` integration from
    # packaging the working dir and building a new venv for every worker
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # single-node mode: Ray, gloo and the weight-sync store all stay on the loopback address
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # every actor has a runtime_env of its own (actors.logs.runtime_env), so the idle workers Ray
    # prestarts for the driver's job never host one: they only take CPU while the run starts
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    quiet_ray_environment()  # RAY_AUTH_MODE=token unless the user set it: Ray's default, made explicit
    private_default_token()


def private_default_token() -> None:
    """With token authentication on and no token given (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH), Ray's
    `ray.init` makes ~/.ray/auth_token with the umask's mode, often readable by every user of the
    machine; make it first, readable by its owner only. An existing file is left as it is."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:  # a read-only home: Ray reports what it needs at ray.init
        logging.getLogger("rlcore").warning("could not create %s (%s); Ray will try itself", path, exc)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def ray_address(cluster: ClusterConfig) -> str | None:
    """The Ray cluster to join: `cluster.address`, else RAY_ADDRESS; None starts a local one."""
    return cluster.address or os.environ.get("RAY_ADDRESS") or None


class RayStartError(RuntimeError):
    """Ray could not be started or reached; the message says what to try."""


def start_ray(cfg: RunConfig) -> None:
    """`ray.init` for this run: connect to `cluster.address` / RAY_ADDRESS, or start a local
    cluster. A local start that fails (e.g. "the current node timed out during startup" on a
    loaded machine) is retried once after a clean shutdown; connecting is not retried (the
    address is wrong or the cluster is down). Raises RayStartError with one line."""
    import ray

    address = ray_address(cfg.cluster)
    kwargs = dict(
        address=address,
        num_cpus=None if address else cfg.cluster.num_cpus,
        num_gpus=None if address else cfg.cluster.num_gpus,
        include_dashboard=False,
        # actors write to OUTPUT_DIR/logs/ (actors.logs); their errors come back as
        # exceptions of the remote calls, printed as one line that names the log file
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        }
        if address is None
        else None,
    )
    attempts = 1 if address else 2
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            route_cluster_errors(cfg.output_dir)
            return
        except Exception as exc:  # Ray raises plain Exception, RuntimeError, ConnectionError here
            why = one_line(exc)
            ray.shutdown()  # leaves nothing of the failed start behind
            if attempt < attempts:
                logging.getLogger("rlcore").warning("Ray failed to start (%s); retrying once", why)
                continue
            if address:
                raise RayStartError(
                    f"could not connect to the Ray cluster at {address} ({why}); check that it "
                    "is running (`ray status`) and that cluster.address / RAY_ADDRESS is right"
                ) from exc
            raise RayStartError(
                f"the local Ray cluster did not start, twice ({why}); the machine may be "
                "overloaded: retry, lower cluster.num_cpus, or start Ray yourself "
                "(`ray start --head`) and set RAY_ADDRESS"
            ) from exc


def live_nodes() -> list[NodeCapacity]:
    """The alive nodes of the connected Ray cluster: total CPUs, GPUs and labels of each."""
    import ray

    return [
        NodeCapacity(
            n["NodeID"], n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0), dict(n.get("Labels") or {})
        )
        for n in ray.nodes()
        if n["Alive"]
    ]


class CapacityProbe:
    """Why no alive node can host `bundles` (`rlcore.plan.node_fit.capacity_gone`), asked
    without ever blocking the caller: each call starts a check in a thread of its own unless one
    is running (the GCS may be slow or frozen) and returns the latest finished answer (None until
    one finished, or when the cluster could not be asked)."""

    def __init__(self, cluster: ClusterConfig, bundles: list):
        self.cluster, self.bundles = cluster, bundles
        self._latest: str | None = None
        self._thread: threading.Thread | None = None

    def __call__(self) -> str | None:
        if self.bundles and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._check, name="rlcore-capacity", daemon=True)
            self._thread.start()
        return self._latest

    def _check(self) -> None:
        try:
            self._latest = capacity_gone(self.cluster, self.bundles, live_nodes())
        except Exception:  # the GCS is away for a moment: the next call asks again
            pass
