"""Split finished rollouts into what the driver keeps (metadata) and what only trainer ranks read
(token data). The rollout actor returns both separately; the driver's buffer, failure log,
staleness rule, advantages and packing plan run on :class:`rlcore.types.GroupMeta` alone."""

from __future__ import annotations

from rlcore.algo.distill import teacher_sums
from rlcore.types import Group, GroupMeta, Sample, SampleMeta


def sample_meta(index: int, s: Sample) -> SampleMeta:
    """The metadata of sample `index` of its group (teacher sums when it carries teacher logprobs)."""
    teacher = None if s.teacher_logprobs is None else teacher_sums(s.logprobs, s.teacher_logprobs, s.loss_mask)
    policy = [v for v, m in zip(s.versions, s.loss_mask) if m]
    return SampleMeta(
        index=index,
        reward=float(s.reward),
        prompt_len=len(s.prompt_ids),
        completion_len=len(s.completion_ids),
        loss_tokens=int(sum(s.loss_mask)),
        min_version=min(policy, default=2**62),
        max_version=max(policy, default=-1),
        finish_reason=s.finish_reason,
        failed=s.failed,
        error=s.error,
        env_output=s.env_output if s.failed else "",
        prefix_breaks=s.prefix_breaks,
        teacher_sums=teacher,
    )


def samples_meta(samples: list[Sample]) -> list[SampleMeta]:
    return [sample_meta(i, s) for i, s in enumerate(samples)]


def group_meta(group: Group, data=None) -> GroupMeta:
    """`group` as the driver holds it, its token data at handle `data`."""
    return GroupMeta(
        task=group.task,
        samples=samples_meta(group.samples),
        data=data,
        request_id=group.request_id,
        stream_index=group.stream_index,
        env_stats=group.env_stats,
    )
