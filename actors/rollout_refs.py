"""Refs, not data, through the driver: a generate request streams each group's metadata and token
data as separate objects that the driver owns (`RolloutWorker.generate_stream`, read by
`actors.rollout_stream`). The driver fetches the metadata only; trainer ranks fetch the token
data of their own samples (`actors.trainer.TrainerRank.train_step`).

Because the caller owns the return objects of a task, token data sitting in the object store
outlives the rollout actor that made it (Ray's ownership model: the value lives in the node's
object store, its metadata at the owner); an actor restart loses none of it, but for a group
the actor had just sent when it was killed: Ray can leave the actor's error in its place, and the
trainer ranks count that group lost (`actors.trainer.fetch_token_data`).

The driver reads token data in one bounded place only, with a timeout: the samples table every
`logger.samples_every` steps (`table_rows`), the groups shown only. On-policy distillation's
teacher actors read the groups' token data themselves and return the scored groups as new
objects the driver owns (`actors.teacher_worker.TeacherWorker.score`); evaluation rounds take metadata
only (`RolloutWorker.generate_meta`), and a checkpoint's put-back needs the tasks only.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import ray

from rlcore.report import samples
from rlcore.report.failures import FailedExample
from rlcore.types import GroupMeta

log = logging.getLogger("rlcore")


def table_rows(
    batch: list[GroupMeta],
    decode: Callable[[list[int]], str],
    limit: int,
    timeout_s: float,
    trainer_logprobs: dict | None = None,
    failed: list[FailedExample] = (),
) -> list[dict[str, Any]] | None:
    """The samples table's rows (`rlcore.report.samples.sample_rows`, with the trainer logprobs
    read from the ranks after the step, `TrainerGroup.last_step_logprobs`), then the `failed` samples' rows (`samples.failed_rows`), fetching the
    token data of the groups shown only (at most `limit` + the examples'); None, with a warning,
    when it cannot be read in time: a table is never worth failing a run for."""

    def fetch(refs: list) -> list:
        return ray.get(refs, timeout=timeout_s)

    try:
        return samples.sample_rows(batch, decode, limit, fetch, trainer_logprobs) + samples.failed_rows(
            list(failed), decode, fetch
        )
    except ray.exceptions.RayError as exc:
        log.warning("samples table skipped: token data not readable (%s)", type(exc).__name__)
        return None


def log_sample_nodes(
    batch: list[GroupMeta], rollout_nodes: list[str], trainer_nodes: list[str], timeout_s: float = 10.0
) -> None:
    """One line saying which nodes hold the batch's token data (Ray's object directory,
    `ray.experimental.get_object_locations`). The rollout actors made it on their nodes; once the
    trainer ranks have read it, a trainer node that runs no rollout actor holds a copy only if
    the data crossed raylets through the object store."""
    refs = [g.data for g in batch if g.data is not None]
    try:
        where = ray.experimental.get_object_locations(refs, timeout_ms=int(timeout_s * 1000))
    except ray.exceptions.RayError as exc:  # a log line is never worth failing a run for
        log.warning("sample locations not readable (%s)", type(exc).__name__)
        return
    held = {n for loc in where.values() for n in loc.get("node_ids") or []}
    copied = sorted(held & set(trainer_nodes) - set(rollout_nodes))

    def ids(nodes) -> str:
        return ", ".join(n[:8] for n in sorted(set(nodes))) or "none"

    log.info(
        "samples in the object store: %d groups' token data (%d bytes), made on rollout node(s) %s, held on "
        "node(s) %s; trainer on node(s) %s: %s",
        len(refs),
        sum(loc.get("object_size") or 0 for loc in where.values()),
        ids(rollout_nodes),
        ids(held),
        ids(trainer_nodes),
        f"copied across raylets to {ids(copied)}"
        if copied
        else "no copy on a trainer-only node"
        if held
        else "inlined in their owner, the driver (objects under Ray's max_direct_call_object_size, 100 KiB by "
        "default, skip the object store)",
    )
