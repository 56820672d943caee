"""`output_dir` in an object store, against a real S3 API: moto's S3 server on localhost, reached
by s3fs exactly as AWS is (endpoint and fake credentials from the environment, as a user's own
profile would give them). Checkpoints are written straight to the bucket by the trainer ranks and
committed by their meta.json; the series are staged locally and uploaded; a resume reads both
back (rlcore.storage.location, rlcore.storage.staging, rlcore.storage.checkpoint)."""

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.config.errors import ConfigError
from rlcore.plan.cli import job_output_dir
from rlcore.plan.compose import compose
from rlcore.run import main
from rlcore.storage.checkpoint import CheckpointWriter
from rlcore.storage.checkpoint_dirs import checkpoint_root, list_checkpoints
from rlcore.storage.export import main as export_main
from rlcore.storage.location import with_local_paths
from rlcore.storage.staging import LEASE, Sync, claim, download
from tests.actor_process import process_writing_to

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

RUN = ["cluster.num_cpus=2"]
NO_WARMUP = "sft.warmup_steps=0"
"""The runs here check storage, not the default job's 40 SFT warm-up steps before RL (3-5 s each)."""


@pytest.fixture(scope="module")
def s3_server():
    """An S3 API on localhost for this module; the environment points every process of a run
    (the driver, and the Ray workers it starts) at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def bucket(s3_server, tmp_path, monkeypatch, request):
    """A fresh bucket, and a staging root of this test's own."""
    import s3fs

    monkeypatch.setenv("RLCORE_STAGING_DIR", str(tmp_path / "staging"))
    name = f"b-{request.node.name.lower().replace('_', '-')[:40]}-{os.getpid()}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(name)
    fs.invalidate_cache()
    return fs, name


def rows(fs, path):
    fs.invalidate_cache()
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines() if line.strip()]


