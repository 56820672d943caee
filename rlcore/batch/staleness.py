"""The staleness rule, in one place: how far behind the trainer a sample's policy may be.

A group whose oldest policy token came from engine version ``m`` may be trained by the step that
updates version ``v`` only if ``v - m <= max_off_policy_steps`` (`algo.max_off_policy_steps`;
0 is the synchronous schedule). Everything else follows from it: which buffered groups are
dropped (`RolloutBuffer`), how many groups the driver keeps generating (enforced at launch, so
nothing is generated only to be dropped), the buffer's capacity, and the most sequences an
engine holds at once (the memory plan)."""

from __future__ import annotations


def is_stale(train_version: int, min_version: int, max_off_policy_steps: int) -> bool:
    """True if a group whose oldest token is from `min_version` may not be trained at
    `train_version`: ``train_version - min_version > max_off_policy_steps``."""
    return train_version - min_version > max_off_policy_steps


def groups_allowed_in_flight(
    steps_synced: int, batches_started: int, max_off_policy_steps: int, batch_groups: int
) -> int:
    """Groups that may be generating or buffered now. A group launched after `steps_synced`
    syncs is trained by a step ``s >= batches_started`` and must satisfy
    ``s - steps_synced <= max_off_policy_steps``, so only the batches of steps up to
    ``steps_synced + max_off_policy_steps`` may be in flight:
    ``max(0, (steps_synced + max_off_policy_steps + 1 - batches_started) * batch_groups)``."""
    return max(0, (steps_synced + max_off_policy_steps + 1 - batches_started) * batch_groups)


def most_groups_in_flight(max_off_policy_steps: int, batch_groups: int) -> int:
    """The most groups the launch rule ever allows at once (right after a sync, no batch of the
    next step taken): ``(max_off_policy_steps + 1) * batch_groups``."""
    return (max_off_policy_steps + 1) * batch_groups
