"""Data that flows through one RL step: tasks in, scored groups of samples out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Task:
    """One prompt of an environment, with what its reward functions need to score it."""

    id: str
    """Stable identifier (environment name + index), used for logging and data order checks."""
    messages: list[dict[str, Any]]
    """Chat messages rendered through the tokenizer's chat template."""
    answer: Any = None
    """Reference answer handed to the reward function."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything else the environment needs (difficulty, split, files)."""
    images: list[Any] = field(default_factory=list)
    """Images the prompt shows, in the order of their placeholders in `messages` (uint8 [H, W, 3]
    arrays, PIL images or local file paths; see `rlcore.models.vision`)."""


@dataclass
class Sample:
    """One episode: exact token ids, behaviour logprobs and the policy version of every token."""

    prompt_ids: list[int]
    """Prompt tokens (never re-tokenized)."""
    completion_ids: list[int]
    """Tokens after the prompt: policy tokens and, in multi-turn episodes, environment tokens."""
    logprobs: list[float]
    """Behaviour logprob of each completion token under the distribution it was sampled from
    (0.0 for environment tokens)."""
    versions: list[int]
    """Policy version that produced each completion token (-1 for environment tokens)."""
    loss_mask: list[int]
    """1 where the token was sampled by the policy (trained on), 0 for environment tokens."""
    finish_reason: str = "stop"
    """`stop` (end-of-sequence), `length` (hit max_new_tokens) or `abort`."""
    reward: float = 0.0
    """Scalar reward of the episode."""
    failed: bool = False
    """True when generation or scoring failed; such samples are counted, not trained on."""
    error: str | None = None
    """What failed, when `failed`."""
    env_output: str = ""
    """What the environment printed (stdout and stderr) while serving and scoring this sample,
    bounded (see rlcore.isolation.safety.OUTPUT_LIMIT); never sent to the console or Ray's logs."""
    images: list[Any] = field(default_factory=list)
    """The prompt's images as uint8 [H, W, 3] arrays (vision-language policies), in the order of
    their image-token runs in `prompt_ids`."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's teacher-forced logprob of each completion token
    (set by the teacher stage before the buffer; None without a teacher)."""
    teacher_top_k_ids: Any = None
    """`teacher.top_k`: the teacher's k likeliest next tokens at each completion position, int32
    [len(completion_ids), k], largest first (None otherwise)."""
    teacher_top_k_logprobs: Any = None
    """Their teacher logprobs (temperature 1), float32 [len(completion_ids), k]."""
    prefix_breaks: int = 0
    """Turns of a multi-turn episode whose fresh chat-template rendering would not have continued
    the previous turn's exact ids (the recorded ids were spliced instead; see
    `rlcore.serving.openai_server`)."""
    routed_experts: Any = None
    """Rollout routing replay: the engine's routed experts per token and layer, an integer array
    [prompt + completion - 1, layers, top_k] (layout in `rlcore.batch.routing`); None without replay."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def min_version(self) -> int:
        """Version of the oldest policy token (the staleness of the sample)."""
        policy = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(policy) if policy else 2**62


class GroupScores:
    """What a group of samples (`Sample` or `SampleMeta`) tells the buffer and the advantages."""

    samples: list

    @property
    def min_version(self) -> int:
        """Version of the oldest policy token of the group (its staleness)."""
        return min(s.min_version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass
class Group(GroupScores):
    """The `group_size` samples of one task: the unit advantages are relative to."""

    task: Task
    samples: list[Sample]
    request_id: int = -1
    """Driver-assigned id of the generate request that produced it."""
    stream_index: int = -1
    """Driver-assigned position of the task in the environment's train stream (data order, resume)."""
    env_stats: dict[str, float] = field(default_factory=dict)
    """The rollout actor's environment health when it returned the group
    (`reward_threads_abandoned`: guarded calls that missed their deadline and still run)."""


@dataclass
class SampleMeta:
    """What the driver keeps of one sample: the numbers its bookkeeping needs. The token data
    (ids, logprobs, masks, images) stays in the object store until a trainer rank fetches it."""

    index: int
    """Position of the sample in its group's token data (the rollout actor's sample list)."""
    reward: float
    prompt_len: int
    completion_len: int
    loss_tokens: int
    """`sum(loss_mask)`: tokens the loss trains on (advantage length terms, loss normaliser)."""
    min_version: int
    """`Sample.min_version` (2**62 when the sample has no policy token)."""
    max_version: int = -1
    """Version of the newest policy token (-1 when the sample has none)."""
    finish_reason: str = "stop"
    failed: bool = False
    error: str | None = None
    env_output: str = ""
    """Kept for failed samples only (the failure log shows the first of each reason)."""
    prefix_breaks: int = 0
    teacher_sums: tuple[float, int, float] | None = None
    """On-policy distillation: over the policy tokens, `(sum(s_t - q_t), count, sum(q_t))` of
    behaviour logprob s_t and teacher logprob q_t (`rlcore.algo.distill.reverse_kl_sum`)."""

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.completion_len


@dataclass
class GroupMeta(GroupScores):
    """A finished group as the driver holds it: the task, per-sample metadata and a handle to the
    group's token data (`list[Sample]`, all samples, failed ones included) in the object store."""

    task: Task
    samples: list[SampleMeta]
    data: Any = None
    """The handle of the group's `list[Sample]` (a Ray ObjectRef on the RL path; anything with
    which the caller can fetch the list: rlcore does not import Ray)."""
    request_id: int = -1
    stream_index: int = -1
    env_stats: dict[str, float] = field(default_factory=dict)
