"""Faults of a rollout actor named for what they are (Ray-free: they read exception text).

- :func:`memory_kill`: Ray's memory monitor (the raylet of the actor's node) killed the actor's
  worker. Ray says so in the text of the `OutOfMemoryError` (or `ActorDiedError`, exit type
  NODE_OUT_OF_MEMORY) of the call that was running: "Task was killed due to the node running
  low on memory. Memory on the node (IP: ..., ID: ...) where the task (..., memory used=...)
  was running was 14.2GB / 15.0GB (0.95), which exceeds the memory usage threshold of 0.95".
  That becomes one line with the node and its figures.
- :class:`NotInWeightGroup`: a call that needs the weight-sync group reached an actor Ray had
  restarted (a new process, so no receiver) before it rejoined: the driver treats the actor as
  restarted, not as a broken sync.
"""

from __future__ import annotations

import re

_KILLED = ("running low on memory", "NODE_OUT_OF_MEMORY")
_NODE = re.compile(r"Memory on the node \(IP: (?P<ip>[^,)]+)")
_SIZE = r"\d+(?:\.\d+)?\s*[KMGT]?i?B"
_NUM = r"\d+(?:\.\d+)?"
_USED = (  # Ray 2.60's raylet text, then the older one
    re.compile(rf"was (?P<used>{_SIZE}) used / (?P<total>{_SIZE}) limit \((?P<frac>{_NUM})\)"),
    re.compile(rf"was running was (?P<used>{_SIZE}) / (?P<total>{_SIZE}) \((?P<frac>{_NUM})\)"),
)
_LIMIT = (
    re.compile(rf"exceeded threshold of \d+B \((?P<percent>{_NUM})% of"),
    re.compile(rf"exceeds the memory usage threshold of (?P<fraction>{_NUM})"),
)
_WORKER = re.compile(rf"memory used=(?P<worker>{_SIZE})")


class NotInWeightGroup(RuntimeError):
    """The actor is not (or no longer) in the weight-sync group: it was restarted and has not
    rejoined."""


def memory_kill(text: str) -> str | None:
    """ "killed by Ray's memory monitor (node IP: used / total = fraction over the threshold;
    its worker used X)" when `text` (an exception's message) says Ray killed the worker for
    memory, else None. Figures Ray did not print are left out."""
    if not any(k in text for k in _KILLED):
        return None
    node, worker = _NODE.search(text), _WORKER.search(text)
    used = next((m for m in (p.search(text) for p in _USED) if m), None)
    limit = next((m for m in (p.search(text) for p in _LIMIT) if m), None)
    parts = []
    if node or used:
        where = f"node {node['ip'].strip()}" if node else "its node"
        if used:
            where += f" at {used['used']} / {used['total']} ({float(used['frac']):.2f})"
        if limit:
            fraction = float(limit["fraction"]) if "fraction" in limit.groupdict() else float(limit["percent"]) / 100
            where += f", over the memory usage threshold {fraction:.2f}"
        parts.append(where)
    if worker:
        parts.append(f"the worker used {worker['worker']}")
    return "killed by Ray's memory monitor (raylet)" + (f": {'; '.join(parts)}" if parts else "")
