"""A checkpoint's read of the engines' RNG states (`RolloutGroup.rng_states`), one of the run's
named waits: every serving engine is asked at once; the stall watcher is asked every second while
it waits (a frozen engine is taken out as a stall, `RolloutGroup.watch`, with its own line, and
saved as None); a line names the engines still awaited after `WAIT_NOTICE_S`; one dead, or silent
past the deadline (`checkpoint.timeout_s`), is saved as None too. A checkpoint never stops the
run for an engine's RNG state: a restarted or resumed engine keeps its own seed."""

from __future__ import annotations

import logging
import time

import ray

from actors.remote import died, forget
from actors.stall_watch import BEFORE_SYNC_S, WAIT_NOTICE_S

log = logging.getLogger("rlcore")


def read_rng_states(group, timeout_s: float) -> list:
    """`group` (a `RolloutGroup`): each actor's engine RNG state, None where none was read."""
    states: list = [None] * len(group.handles)
    pending = {i: group.handles[i].rng_state.remote() for i in group.serving}
    start = time.monotonic()
    deadline, said = start + timeout_s, False
    while pending and time.monotonic() < deadline:
        refs = list(pending.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        done = {r.binary() for r in ready}
        for i, ref in list(pending.items()):
            if ref.binary() not in done:
                continue
            del pending[i]
            try:
                states[i] = ray.get(ref, timeout=0)
            except ray.exceptions.RayError as exc:
                if not died(exc):
                    raise
                # died since it was last seen serving (a node lost mid-checkpoint)
                log.warning(
                    "checkpoint: engine RNG state of rollout actor %d not kept: it died (%s); its "
                    "restart keeps its own seed",
                    i,
                    str(exc).splitlines()[0][:160],
                )
        for i in group.watch(BEFORE_SYNC_S):  # frozen: a stall (its own line), kept as missing
            if i in pending:
                forget([pending.pop(i)])
                log.warning(
                    "checkpoint: engine RNG state of rollout actor %d on node %s not kept: it made no "
                    "progress; the checkpoint goes on without it",
                    i,
                    group.node_of(i),
                )
        if pending and not said and time.monotonic() - start >= WAIT_NOTICE_S:
            said = True
            log.warning(
                "checkpoint: waiting for the engine RNG state of %s (up to %.0fs more, "
                "checkpoint.timeout_s; a frozen engine is left out after %.0fs without a heartbeat)",
                ", ".join(f"rollout actor {i} on node {group.node_of(i)}" for i in pending),
                max(0.0, deadline - time.monotonic()),
                BEFORE_SYNC_S,
            )
    if pending:
        forget(list(pending.values()))
        log.warning(
            "checkpoint: engine RNG state of %s not kept: no answer within %.0fs (checkpoint.timeout_s); "
            "the checkpoint goes on without it",
            ", ".join(group.names(list(pending))),
            timeout_s,
        )
    return states
