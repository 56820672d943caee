"""`output_dir` as a storage location (rlcore.storage.location): a local path or `file://` URL,
parsed by fsspec, made absolute before the run starts; an object store's URL kept, the run's
own folder then a local staging folder (the runs themselves: tests/test_storage_object_store.py);
a protocol a run cannot write through refused in one line; inside a Ray Job, a folder in the job's node-local working directory
refused. The same through Ray Jobs on a multi-node cluster: tests/test_multinode.py."""

import json
import sys
from pathlib import Path

import pytest

from rlcore.config.errors import ConfigError
from rlcore.plan.compose import compose
from rlcore.run import main
from rlcore.storage.location import JOB_CONFIG_ENV, local_path, node_local_problem, with_local_paths


def test_a_local_path_and_a_file_url_are_one_absolute_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert local_path("outputs/rl", "output_dir") == str(tmp_path / "outputs" / "rl")
    assert local_path(f"file://{tmp_path}/run", "output_dir") == str(tmp_path / "run")
    assert local_path(f"{tmp_path}/run", "output_dir") == str(tmp_path / "run")
    assert local_path("~/x", "output_dir") == str(Path.home() / "x")
    cfg = with_local_paths(compose(["output_dir=outputs/a", "checkpoint.dir=file:///tmp/ck"]))
    assert cfg.output_dir == str(tmp_path / "outputs" / "a") and cfg.checkpoint.dir == "/tmp/ck"
    assert cfg.checkpoint.export_dir is None


def test_an_object_store_url_is_kept_and_output_dir_becomes_its_staging_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_STAGING_DIR", str(tmp_path / "staging"))
    assert local_path("s3://bucket/run/", "output_dir") == "s3://bucket/run"
    cfg = with_local_paths(compose(["output_dir=s3://bucket/run"]))
    assert cfg.storage.url == "s3://bucket/run" and cfg.output_dir.startswith(str(tmp_path / "staging") + "/")
    assert cfg.checkpoint.dir == "s3://bucket/run/checkpoints" and cfg.checkpoint.export_dir == "s3://bucket/run/hf"
    other = with_local_paths(compose(["output_dir=s3://bucket/run2", "checkpoint.dir=s3://b2/ck"]))
    assert other.output_dir != cfg.output_dir and other.checkpoint.dir == "s3://b2/ck"
    assert with_local_paths(compose(["output_dir=/tmp/x"])).storage.url == ""


@pytest.mark.parametrize(
    "url, why",
    [
        ("memory://run", "lives inside one process"),
        ("nosuchfs://bucket/run", "is no storage fsspec knows"),
        ("s3://", "names no bucket"),
    ],
)
def test_a_storage_a_run_cannot_write_through_is_one_line(url, why, tmp_path, capsys):
    with pytest.raises(ConfigError, match=why):
        local_path(url, "output_dir")
    assert main(["steps=1", f"output_dir={url}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlcore: config error: output_dir: '{url}'"), err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_run_with_a_file_url_writes_there(tmp_path):
    assert main(["steps=1", f"output_dir=file://{tmp_path}/run", "checkpoint.interval=1", "cluster.num_cpus=2"]) == 0
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "meta.json").is_file()
    assert not Path("file:").exists()


def test_inside_a_ray_job_the_working_dir_is_node_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {JOB_CONFIG_ENV: json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}})}
    cfg = with_local_paths(compose(["output_dir=outputs/rl"]))
    [(key, msg)] = node_local_problem(cfg, env)
    assert key == "output_dir" and "inside this Ray Job's working directory" in msg
    assert node_local_problem(with_local_paths(compose(["output_dir=/tmp/shared/run"])), env) == []
    [(key, _)] = node_local_problem(with_local_paths(compose(["output_dir=/tmp/s", "checkpoint.dir=ck"])), env)
    assert key == "checkpoint.dir"
    assert node_local_problem(cfg, {}) == []  # not a Ray Job: one machine's cwd is the user's
    assert node_local_problem(cfg, {JOB_CONFIG_ENV: json.dumps({"runtime_env": {}})}) == []  # no working dir shipped
