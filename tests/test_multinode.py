"""Many nodes on one machine (`launch.local_cluster`: one `ray start` per node, each with its own
CPUs, declared GPUs and labels): the default job with its trainer and rollout groups on different
nodes and its samples crossing raylets, the qwen30b_swe layout placed by Ray's own scheduler on 4
nodes that declare 8 GPUs each, and a rollout node whose raylet is killed mid-run.

Every cluster a test starts is stopped in the fixture's finalizer (its processes only: never
`ray stop`, which would end other Ray instances on the machine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import local_cluster as lc

REPO = Path(__file__).resolve().parent.parent
LABELS = ["cluster.trainer_node_labels.rlcore-group=trainer", "cluster.rollout_node_labels.rlcore-group=rollout"]


@pytest.fixture(scope="module")
def role_cluster():
    """Three nodes of one CPU each, labelled driver (the head), trainer and rollout. Token data
    under 100 KiB is returned inline to its owner (the driver) and never enters an object store;
    the tiny default model's groups are that small, a real model's are not: the cluster lowers
    the bound so the default job's samples take the path a real run's take."""
    cluster = lc.start(roles("driver", "trainer", "rollout"), timeout_s=400,
                       env={"RAY_max_direct_call_object_size": "1024"})
    try:
        yield cluster
    finally:
        lc.stop(cluster)


@pytest.fixture
def start_cluster():
    """start_cluster(specs, env) -> a running `launch.local_cluster.Cluster`, stopped at teardown."""
    started: list[lc.Cluster] = []

    def start(specs: list[lc.NodeSpec], env: dict | None = None) -> lc.Cluster:
        cluster = lc.start(specs, timeout_s=400, env=env)  # stops what it started if it fails
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        lc.stop(cluster)
        assert not lc._under(cluster.temp_dir), "a process of the cluster outlived stop()"


def roles(*groups: str, cpus: int = 1) -> list[lc.NodeSpec]:
    return [lc.NodeSpec(cpus=cpus, labels={"rlcore-group": g}) for g in groups]


def rlcore_run(cluster: lc.Cluster, out: Path, *overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlcore.run", f"cluster.address={cluster.gcs_address}",
                           f"output_dir={out}", *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=lc.ray_env())


def assert_every_sample_counted(rows: list[dict]) -> None:
    for r in rows:
        assert r["samples_generated"] == (r["samples_trained"] + r["samples_dropped_stale"] + r["samples_failed"]
                                          + r["samples_in_flight"] + r["samples_filtered"]), r


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_default_job_trains_across_nodes_and_its_samples_cross_raylets(role_cluster, tmp_path):
    cluster = role_cluster
    head, trainer, rollout = (n.node_id[:8] for n in cluster.nodes)
    proc = rlcore_run(cluster, tmp_path / "run", "steps=3", *LABELS)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"placement: trainer group's 1 bundle(s) on node(s) {trainer}" in log
    assert f"placement: rollout group's 1 bundle(s) on node(s) {rollout}" in log
    line = next(ln for ln in log.splitlines() if "samples in the object store" in ln)
    assert f"made on rollout node(s) {rollout}" in line and f"copied across raylets to {trainer}" in line, line
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_every_sample_counted(rows)

    # a label no node carries is refused once connected, before any placement group waits
    start = time.monotonic()
    proc = rlcore_run(cluster, tmp_path / "refused", "steps=3", "cluster.trainer_node_labels.rlcore-group=gpu")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "rlcore: config error: cluster.trainer_node_labels: no alive node has the label rlcore-group=gpu")
    assert time.monotonic() - start < 60  # not cluster.placement_timeout_s (120 s)


def placement_check(cluster: lc.Cluster, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.placement_check", "+recipe=qwen30b_swe",
                           f"cluster.address={cluster.gcs_address}", *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=lc.ray_env())


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_qwen30b_swe_placed_by_rays_scheduler_on_four_declared_gpu_nodes(start_cluster):
    # 96 CPUs and 8 GPUs declared per node (no GPU here): nothing starts on them but placement
    # groups, so no worker is prestarted for the declared CPUs
    cluster = start_cluster([lc.NodeSpec(cpus=96, gpus=8) for _ in range(4)], env={"RAY_enable_worker_prestart": "0"})
    dry = subprocess.run([sys.executable, "-m", "rlcore.run", "+recipe=qwen30b_swe", "dry_run=true"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    proc = placement_check(cluster)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the check prints the same plan as the dry run, then where each bundle landed
    for line in ("nodes: node 0: 8 bundle(s), node 1: 8 bundle(s)", "nodes: node 2: 4 bundle(s), node 3: 4 bundle(s)"):
        assert line in dry.stdout and line in proc.stdout
    placed = [ln.split() for ln in proc.stdout.splitlines() if " bundle " in ln and "-> Ray node" in ln]
    assert len(placed) == 24
    ray_of = {}
    for group, _, _, _, _, plan_node, _, _, _, node in placed:
        ray_of.setdefault(int(plan_node), set()).add(node)
    assert sorted(ray_of) == [0, 1, 2, 3] and all(len(v) == 1 for v in ray_of.values())
    assert len(set.union(*ray_of.values())) == 4
    assert set.union(*ray_of.values()) == {n.node_id for n in cluster.nodes}
    assert "placement check: all 24 bundles on the nodes the plan gives (4 Ray nodes)" in proc.stdout

    # impossible for the plan: refused before Ray is reached
    proc = placement_check(cluster, "rollout.num_actors=12")
    assert proc.returncode == 2 and "rlcore: config error: cluster.nodes: trainer + rollout need 40 GPUs" in proc.stderr
    # possible on the 5 nodes the command describes, impossible on the 4 that exist: refused once
    # connected, before any placement group is created
    proc = placement_check(cluster, "cluster.nodes=5", "trainer.world_size=24", "trainer.dp=12")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rlcore: config error: cluster.address: the rollout group's 8 bundle(s)" in proc.stderr
    assert "-> Ray node" not in proc.stdout


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_rollout_node_killed_mid_run_moves_its_engine_and_the_run_finishes(start_cluster, tmp_path):
    cluster = start_cluster(roles("driver", "trainer", "rollout", "rollout"))
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "rlcore.run", f"cluster.address={cluster.gcs_address}",
                            f"output_dir={out}", "steps=20", *LABELS], cwd=REPO, env=lc.ray_env(),
                           stdout=open(tmp_path / "driver.log", "w"), stderr=subprocess.STDOUT)
    killed = None
    try:
        deadline = time.monotonic() + 600
        while run.poll() is None and time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if killed is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                line = next(ln for ln in (tmp_path / "driver.log").read_text().splitlines()
                            if "placement: rollout group's" in ln)
                killed = next(n for n in cluster.nodes if n.node_id.startswith(line.rsplit(" ", 1)[1]))
                os.kill(lc.raylet_pid(killed), signal.SIGKILL)  # the node's raylet, by its pid
            time.sleep(0.5)
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    log = (tmp_path / "driver.log").read_text()
    assert killed is not None, log[-3000:]
    assert run.returncode == 0, log[-4000:]
    survivor = next(n for n in cluster.nodes[2:] if n is not killed)
    said = [ln for ln in log.splitlines() if "died: Ray re-placed its bundle" in ln]
    assert len(said) == 1 and f"node {killed.node_id[:8]} died" in said[0] \
        and f"on node {survivor.node_id[:8]}" in said[0], said
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["rollout_restarts"] == 1
    assert_every_sample_counted(rows)
    # requests in flight on the dead engine (if any were: that depends on when the kill lands)
    # are counted failed, each under its reason
    assert all(sum(r["failed_by_reason"].values()) == r["samples_failed_step"] for r in rows)


def submit(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.submit", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=lc.ray_env())


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_ray_jobs_to_the_multinode_cluster_followed_to_the_end_and_stopped(role_cluster, tmp_path):
    cluster = role_cluster
    common = ["--address", cluster.dashboard_url, "--deps", "preinstalled", "--request-timeout", "60", "--poll", "2"]
    proc = submit(*common, "--timeout", "360", "--", "steps=3", f"output_dir={tmp_path / 'run'}", *LABELS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SUCCEEDED" in proc.stderr
    # the job's own log came back: its groups were placed on the trainer and rollout nodes
    assert f"trainer group's 1 bundle(s) on node(s) {cluster.nodes[1].node_id[:8]}" in proc.stdout
    assert f"rollout group's 1 bundle(s) on node(s) {cluster.nodes[2].node_id[:8]}" in proc.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3

    # a failing job's exit code comes back through Ray Jobs (2: a config error)
    proc = submit(*common, "--timeout", "120", "--", "steps=3", f"output_dir={tmp_path / 'bad'}",
                  "cluster.trainer_node_labels.rlcore-group=gpu")
    assert proc.returncode == 2 and "FAILED" in proc.stderr and "no alive node has the label" in proc.stdout

    # a long job: submitted, followed from another process, stopped while it runs
    sid = f"rlcore-stop-{os.getpid()}"
    proc = submit(*common, "--no-wait", "--submission-id", sid, "--", "steps=100000",
                  f"output_dir={tmp_path / 'long'}", *LABELS)
    assert proc.returncode == 0 and proc.stdout.strip() == sid, proc.stderr
    follower = subprocess.Popen([sys.executable, "-m", "launch.submit", *common, "--timeout", "400", "--follow", sid],
                                cwd=REPO, stdout=open(tmp_path / "follow.out", "w"),
                                stderr=open(tmp_path / "follow.err", "w"), env=lc.ray_env())
    try:
        metrics = tmp_path / "long" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(1)
        assert metrics.exists(), (tmp_path / "follow.out").read_text()[-2000:]
        proc = submit(*common, "--timeout", "120", "--stop", sid)
        assert proc.returncode == 0, proc.stderr
        assert f"[launch] {sid} STOPPED" in proc.stderr
        assert follower.wait(timeout=120) == 3  # the follower saw the job end: STOPPED
    finally:
        if follower.poll() is None:
            follower.kill()
    assert f"[launch] {sid} STOPPED" in (tmp_path / "follow.err").read_text()
    assert "step" in (tmp_path / "follow.out").read_text()  # it streamed the job's log
