"""A Ray cluster of several nodes on this one machine, started the way a user starts one on many:
one ``ray start --head`` and one ``ray start --address=HEAD`` per worker node, each node with its
own CPUs, GPUs (declared as resources: placement checks need no real GPU), custom resources and
labels.

    python -m launch.local_cluster start --nodes 3 --cpus 1,1,1 \\
        --labels 'rlcore-group=driver;rlcore-group=trainer;rlcore-group=rollout'
    python -m launch.local_cluster status
    python -m launch.local_cluster stop

``start`` prints the address to pass (``cluster.address=127.0.0.1:PORT`` for ``rlcore.run``, the
dashboard URL for ``launch.submit``) and one line per node (its Ray node id, resources, labels,
raylet pid); the cluster's state is written to ``--state`` (default
``/tmp/rlcore-local-cluster-$USER.json``). ``stop`` ends exactly the processes of that cluster (the
``ray start --block`` process group of each node, then every process under the cluster's own temp
dir), never other Ray instances on the machine, which is what ``ray stop`` would do.

Ray refuses several nodes on one host unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` (the flag is
read on every platform); the nodes run without token authentication (``RAY_AUTH_MODE=disabled``):
a throwaway cluster of this machine's, not one to expose. ``--auth token`` runs them with Ray's
token authentication instead, as Ray does by default, with a token of the cluster's own in a file
only its owner reads (``start`` prints it: clients set ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN_PATH`` to that file); ``stop`` deletes it with the cluster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from launch.cluster_nodes import (  # noqa: F401  (re-exported: tests and benchmarks use the module's API)
    ATTEMPTS,
    BIN,
    EXIT_BAD_INPUT,
    NODE_LABEL,
    RAY_CLI,
    REPO_ROOT,
    Cluster,
    ClusterError,
    Node,
    NodeSpec,
    _under,
    alive_nodes,
    default_state_path,
    free_port,
    ray_env,
    raylet_pid,
    start,
    stop,
)


def parse_specs(nodes: int, cpus: str, gpus: str, resources: str, labels: str) -> list[NodeSpec]:
    """One NodeSpec per node from the command line's lists: `--cpus 1,2,2` (one value, or one per
    node), `--gpus` likewise, `--resources` and `--labels` as `;`-separated per-node entries of
    `name=amount,...` / `key=value,...`. Raises ClusterError naming the flag."""

    def per_node(flag: str, text: str, parse) -> list:
        items = [s.strip() for s in text.split(";" if flag in ("--resources", "--labels") else ",")]
        if len(items) == 1:
            items = items * nodes
        if len(items) != nodes:
            raise ClusterError(f"{flag} {text!r}: give one value or {nodes} (one per node), got {len(items)}")
        try:
            return [parse(s) for s in items]
        except ValueError as exc:
            raise ClusterError(f"{flag} {text!r}: {exc}") from None

    def count(s: str) -> int:
        if not s.isdigit():
            raise ValueError(f"{s!r} is not a whole number >= 0")
        return int(s)

    def pairs(s: str, value) -> dict:
        out = {}
        for item in filter(None, (p.strip() for p in s.split(","))):
            key, sep, v = item.partition("=")
            if not sep or not key:
                raise ValueError(f"{item!r} is not KEY=VALUE")
            out[key] = value(v)
        return out

    if nodes < 1:
        raise ClusterError(f"--nodes must be at least 1, got {nodes}")
    c = per_node("--cpus", cpus, count)
    g = per_node("--gpus", gpus, count)
    r = per_node("--resources", resources, lambda s: pairs(s, float))
    lab = per_node("--labels", labels, lambda s: pairs(s, str))
    return [NodeSpec(*fields) for fields in zip(c, g, r, lab)]


def describe(cluster: Cluster) -> str:
    lines = [
        f"rlcore local cluster: {len(cluster.nodes)} node(s), up in {cluster.started_s:.1f}s",
        f"  rlcore.run:    cluster.address={cluster.gcs_address}",
        f"  launch.submit: --address {cluster.dashboard_url}",
    ]
    if cluster.token_path:
        lines.append(f"  token auth:    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={cluster.token_path}")
    for i, n in enumerate(cluster.nodes):
        s = n.spec
        extra = "".join(f", {k}: {v:g}" for k, v in s.resources.items())
        labels = ",".join(f"{k}={v}" for k, v in s.labels.items()) or "-"
        lines.append(
            f"  node {i} {'head  ' if i == 0 else 'worker'} {n.node_id[:12]} {{CPU: {s.cpus}, GPU: {s.gpus}"
            f"{extra}}} labels {labels} raylet pid {raylet_pid(n)}"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.local_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--state",
        type=Path,
        default=default_state_path(),
        help="file the running cluster is recorded in (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("start", help="start a head and worker nodes; print the address")
    up.add_argument("--nodes", type=int, default=3, help="nodes in all, the head included (default: %(default)s)")
    up.add_argument("--cpus", default="1", help="CPUs per node: one value or one per node, e.g. 1,2,2")
    up.add_argument("--gpus", default="0", help="GPUs each node declares (resources only), e.g. 0,8,8")
    up.add_argument("--resources", default="", help="custom resources per node, ';' between nodes: 'a=1;;b=2'")
    up.add_argument(
        "--labels",
        default="",
        help="labels per node, ';' between nodes: 'rlcore-group=driver;rlcore-group=trainer;rlcore-group=rollout'",
    )
    up.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable of every node's processes (repeatable)",
    )
    up.add_argument("--timeout", type=float, default=180.0, help="seconds for every node to come up")
    up.add_argument(
        "--auth",
        choices=("disabled", "token"),
        default="disabled",
        help="Ray's token authentication: a token of the cluster's own (token), or none "
        "(disabled, the default: a throwaway cluster of this machine)",
    )
    sub.add_parser("status", help="print the running cluster's nodes")
    sub.add_parser("stop", help="stop the cluster's processes (only those)")
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            if args.state.exists():
                raise ClusterError(f"{args.state} records a running cluster; `stop` it first or pass --state")
            env = {}
            for item in args.env:
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise ClusterError(f"--env {item!r} is not KEY=VALUE")
                env[key] = value
            cluster = start(
                parse_specs(args.nodes, args.cpus, args.gpus, args.resources, args.labels),
                args.timeout,
                env,
                auth=args.auth == "token",
            )
            cluster.save(args.state)
            print(describe(cluster), flush=True)
            return 0
        if not args.state.exists():
            raise ClusterError(f"no cluster recorded in {args.state}")
        cluster = Cluster.load(args.state)
        if args.command == "status":
            print(describe(cluster))
            return 0
        stop(cluster)
        args.state.unlink()
        print(f"rlcore local cluster stopped ({len(cluster.nodes)} node(s))")
        return 0
    except ClusterError as exc:
        print(f"python -m launch.local_cluster: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
