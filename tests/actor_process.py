"""Finding an actor's process from the outside, as a fault test does before it kills or freezes it.

An actor's stdout is OUTPUT_DIR/logs/KIND-INDEX.log (`actors.logs`, a path no other run shares);
the processes it forks (its reward workers, their keepers and the calls' processes) inherit that
stdout, and pids wrap, so the lowest pid writing to the file is not always the actor's.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_writing_to(log: Path | str, not_pid: int | None = None) -> int | None:
    """Of the processes whose stdout is `log`, the one whose parent is not one of them (other than
    `not_pid`, an actor killed a moment ago); None while there is not exactly one."""
    writers: dict[int, int] = {}  # pid -> parent pid
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/fd/1") == str(log):
                stat = Path(f"/proc/{pid}/stat").read_text()
                writers[int(pid)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError):  # gone, or not ours to read
            continue
    tops = [pid for pid, parent in writers.items() if parent not in writers and pid != not_pid]
    return tops[0] if len(tops) == 1 else None


def actor_pid(out: Path, kind: str, index: int, not_pid: int | None = None) -> int | None:
    """The process of actor `kind` `index` (`rollout`, `trainer`) of the run writing to `out`."""
    return process_writing_to(out / "logs" / f"{kind}-{index}.log", not_pid)