def test_a_run_checkpoints_into_the_bucket_and_resumes_from_its_last_committed_checkpoint(bucket, tmp_path):
    fs, name = bucket
    url = f"s3://{name}/run"
    assert main(["steps=2", f"output_dir={url}", "checkpoint.interval=1", NO_WARMUP, *RUN]) == 0
    fs.invalidate_cache()
    ckpts = f"{name}/run/checkpoints"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(ckpts)) == ["step_00000001", "step_00000002"]
    for step in ("step_00000001", "step_00000002"):
        meta = json.loads(fs.cat_file(f"{ckpts}/{step}/meta.json"))
        for rel, size in meta["parts"].items():  # every part meta.json lists is in the bucket
            assert fs.info(f"{ckpts}/{step}/{rel}")["size"] >= size, rel
    first = rows(fs, f"{name}/run/metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2]
    assert fs.exists(f"{name}/run/config.yaml") and not fs.exists(f"{name}/run/{LEASE}")  # released at the end
    assert not fs.exists(f"{name}/run/.lock")

    # step 2's commit object is lost: that checkpoint is never resumed from; step 1 is
    fs.rm_file(f"{ckpts}/step_00000002/meta.json")
    cfg = with_local_paths(compose([f"output_dir={url}", "resume=true"]))
    assert [s for s, _ in list_checkpoints(checkpoint_root(cfg))] == [1]

    assert (
        main(
            [
                "steps=3",
                f"output_dir={url}",
                "checkpoint.interval=1",
                "resume=true",
                "checkpoint.export_final=true",
                NO_WARMUP,
                *RUN,
            ]
        )
        == 0
    )
    fs.invalidate_cache()
    # the earlier rows are kept as they were; step 2's row, after the checkpoint resumed from, is trained again
    again = rows(fs, f"{name}/run/metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3] and again[0] == first[0]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(ckpts)) == ["step_00000001", "step_00000002", "step_00000003"]
    for step in (2, 3):  # step 2 committed again: the run went on from step 1
        assert json.loads(fs.cat_file(f"{ckpts}/step_{step:08d}/meta.json"))["step"] == step
    assert fs.exists(f"{name}/run/hf/model.safetensors") and fs.exists(f"{name}/run/hf/config.json")

    # the offline export reads a checkpoint from the bucket (the newest of the folder given)
    assert export_main([f"{url}/checkpoints", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_fresh_run_on_a_url_that_holds_a_run_is_refused_before_ray(bucket, capsys):
    fs, name = bucket
    fs.pipe_file(f"{name}/run/metrics.jsonl", b'{"step": 1}\n')
    assert main(["steps=1", f"output_dir=s3://{name}/run", *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run (metrics.jsonl)" in err[0], err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_url_a_live_run_holds_by_its_lease_is_refused(bucket, capsys):
    fs, name = bucket
    fs.pipe_file(f"{name}/run/{LEASE}", json.dumps({"owner": "elsewhere:7", "time": time.time()}).encode())
    assert main(["steps=1", f"output_dir=s3://{name}/run", *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in use by another run (elsewhere:7" in err[0], err
    # a lease not renewed for minutes is a run that is gone: the URL is free again
    fs.pipe_file(f"{name}/run/{LEASE}", json.dumps({"owner": "elsewhere:7", "time": time.time() - 3600}).encode())
    assert download(with_local_paths(compose([f"output_dir=s3://{name}/run"]))) == 0
    # a fresh lease of a process of this machine that is gone (a run killed with SIGKILL) holds nothing
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    fs.pipe_file(
        f"{name}/run/{LEASE}",
        json.dumps({"owner": f"{socket.gethostname()}:{gone.stdout.strip()}", "time": time.time()}).encode(),
    )
    assert download(with_local_paths(compose([f"output_dir=s3://{name}/run"]))) == 0


def test_an_uncommitted_checkpoint_prefix_is_never_listed_and_is_removed_by_the_next_run(bucket):
    fs, name = bucket
    cfg = with_local_paths(compose([f"output_dir=s3://{name}/run"]))
    root = f"{name}/run/checkpoints"
    fs.pipe_file(f"{root}/step_00000004/trainer/.metadata", b"x")
    fs.pipe_file(f"{root}/step_00000004/trainer/__0_0.distcp", b"x" * 10)
    fs.invalidate_cache()
    writer = CheckpointWriter(cfg)
    assert list_checkpoints(writer.root) == []
    writer.clean_stale()
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/step_00000004")


def test_a_missing_backend_is_one_line_naming_the_key(tmp_path, capsys):
    if importlib.util.find_spec("gcsfs"):  # not a dependency: gs:// has no filesystem here
        pytest.skip("gcsfs is installed")
    with pytest.raises(ConfigError, match="gcsfs"):
        with_local_paths(compose(["output_dir=gs://bucket/run"]))
    assert main(["steps=1", "output_dir=gs://bucket/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlcore: config error: output_dir: 'gs://bucket/run'"), err


def test_the_staging_folder_is_uploaded_while_the_run_lives_and_at_its_end(bucket, capsys):
    fs, name = bucket
    cfg = with_local_paths(compose([f"output_dir=s3://{name}/run", "storage.sync_interval_s=0.2"]))
    download(cfg)
    out = Path(cfg.output_dir)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / ".lock").write_text("1\n")
    claim(cfg)
    with Sync(cfg) as sync:
        deadline = time.monotonic() + 30
        while not fs.exists(f"{name}/run/metrics.jsonl") and time.monotonic() < deadline:
            time.sleep(0.1)
            fs.invalidate_cache()
        assert [r["step"] for r in rows(fs, f"{name}/run/metrics.jsonl")] == [1]  # uploaded during the run
        assert fs.exists(f"{name}/run/{LEASE}")
        with open(out / "metrics.jsonl", "a") as fh:
            fh.write('{"step": 2}\n')
    assert sync.failed is None
    assert [r["step"] for r in rows(fs, f"{name}/run/metrics.jsonl")] == [1, 2]  # the last rows, at the end
    assert not fs.exists(f"{name}/run/{LEASE}") and not fs.exists(f"{name}/run/.lock")

    # the store goes away before the end: the run says where its files are, never drops them silently
    cfg = with_local_paths(compose([f"output_dir=s3://{name}/run2", "storage.sync_interval_s=0"]))
    download(cfg)
    (Path(cfg.output_dir) / "metrics.jsonl").write_text('{"step": 1}\n')
    claim(cfg)
    with Sync(cfg) as sync:
        fs.rm(name, recursive=True)
    assert sync.failed
    err = capsys.readouterr().err
    assert f"were not uploaded to s3://{name}/run2" in err and cfg.output_dir in err
    with pytest.raises(ConfigError, match="cannot be written"):
        claim(cfg)


def test_keep_last_prunes_old_checkpoints_in_the_store(bucket):
    fs, name = bucket
    cfg = with_local_paths(compose([f"output_dir=s3://{name}/run", "checkpoint.keep_last=1"]))
    root = f"{name}/run/checkpoints"
    for step in (1, 2):
        fs.pipe_file(f"{root}/step_{step:08d}/trainer/.metadata", b"x")
        fs.pipe_file(f"{root}/step_{step:08d}/meta.json", json.dumps({"step": step, "parts": {}}).encode())
    writer = CheckpointWriter(cfg)
    assert [s for s, _ in list_checkpoints(writer.root)] == [1, 2]
    writer.prune()
    fs.invalidate_cache()
    assert [s for s, _ in list_checkpoints(writer.root)] == [2] and not fs.exists(f"{root}/step_00000001")


def test_a_sweep_under_a_url_keeps_the_url():
    assert job_output_dir("s3://bucket/sweep", 3) == "s3://bucket/sweep/3"
    assert job_output_dir("outputs/sweep/", 0) == "outputs/sweep/0"


def test_every_trainer_ranks_shard_is_written_into_the_bucket_and_listed_by_the_commit(bucket, tmp_path):
    fs, name = bucket
    assert (
        main(
            [
                "mode=sft",
                "steps=1",
                f"output_dir=s3://{name}/sft",
                "trainer.world_size=2",
                "trainer.cpus_per_rank=1",
                *RUN,
            ]
        )
        == 0
    )
    fs.invalidate_cache()
    step = f"{name}/sft/checkpoints/step_00000001"
    parts = json.loads(fs.cat_file(f"{step}/meta.json"))["parts"]
    shards = sorted(p for p in parts if p.endswith(".distcp"))
    assert shards == ["trainer/__0_0.distcp", "trainer/__1_0.distcp"], parts  # each rank wrote its own
    for rel, size in parts.items():
        assert fs.info(f"{step}/{rel}")["size"] >= size, rel
    # one process reads the two ranks' shards back from the bucket (resharded)
    assert export_main([f"s3://{step}", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_run_stopped_by_sigterm_uploads_its_rows_and_checkpoint_before_it_exits(bucket):
    fs, name = bucket
    url = f"s3://{name}/run"
    cfg = with_local_paths(compose([f"output_dir={url}"]))
    staged = Path(cfg.output_dir) / "metrics.jsonl"
    run = subprocess.Popen(
        [sys.executable, "-m", "rlcore.run", "steps=500", f"output_dir={url}", NO_WARMUP, *RUN],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (staged.is_file() and staged.read_text().strip()) and run.poll() is None:
            assert time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err[-2000:]
    uploaded = rows(fs, f"{name}/run/metrics.jsonl")
    assert uploaded and uploaded == [json.loads(line) for line in staged.read_text().splitlines() if line.strip()]
    assert [s for s, _ in list_checkpoints(checkpoint_root(cfg))] == [uploaded[-1]["step"]]
    assert not fs.exists(f"{name}/run/{LEASE}")


def lease_time(fs, key) -> float:
    fs.invalidate_cache()
    return float(json.loads(fs.cat_file(key))["time"])


def test_the_lease_is_renewed_from_its_own_thread_while_an_upload_hangs(bucket, monkeypatch):
    """An upload that does not finish (here: held at the staging lock, as a stalled store would
    hold it) never lets the lease go stale: the lease has a thread of its own."""
    from rlcore.storage import staging

    fs, name = bucket
    monkeypatch.setattr(staging, "HEARTBEAT_S", 0.3)
    cfg = with_local_paths(compose([f"output_dir=s3://{name}/run", "storage.sync_interval_s=0.2"]))
    download(cfg)
    claim(cfg)
    key = f"{name}/run/{LEASE}"
    with Sync(cfg) as sync:
        with staging._upload_lock:  # every upload hangs until the lock is free
            first = lease_time(fs, key)
            time.sleep(2.0)
            assert lease_time(fs, key) > first + 0.5, "the lease was not renewed while the upload hung"
            assert staging.upload_within(cfg, 0.5) is False  # bounded: the run goes on without it
    fs.invalidate_cache()
    assert sync.failed is None and not fs.exists(key)  # the hung uploads finished; released at the end


def test_a_run_refused_before_it_began_uploads_nothing(bucket):
    fs, name = bucket
    cfg = with_local_paths(compose([f"output_dir=s3://{name}/fresh"]))
    download(cfg)
    (Path(cfg.output_dir) / "config.yaml").write_text("mode: rl\n")
    (Path(cfg.output_dir) / "events.jsonl").write_text('{"kind": "start"}\n')
    claim(cfg)
    with Sync(cfg) as sync:
        sync.discard()  # e.g. the cluster check refused it after the claim
    fs.invalidate_cache()
    assert sync.failed is None and fs.find(f"{name}/fresh") == []  # not even its lease stays


@pytest.fixture
def stoppable_s3(tmp_path, monkeypatch):
    """moto's S3 server in a process of its own, so that it can be frozen (SIGSTOP) like a store
    that stops answering."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RLCORE_STAGING_DIR", str(tmp_path / "staging"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # the cached one points to the module's server
    fs = s3fs.S3FileSystem()
    fs.mkdir("frozen")
    yield proc, fs
    s3fs.S3FileSystem.clear_instance_cache()
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(timeout=30)


def test_a_store_that_stops_answering_during_a_checkpoint_upload_is_named_and_bounded(stoppable_s3, caplog):
    """SIGSTOP of the S3 server while a checkpoint uploads the run's files: one line names the
    URL and the deadline within seconds, and at the deadline the run goes on (it used to wait
    minutes with no line while its lease went stale)."""
    from rlcore.storage import staging

    proc, fs = stoppable_s3
    url = "s3://frozen/run"
    cfg = with_local_paths(compose([f"output_dir={url}", "storage.sync_interval_s=0"]))
    download(cfg)
    (Path(cfg.output_dir) / "metrics.jsonl").write_text('{"step": 1}\n')
    claim(cfg)
    proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlcore"):
            done = staging.upload_within(cfg, 8.0, "uploading the run's files of step 1")
        took = time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGCONT)
    lines = [r.getMessage() for r in caplog.records]
    assert done is False and took < 12.0, (done, took)
    assert any(
        url in ln and "no answer from the store for 5s" in ln and "checkpoint.timeout_s" in ln for ln in lines
    ), lines
    assert any(url in ln and "not done within 8s" in ln for ln in lines), lines
    # the store answers again: the lease is renewed at once by its own thread
    staging.renew_lease(cfg)
    assert time.time() - lease_time(fs, f"frozen/run/{LEASE}") < 30


def test_a_run_whose_store_went_unanswered_leaves_in_seconds_not_another_full_deadline(stoppable_s3):
    """Once a store call of the run ran past checkpoint.timeout_s, the way out asks the store
    once (a lease write, staging.PROBE_S) instead of waiting the deadline again for the renewal
    and again for the last upload (with the default 600 s that was over 20 minutes); the error
    names why and where the files are."""
    from rlcore.storage import staging

    proc, fs = stoppable_s3
    url = "s3://frozen/run"
    cfg = with_local_paths(compose([f"output_dir={url}", "storage.sync_interval_s=0", "checkpoint.timeout_s=60"]))
    download(cfg)
    (Path(cfg.output_dir) / "metrics.jsonl").write_text('{"step": 1}\n')
    claim(cfg)
    try:
        with staging.Sync(cfg) as sync:
            proc.send_signal(signal.SIGSTOP)
            assert staging.upload_within(cfg, 6.0, "uploading the run's files of step 1") is False
            start = time.monotonic()
        took = time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGCONT)
    assert sync.failed and "not waiting checkpoint.timeout_s again" in sync.failed, sync.failed
    assert took < staging.PROBE_S + 15, took  # not checkpoint.timeout_s (60 s) twice


STORE_DEADLINE_S = 9
"""checkpoint.timeout_s of the frozen-store run (small: the test waits it out at step 4's
checkpoint; the way out then asks the store once, staging.PROBE_S, not the deadline again). Above staging.NOTICE_S (5 s: the "waiting up to"
line) and stall_watch.BEFORE_SYNC_S (6 s: step 2's checkpoint leaves the frozen engine out before
its deadline); a healthy part (a shard of the tiny model into moto on localhost) is given 9 s too."""


FROZEN_RUN_STEPS = 5
"""The frozen-store run stops at step 4's checkpoint; the resume (from step 2's) trains 3..5:
one step past the one whose checkpoint failed."""


def test_a_frozen_engine_and_then_a_frozen_store_inside_a_full_runs_checkpoints_are_named_and_resumed_from(
    stoppable_s3, tmp_path
):
    """`python -m rlcore.run` on s3:// with two engines and a checkpoint every 2 steps. Engine 1
    is frozen (SIGSTOP) once step 1's row is written, until the end: the stall watcher names it
    (at step 2's sync or in step 2's checkpoint's read of the RNG states), the checkpoint leaves
    its RNG state out and the run goes on (it used to stop the run after 60 s naming no actor).
    The S3 server is frozen once step 3's row is written (step 2's checkpoint committed), so step 4's checkpoint meets a store that
    does not answer: one line within seconds names the URL and the deadline
    (checkpoint.timeout_s), and at the deadline the run stops with a named error and the resume
    command, exit 1 (it waited >400 s with no line). The store back, `resume=true` (from a
    checkpoint without engine 1's RNG state) reads back steps 1..N once, every line valid JSON."""
    proc, fs = stoppable_s3
    url = "s3://frozen/run"
    cfg = with_local_paths(compose([f"output_dir={url}"]))
    staged = Path(cfg.output_dir) / "metrics.jsonl"
    overrides = [
        f"output_dir={url}",
        "checkpoint.interval=2",
        f"checkpoint.timeout_s={STORE_DEADLINE_S}",
        "storage.sync_interval_s=0",
        "rollout.num_actors=2",
        "sft.warmup_steps=0",
        "cluster.num_cpus=3",
    ]
    log_path = tmp_path / "run.log"
    run = subprocess.Popen(
        [sys.executable, "-m", "rlcore.run", f"steps={FROZEN_RUN_STEPS}", *overrides],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
    )
    engine = frozen_at = named_at = None
    engine_frozen = False
    try:
        deadline = time.monotonic() + 400
        while run.poll() is None and time.monotonic() < deadline:
            rows_done = len(staged.read_text().splitlines()) if staged.is_file() else 0
            engine_log = Path(cfg.output_dir) / "logs" / "rollout-1.log"
            if engine is None and engine_log.is_file():  # found ahead: a scan of /proc is slow under load
                engine = process_writing_to(engine_log)
            if not engine_frozen and engine is not None and rows_done >= 1:
                # during step 2: named as a stall by step 2's sync or by its checkpoint's read of
                # the engines' RNG states. Frozen once step 2's row was written, the read could
                # come first, and steps 3-4 (under 6 s) were too short to name it: no stall line
                os.kill(engine, signal.SIGSTOP)
                engine_frozen = True
            if frozen_at is None and rows_done >= 3:
                proc.send_signal(signal.SIGSTOP)  # before step 4's checkpoint
                frozen_at = time.monotonic()
            if (
                frozen_at is not None
                and named_at is None
                and "frozen/run/checkpoints: no answer" in log_path.read_text()
            ):
                named_at = time.monotonic()
            time.sleep(0.2)
        ended = time.monotonic()
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        proc.send_signal(signal.SIGCONT)
        if engine_frozen:
            try:
                os.kill(engine, signal.SIGCONT)
            except ProcessLookupError:
                pass
    log = log_path.read_text()
    assert engine_frozen and frozen_at is not None, log[-3000:]
    assert run.returncode == 1, log[-4000:]
    stalled = [ln for ln in log.splitlines() if "rollout actor 1" in ln and "no progress for" in ln]
    assert len(stalled) == 1, log[-4000:]  # the frozen engine: a stall, not the end of the run
    in_checkpoint = [ln for ln in log.splitlines() if "engine RNG state of rollout actor 1" in ln]
    print(f"engine frozen during step 2's checkpoint: {in_checkpoint or 'no: it was seen first elsewhere'}")
    waiting = [
        ln for ln in log.splitlines() if "checkpoint.timeout_s" in ln and "waiting up to" in ln and "frozen/run" in ln
    ]
    assert waiting, log[-4000:]  # the store's URL and the deadline
    errors = [ln for ln in log.splitlines() if ln.startswith("rlcore: error:")]
    assert errors and "continue with resume=true" in errors[0], log[-4000:]
    print(
        f"engine frozen: {stalled[0]}; store frozen: named {named_at - frozen_at:.1f}s after SIGSTOP, the run "
        f"ended {ended - frozen_at:.1f}s after it (checkpoint.timeout_s={STORE_DEADLINE_S}): {waiting[0]} / {errors}"
    )
    assert named_at - frozen_at < 30, named_at - frozen_at
    assert "storage unreachable" in errors[0] and "frozen/run" in errors[0], errors
    # the way out is bounded too: the last upload named, then given up with where the files are
    assert any(
        ln.startswith("rlcore: error: the run's files were not uploaded to s3://frozen/run")
        and "not waiting checkpoint.timeout_s again" in ln
        for ln in errors
    ), errors
    assert ended - frozen_at < 3 * STORE_DEADLINE_S + 60, ended - frozen_at
    assert "Traceback" not in log, log[-4000:]

    resumed = subprocess.run(
        [sys.executable, "-m", "rlcore.run", f"steps={FROZEN_RUN_STEPS}", "resume=true", *overrides],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    fs.invalidate_cache()
    for series in ("metrics.jsonl", "events.jsonl"):
        for line in fs.cat_file(f"frozen/run/{series}").decode().splitlines():
            json.loads(line)  # every line whole
    assert [r["step"] for r in rows(fs, "frozen/run/metrics.jsonl")] == list(range(1, FROZEN_RUN_STEPS + 1))
