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
    bounded (see rlcore.envs.safety.OUTPUT_LIMIT); never sent to the console or Ray's logs."""
    images: list[Any] = field(default_factory=list)
    """The prompt's images as uint8 [H, W, 3] arrays (vision-language policies), in the order of
    their image-token runs in `prompt_ids`."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's teacher-forced logprob of each completion token
    (set by the teacher stage before the buffer; None without a teacher)."""
    prefix_breaks: int = 0
    """Turns of a multi-turn episode whose fresh chat-template rendering would not have continued
    the previous turn's exact ids (the recorded ids were spliced instead; see
    `rlcore.serving.openai_server`)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def min_version(self) -> int:
        """Version of the oldest policy token (the staleness of the sample)."""
        policy = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(policy) if policy else 2**62


@dataclass
class Group:
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

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]
