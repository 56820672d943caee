"""The run's JSONL series keep whole rows only (`rlcore.storage.series`): a full disk while a row
is written is one error naming the file and "no space left on device", the file keeps the rows
before it, and a resume drops a line that does not parse (a row cut short by an older writer)
with one warning instead of keeping it. The full disk is a real one: a 64 KiB tmpfs (root only;
skipped where it cannot be mounted)."""

import json
import logging
from pathlib import Path

import pytest

from rlcore.config import LoggerConfig
from rlcore.report.metrics import MetricsLogger
from rlcore.storage.errors import NO_SPACE, StorageError, short_storage_error, storage_cause
from rlcore.storage.rundir import truncate_series
from tests.conftest import fill_disk


@pytest.fixture
def small_disk(capped_disk):
    """A 64 KiB tmpfs: writes past it fail with ENOSPC."""
    return capped_disk("64k")


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line must parse


def test_a_full_disk_while_a_row_is_written_names_the_file_and_leaves_no_half_row(small_disk):
    logger = MetricsLogger(LoggerConfig(console=False), str(small_disk), {}, 0)
    pad = "x" * 3000  # a few rows fill the disk; the row that does not fit is cut by the disk
    written = 0
    with pytest.raises(StorageError) as err:
        for step in range(1, 200):
            logger.log({"step": step, "pad": pad})
            written = step
    logger.close()
    line = str(err.value)
    assert NO_SPACE in line and str(small_disk / "metrics.jsonl") in line and len(line) < 200, line
    assert written > 3
    assert [r["step"] for r in lines_of(small_disk / "metrics.jsonl")] == list(range(1, written + 1))
    # the resume path reads the same rows back: none dropped, none broken
    assert truncate_series(small_disk / "metrics.jsonl", written) == 0
    assert [r["step"] for r in lines_of(small_disk / "metrics.jsonl")] == list(range(1, written + 1))


def test_resume_drops_a_row_cut_short_with_one_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": s / 10} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')  # a writer stopped mid-row
    with caplog.at_level(logging.WARNING, logger="rlcore"):
        assert truncate_series(path, 5) == 0
    assert lines_of(path) == rows
    warned = [r.getMessage() for r in caplog.records if "not whole JSON rows" in r.getMessage()]
    assert len(warned) == 1 and "metrics.jsonl" in warned[0]
    # a broken row in the middle (kept by older code) goes too; rows after the checkpoint as before
    path.write_text(json.dumps(rows[0]) + '\n{"step": 2, "lo\n' + "".join(json.dumps(r) + "\n" for r in rows[2:]))
    assert truncate_series(path, 4) == 1
    assert [r["step"] for r in lines_of(path)] == [1, 3, 4]


def test_storage_errors_are_named_for_what_they_are():
    import errno

    assert storage_cause(OSError(errno.ENOSPC, "No space left on device")) == NO_SPACE
    assert storage_cause(PermissionError(errno.EACCES, "Permission denied")) == "permission denied"
    assert storage_cause(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) == "storage unreachable"
    try:  # a wrapper whose own text hides the cause: the chain is read
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("unexpected pos 704 vs 598") from inner
    except RuntimeError as outer:
        assert storage_cause(outer) == NO_SPACE
    assert storage_cause(RuntimeError("An error occurred (SlowDown) when calling PutObject")) == "throttled"
    assert storage_cause(RuntimeError("An error occurred (AccessDenied) when calling PutObject")) == "permission denied"
    assert storage_cause(ValueError("boom")) is None
    line = short_storage_error("uploading to", "s3://b/run", RuntimeError("x" * 1000))
    assert len(line) <= 200 and line.startswith("uploading to s3://b/run: RuntimeError: x")


def test_a_checkpoint_write_that_failed_on_a_full_disk_says_so(small_disk, tmp_path):
    """torch's zip writer reports a short write as `unexpected pos ...` without the errno: on a
    (nearly) full local disk the checkpoint's error line says "no space left on device"."""
    from actors.trainer_group import save_failure_cause

    torch_error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert save_failure_cause(torch_error, tmp_path) is None  # room left: not read as a full disk
    fill_disk(small_disk)
    assert save_failure_cause(torch_error, small_disk) == NO_SPACE
    wrapped = RuntimeError("checkpoint save failed (rank 0: RuntimeError: ... [Errno 28] No space left on device)")
    assert save_failure_cause(wrapped, tmp_path) == NO_SPACE
