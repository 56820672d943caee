"""Why samples failed: first occurrences logged, counts per step, and a liveness stop.

The driver feeds every finished generate request here (:meth:`FailureLog.request_done`; or its
groups as they arrive, :meth:`FailureLog.groups_done`, then :meth:`FailureLog.request_finished`;
:meth:`FailureLog.request_lost` for samples that never came back). A failure's *reason* is the
first line of the sample's error (`reward: ValueError: boom`, `env_response: timeout after 2s`,
`engine: RayActorError`), cut to `REASON_CHARS`. The first time a reason is seen it is logged once,
with a task id and the first lines of what the environment printed; after that it is only
counted: :meth:`FailureLog.step_metrics` gives `failed_by_reason` (this step's counts) and
`reward_threads_abandoned` (summed over rollout actors).

Examples: the first `EXAMPLES_PER_REASON` failed samples of each reason since the last
:meth:`FailureLog.take_examples` are kept (:class:`FailedExample`: the task, the group's token
data handle, the error) for the samples table (`rlcore.report.samples.failed_rows`), so the live
page can show failed samples by reason; a lost request's examples have no completion.

Liveness: after `stop_after` requests in a row whose every sample failed, :meth:`check` raises
:class:`NoProgress` naming the most frequent reason of that streak. "In a row" is launch order
(each request's `seq`), not the order requests happen to finish in: results that finish early
wait until every request launched before them is in, so which requests form a streak is a
function of the data order, never of how fast one reward is against another.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

from rlcore.types import GroupMeta, Task

log = logging.getLogger("rlcore")
REASON_CHARS = 160
MAX_REASONS = 64  # distinct reasons kept per step; the rest count as "other"
EXAMPLES_PER_REASON = 2  # failed samples kept per reason between two samples tables
MAX_EXAMPLES = 16  # and in all (reasons are many only when something is badly wrong)


@dataclass
class FailedExample:
    """One failed sample kept for the samples table."""

    reason: str
    """Its bucket (:func:`reason_of`)."""
    error: str
    """The error's first 500 characters."""
    task: Task | None = None
    """Its task (None: a whole lost request, whose tasks the log does not see)."""
    group: GroupMeta | None = None
    """Its group, whose token data holds the completion (None: nothing came back)."""
    index: int = -1
    """The sample's index in its group."""


class NoProgress(RuntimeError):
    """Every sample of the last N requests failed."""


def reason_of(error: str | None) -> str:
    """The bucket a failure counts under: the error's first line, bounded, with every run of
    digits written `#` (messages that embed a task id or a count fall in one bucket)."""
    first = (error or "unknown error").strip().splitlines()
    return re.sub(r"\d+", "#", first[0] if first else "unknown error")[:REASON_CHARS]


