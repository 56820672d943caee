"""The test runner shipped into the sandbox as `run_tests.py` (standard library only; it is copied
there verbatim and run as `python -I run_tests.py`, so no file of the work directory shadows a
module it imports).

It never imports the policy's code. It reads the run's spec (`SPEC_FILE`: a per-run nonce, the
calls to make, a time budget) and deletes it before anything else starts, makes itself
non-dumpable (so a process of the same uid cannot read its memory or open its descriptors
through /proc), then runs each function's calls in a child process that imports the policy's
`lib`, with the child's stdout and stderr going to private files. Each child writes one JSON line
per call (`{"i": k, "value": v}` or `{"i": k, "error": "..."}`); the runner keeps the first line
per call and prints one line, `NONCE {"name": {"value": v} | {"error": "..."}, ...}`, on its own
stdout, which no child holds.

The verdict is not made here: the environment compares each value with its own expected value
(computed by its reference implementation, outside the sandbox), for the calls it chose. A child
can print anything, exit early, patch whatever it likes in its own interpreter or kill this
process: the worst it gets is its calls' values (or none), never a pass it did not compute.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

SPEC_FILE = ".rlcore_tests.json"
OUTPUT_BYTES = 64 * 1024  # of each child's stdout read back (the rest is its own business)
VALUE_CHARS = 2000  # of one call's value, as JSON: the report stays small whatever a child returns
PR_SET_DUMPABLE = 4

CHILD = r"""
import json, sys, traceback
calls = json.loads(sys.stdin.readline())
sys.path.insert(0, ".")
out = sys.stdout
try:
    import lib
except BaseException:
    traceback.print_exc(limit=2)
    raise SystemExit(3)
for i, (fn, args) in enumerate(calls):
    try:
        line = json.dumps({"i": i, "value": getattr(lib, fn)(*args)})
    except BaseException as e:
        traceback.print_exc(limit=2)
        line = json.dumps({"i": i, "error": f"{type(e).__name__}: {e}"[:200]})
    out.write(line + "\n")
    out.flush()
"""


def _private() -> None:
    """No process of this uid may read this one's memory or descriptors (/proc/PID/mem, fd/)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _run_child(calls: list, timeout_s: float) -> tuple[list[dict | None], str]:
    """Each call's entry (None: the child never reported it) and the tail of the child's stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-s", "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            start_new_session=True,
            close_fds=True,
        )
        try:
            proc.stdin.write(json.dumps(calls).encode() + b"\n")
            proc.stdin.close()
        except OSError:  # the child is gone already (exited at import)
            pass
        try:
            proc.wait(timeout=max(0.1, timeout_s))
            why = ""
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout_s:.1f}s"
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it started dies with it
        except OSError:
            pass
        proc.wait()
        out.seek(0)
        err.seek(0)
        lines = out.read(OUTPUT_BYTES).decode(errors="replace").splitlines()
        tail = err.read()[-2000:].decode(errors="replace")
    entries: list[dict | None] = [None] * len(calls)
    for line in lines:
        try:
            item = json.loads(line)
            i = item["i"]
        except (ValueError, TypeError, KeyError):
            continue
        if type(i) is int and 0 <= i < len(calls) and entries[i] is None:
            if "value" in item and len(json.dumps(item["value"])) <= VALUE_CHARS:
                entries[i] = {"value": item["value"]}
            else:
                entries[i] = {"error": str(item.get("error", f"value over {VALUE_CHARS} characters"))[:200]}
    missing = why or (
        f"the test process exited {proc.returncode} before reporting it"
        if proc.returncode
        else "the test process did not report it"
    )
    return [e if e is not None else {"error": missing} for e in entries], tail


def main() -> None:
    with open(SPEC_FILE) as f:
        spec = json.load(f)
    os.unlink(SPEC_FILE)
    _private()
    deadline = time.monotonic() + float(spec["budget_s"])
    groups: dict[str, list] = {}
    for name, fn, args in spec["calls"]:  # one child per function: a hang costs that function only
        groups.setdefault(fn, []).append((name, args))
    report = {}
    for left, (fn, group) in zip(range(len(groups), 0, -1), groups.items()):
        entries, tail = _run_child([[fn, args] for _, args in group], (deadline - time.monotonic()) / left)
        if tail.strip():
            sys.stderr.write(tail)
        for (name, _), entry in zip(group, entries):
            report[name] = entry
    sys.stdout.write(spec["nonce"] + " " + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
