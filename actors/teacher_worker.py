"""The teacher actor of on-policy distillation (`actors.teacher` places it and drives it): one
engine that scores the student's finished samples read from the object store, and the
helpers that pair samples with the logprobs it returns."""

from __future__ import annotations

import torch

from actors.logs import redirect_output
from rlcore.algo.distill import teacher_sums
from rlcore.algo.span_align import align, retokenize
from rlcore.config import RunConfig
from rlcore.engine.registry import make_engine, prestart_engine
from rlcore.models.tokenizer_build import build_tokenizer
from rlcore.plan.teacher import teacher_run_config, tokenizer_fingerprint
from rlcore.report.busy import BusyClock
from rlcore.types import Sample


class TeacherWorker:
    """One teacher engine. `score` scores whole groups read from the object store (see there)."""

    def __init__(self, cfg: RunConfig, index: int):
        redirect_output(cfg.output_dir, "teacher", index)
        prestart_engine(cfg.teacher)  # first: it overlaps what follows (vLLM: its engine core's imports)
        self.index = index
        torch.set_num_threads(max(1, int(cfg.teacher.cpus_per_actor)))
        tcfg = teacher_run_config(cfg)
        self.tokenizer = build_tokenizer(tcfg.model)
        self.student_tokenizer = build_tokenizer(cfg.model) if cfg.teacher.cross_tokenizer else None
        if self.student_tokenizer is None and tokenizer_fingerprint(self.tokenizer) != tokenizer_fingerprint(
            build_tokenizer(cfg.model)
        ):
            # a hub teacher is only comparable once loaded (validation compares local ones)
            raise ValueError(f"teacher.path: {cfg.teacher.path}: its tokenizer differs from the student's")
        self.engine = make_engine(tcfg, self.tokenizer, seed=cfg.seed * 1000 + 500 + index)
        self.top_k = cfg.teacher.top_k
        self.clock = BusyClock()

    def ready(self) -> int:
        return self.index

    def score(self, *groups: list[Sample]) -> tuple:
        """Score the token data of n groups (`list[Sample]` each; the caller passes their refs and
        Ray resolves them here) with `.options(num_returns=1 + n)`: return 0 is
        `(cumulative busy seconds, per group [SampleMeta.teacher_sums of each sample], None,
        (straddled, tokens))`, return 1 + i group i's samples carrying `teacher_logprobs` (and
        the teacher's top-k with `teacher.top_k`; failed samples unscored); `straddled` counts
        the completion tokens whose teacher logprob is a straddled segment's share
        (`teacher.cross_tokenizer`; 0 otherwise) out of `tokens`.
        Never raises for a scoring fault (an engine error, logprobs whose count differs from a
        completion's: `attach`, a text the teacher's tokenizer cannot write): return 0 is then
        `(busy seconds, None, one line saying why, None)` and returns 1..n are None, so no error
        object sits unread in the store."""
        try:
            with self.clock.busy():
                if self.student_tokenizer is None:
                    if self.top_k:  # the sampled tokens' logprobs and the top-k at each position
                        scored = self.engine.score_top_k_batch(score_pairs(groups), self.top_k)
                        attach(groups, [lp for lp, _, _ in scored], [(ids, lps) for _, ids, lps in scored])
                    else:
                        attach(groups, self.engine.score_batch(score_pairs(groups)))
                    straddle = (0, sum(len(s.completion_ids) for g in groups for s in g if not s.failed))
                else:
                    straddle = self._score_cross(groups)
        except Exception as exc:
            return (self.clock.seconds(), None, one_line(exc), None), *[None] * len(groups)
        sums = [
            [
                None if s.teacher_logprobs is None else teacher_sums(s.logprobs, s.teacher_logprobs, s.loss_mask)
                for s in g
            ]
            for g in groups
        ]
        return (self.clock.seconds(), sums, None, straddle), *groups

    def _score_cross(self, groups) -> tuple[int, int]:
        """Score the student's text in the teacher's tokens and carry the logprobs back
        (`rlcore.algo.span_align`); returns `(straddled, tokens)`."""
        student, teacher = self.student_tokenizer, self.tokenizer
        scored_samples = [s for g in groups for s in g if not s.failed]
        mapped = [
            retokenize(
                student.decode,
                lambda text: teacher.encode(text, add_special_tokens=False),
                teacher.decode,
                s.prompt_ids,
                s.completion_ids,
                teacher.unk_token_id,
            )
            for s in scored_samples
        ]
        logprobs = self.engine.score_batch([(p, c) for p, c, _, _ in mapped])
        if len(logprobs) != len(mapped):
            raise ValueError(f"teacher returned {len(logprobs)} scored samples for {len(mapped)}")
        straddled = tokens = 0
        aligned = []
        for s, (_, _, s_ends, t_ends), lp in zip(scored_samples, mapped, logprobs):
            q, n = align(s.logprobs, s_ends, lp, t_ends)
            aligned.append(q)
            straddled, tokens = straddled + n, tokens + len(q)
        attach(groups, aligned)
        return straddled, tokens


def score_pairs(groups) -> list[tuple[list[int], list[int]]]:
    """The (prompt, completion) ids of every sample of `groups` (each a `list[Sample]`) the
    teacher must score (failed ones are not)."""
    return [(s.prompt_ids, s.completion_ids) for g in groups for s in g if not s.failed]


def attach(groups, logprobs: list[list[float]], top_k: list[tuple] | None = None) -> None:
    """Give each scored sample of `groups` (each a `list[Sample]`) its teacher logprobs and, with
    `top_k` (one `(ids, logprobs)` pair of [completion, k] arrays per sample), its teacher top-k,
    in `score_pairs` order; ValueError when a count differs from the completion's."""
    wanted = sum(not s.failed for g in groups for s in g)
    if len(logprobs) != wanted or (top_k is not None and len(top_k) != wanted):
        raise ValueError(f"teacher returned {len(logprobs)} scored samples for {wanted}")
    it = iter(logprobs)
    tops = iter(top_k) if top_k is not None else None
    for g in groups:
        for s in g:
            if not s.failed:
                lp = next(it)
                if len(lp) != len(s.completion_ids):
                    raise ValueError(f"teacher returned {len(lp)} logprobs for {len(s.completion_ids)} tokens")
                s.teacher_logprobs = list(lp)
                if tops is not None:
                    ids, top_lp = next(tops)
                    if len(ids) != len(s.completion_ids) or ids.shape != top_lp.shape:
                        raise ValueError(
                            f"teacher returned top-k of shapes {ids.shape} / {top_lp.shape} "
                            f"for {len(s.completion_ids)} tokens"
                        )
                    s.teacher_top_k_ids, s.teacher_top_k_logprobs = ids, top_lp


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (a failure reason)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