class FailureLog:
    def __init__(self, stop_after: int):
        """`stop_after`: all-failed requests in a row that stop the run (0 = never)."""
        self.stop_after = stop_after
        self.seen: set[str] = set()
        self.step_counts: Counter[str] = Counter()
        self.streak = 0
        self.streak_counts: Counter[str] = Counter()
        self.threads_by_actor: dict[int, float] = {}
        self.next_seq: int | None = None
        """Launch number of the next request the streak takes (None: take them as they come)."""
        self._waiting: dict[int, tuple[bool, Counter[str]]] = {}  # finished before an earlier one
        self.examples: list[FailedExample] = []
        """Failed samples kept since the last `take_examples` (`EXAMPLES_PER_REASON` per reason)."""

    def resume_at(self, seq: int) -> None:
        """The next request to be launched has number `seq` (0, or a resumed run's count)."""
        self.next_seq = seq

    def discard(self) -> None:
        """Forget every count not yet in a logged row and the streak: a trainer restart goes back
        to a checkpoint whose accounting has none of those failures (their rows are cut back and
        their tasks generated again), so the next row's `failed_by_reason` must not carry them.
        Results of requests whose launch number a restart hands out again are forgotten too."""
        self.step_counts = Counter()
        self.streak, self.streak_counts = 0, Counter()
        self._waiting.clear()
        self.examples = []

    def _keep(self, example: FailedExample) -> None:
        if (
            len(self.examples) < MAX_EXAMPLES
            and sum(e.reason == example.reason for e in self.examples) < EXAMPLES_PER_REASON
        ):
            self.examples.append(example)

    def take_examples(self) -> list[FailedExample]:
        """The failed samples kept since the last call (then forgotten: their handles too)."""
        out, self.examples = self.examples, []
        return out

    def _count(self, reason: str, n: int, request: Counter[str]) -> None:
        if reason not in self.step_counts and len(self.step_counts) >= MAX_REASONS:
            reason = "other"
        self.step_counts[reason] += n
        request[reason] += n

    def _first(self, reason: str, message: str, task_id: str, output: str) -> None:
        """Log a reason the first time it is seen, with the first occurrence's own message."""
        if reason in self.seen:
            return
        self.seen.add(reason)
        printed = ""
        if output.strip():
            lines = output.strip().splitlines()
            printed = f"; it printed ({len(output)} chars kept): " + " | ".join(lines[:3])[:300]
        log.warning("sample failed (first of its kind) on task %s: %s%s", task_id, message, printed)

    def request_done(self, groups: list[GroupMeta], actor: int, seq: int | None = None) -> None:
        """Count a finished request's failed samples; update the all-failed streak with it in
        launch order (`seq`, the request's launch number)."""
        total, failed, reasons = self.groups_done(groups, actor)
        self.request_finished(seq, total > 0 and failed == total, reasons)

    def groups_done(self, groups: list[GroupMeta], actor: int) -> tuple[int, int, Counter[str]]:
        """Count the failed samples of `groups` (a request delivers its groups as they are
        scored): (samples, failed samples, failed samples by reason). The request's streak
        result comes with `request_finished`."""
        total = failed = 0
        reasons: Counter[str] = Counter()
        for g in groups:
            if g.env_stats:
                self.threads_by_actor[actor] = g.env_stats.get("reward_threads_abandoned", 0)
            for i, s in enumerate(g.samples):
                total += 1
                if s.failed:
                    failed += 1
                    reason = reason_of(s.error)
                    self._first(reason, (s.error or "").strip()[:500], g.task.id, s.env_output)
                    self._count(reason, 1, reasons)
                    # a SampleMeta knows its index in the group's token data; a whole Sample is at i
                    self._keep(FailedExample(reason, (s.error or "").strip()[:500], g.task, g, getattr(s, "index", i)))
        return total, failed, reasons

    def request_finished(self, seq: int | None, all_failed: bool, reasons: Counter[str]) -> None:
        """A request whose groups are all counted (`groups_done`, or lost: `request_lost(...,
        streak=False)`) ends: `all_failed` (no sample of it succeeded) joins the streak in launch
        order, with its failed samples by `reasons`."""
        self._in_order(seq, all_failed, reasons)

    def request_lost(
        self,
        samples: int,
        why: str,
        detail: str = "",
        streak: bool = True,
        seq: int | None = None,
        task: Task | None = None,
    ) -> Counter[str]:
        """A request that never returned (its actor died, it timed out): all its samples failed.
        `why` is the bucket (`engine: ActorDiedError`), `detail` the message logged the first time;
        `streak=False` counts them without touching the all-failed streak of generate requests;
        `task`: one of its tasks (the prompt its example row shows). Returns them by reason."""
        reason = reason_of(why)
        self._first(reason, f"{why}: {detail.strip()[:500]}" if detail else why, "(whole request)", "")
        reasons: Counter[str] = Counter()
        self._count(reason, samples, reasons)
        self._keep(FailedExample(reason, (f"{why}: {detail.strip()}" if detail else why)[:500], task))
        if streak:
            self._in_order(seq, True, reasons)
        return reasons

    def request_withdrawn(self, seq: int | None) -> None:
        """A request taken back before it answered (its tasks went to another engine): neither a
        failure nor a success; the requests launched after it take their turn in the streak."""
        self._in_order(seq, None, Counter())

    def _in_order(self, seq: int | None, all_failed: bool | None, reasons: Counter[str]) -> None:
        """Apply a request's result to the streak once every request launched before it is in
        (`all_failed` None: a withdrawn request, which leaves the streak as it is)."""
        if seq is None or self.next_seq is None:
            if all_failed is not None:
                self._streak(all_failed, reasons)
            return
        self._waiting[seq] = (all_failed, reasons)
        while self.next_seq in self._waiting:
            done, counts = self._waiting.pop(self.next_seq)
            if done is not None:
                self._streak(done, counts)
            self.next_seq += 1

    def _streak(self, all_failed: bool, reasons: Counter[str]) -> None:
        if all_failed:
            self.streak += 1
            self.streak_counts.update(reasons)
        else:
            self.streak, self.streak_counts = 0, Counter()

    def check(self) -> None:
        """Raise NoProgress when the last `stop_after` requests all failed completely."""
        if self.stop_after and self.streak >= self.stop_after:
            reason, n = self.streak_counts.most_common(1)[0]
            raise NoProgress(
                f"no progress: every sample of the last {self.streak} generate requests failed "
                f"(rollout.stop_after_failed_requests={self.stop_after}); most frequent failure "
                f"({n} samples): {reason}"
            )

    def step_metrics(self) -> dict:
        """This step's `failed_by_reason` (then reset) and the abandoned reward threads."""
        out = {
            "failed_by_reason": dict(self.step_counts.most_common()),
            "reward_threads_abandoned": int(sum(self.threads_by_actor.values())),
        }
        self.step_counts = Counter()
        return out
