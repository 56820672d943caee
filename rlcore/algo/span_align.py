"""Cross-tokenizer distillation, Ray-free: carry a teacher's per-token logprobs, computed on its own
tokenization of the student's text, back to the student's tokens by character spans.

Each token covers the characters it adds to the decoded text: token ``k`` of ``ids`` ends at
``e_k = len(decode(ids[:k+1]))``. A token that ends inside a character (a byte-level BPE piece of a
multi-byte UTF-8 character) covers nothing yet: it takes the end of the first later token that
completes the character (:func:`token_ends`).

Alignment (:func:`align`): the two end sequences over the same text are cut into *segments*, the
shortest runs of student tokens and teacher tokens that end at the same character. Within a
segment ``g`` with student tokens ``S_g`` (behaviour logprobs ``s_k``) and teacher tokens ``T_g``
(logprobs ``r_i``)::

    Q_g = sum_{i in T_g} r_i                the teacher's logprob of the segment's text
    q_k = s_k + (Q_g - sum_{k' in S_g} s_k') / |S_g|      for k in S_g

A segment with one student token gives it exactly the sum of the teacher tokens it covers
(``q_k = Q_g``). A segment with several student tokens exists because a teacher token straddles
a student boundary: the teacher has no logprob for the parts, so the segment's log-ratio
``Q_g - S_g`` is shared equally among its student tokens (those are counted as *straddled*). Either
way ``sum_k q_k`` over a segment is ``Q_g``: summed over a completion, ``sum_k (s_k - q_k)`` is
exactly the sequence-level estimate ``log p_student(text) - log p_teacher(text)``, so
``teacher_kl`` keeps its meaning; only the split among a straddled segment's tokens is a choice.
"""

from __future__ import annotations

from typing import Callable, Sequence


def token_ends(decode: Callable[[list[int]], str], ids: Sequence[int]) -> tuple[list[int], str]:
    """``(ends, text)``: each token's end offset in ``text = decode(ids)`` (non-decreasing; a token
    ending inside a character takes the end of the token that completes it). O(n^2) decoding:
    completions are short next to a model call."""
    ids = list(ids)
    text = decode(ids)
    ends: list[int | None] = []
    for k in range(len(ids)):
        prefix = decode(ids[: k + 1])
        ends.append(len(prefix) if text.startswith(prefix) and "\ufffd" not in prefix[-1:] else None)
    out, nxt = [0] * len(ids), len(text)
    for k in range(len(ids) - 1, -1, -1):
        if ends[k] is not None:
            nxt = ends[k]
        out[k] = nxt
    return out, text


def segments(student_ends: Sequence[int], teacher_ends: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The segments of two tokenizations of one text (see the module docstring): a list of
    ``(student token indices, teacher token indices)``; ValueError when the texts' lengths differ."""
    n, m = len(student_ends), len(teacher_ends)
    if (student_ends[-1] if n else 0) != (teacher_ends[-1] if m else 0):
        raise ValueError(
            f"span_align: the student's text has {student_ends[-1] if n else 0} characters, "
            f"the teacher's {teacher_ends[-1] if m else 0}"
        )
    out, i, j = [], 0, 0
    while i < n:
        seg_s, seg_t, end = [i], [], student_ends[i]
        i += 1
        while True:
            while i < n and student_ends[i] <= end:  # tokens adding no character end here too
                seg_s.append(i)
                i += 1
            while j < m and teacher_ends[j] <= end:
                seg_t.append(j)
                j += 1
            if j == m or (seg_t and teacher_ends[seg_t[-1]] == end):
                break
            # teacher token j straddles: it ends past the segment, which grows to its end
            seg_t.append(j)
            end = teacher_ends[j]
            j += 1
            while i < n and student_ends[i] <= end:
                seg_s.append(i)
                i += 1
            if student_ends[seg_s[-1]] == end:
                continue  # absorb teacher tokens ending exactly here, then close
            seg_s.append(i)  # student token i straddles the new end in turn
            end = student_ends[i]
            i += 1
        out.append((seg_s, seg_t))
    if j < m:  # teacher tokens adding no character at the very end
        if not out:
            raise ValueError("span_align: teacher tokens for an empty student completion")
        out[-1][1].extend(range(j, m))
    return out


def align(
    student_logprobs: Sequence[float],
    student_ends: Sequence[int],
    teacher_logprobs: Sequence[float],
    teacher_ends: Sequence[int],
) -> tuple[list[float], int]:
    """``(q, straddled)``: the teacher logprob of each student token (module docstring) and how
    many student tokens share a straddled segment's log-ratio."""
    if len(student_logprobs) != len(student_ends) or len(teacher_logprobs) != len(teacher_ends):
        raise ValueError("span_align: one logprob per token is needed on both sides")
    q = [0.0] * len(student_logprobs)
    straddled = 0
    for seg_s, seg_t in segments(student_ends, teacher_ends):
        share = (sum(teacher_logprobs[i] for i in seg_t) - sum(student_logprobs[k] for k in seg_s)) / len(seg_s)
        for k in seg_s:
            q[k] = student_logprobs[k] + share
        if len(seg_s) > 1:
            straddled += len(seg_s)
    return q, straddled


def teacher_tokens(
    encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], unk_id: int | None, text: str
) -> tuple[list[int], list[int]]:
    """``(ids, ends)``: ``text`` in the teacher's tokens, each token's end offset in ``text``. A
    character the teacher cannot write (``decode(encode(c)) != c``: a control byte, a broken
    UTF-8 sequence the student decoded to U+FFFD) becomes the teacher's unknown token over that one
    character, so the teacher still scores the sample and its (low) logprob of ``unk`` is what
    the student's token that wrote the character is pushed by; the runs between such characters
    are encoded apart. ValueError when such a character occurs and the teacher has no unknown
    token, or when a run does not decode back to itself."""
    writable: dict[str, bool] = {}
    runs, start = [], 0
    for k, c in enumerate(text):
        if c not in writable:
            writable[c] = decode(encode(c)) == c
        if not writable[c]:
            if unk_id is None:
                raise ValueError(f"span_align: the teacher's tokenizer cannot write {c!r} and has no unknown token")
            runs += [(start, k, False), (k, k + 1, True)]
            start = k + 1
    runs.append((start, len(text), False))
    ids: list[int] = []
    ends: list[int] = []
    for a, b, unknown in runs:
        if unknown:
            ids.append(unk_id)
            ends.append(b)
        elif b > a:
            run_ids = encode(text[a:b])
            run_ends, run_text = token_ends(decode, run_ids)
            if run_text != text[a:b]:
                raise ValueError(
                    f"span_align: the teacher's tokenizer does not round-trip the student's text "
                    f"({text[a:b][:40]!r} -> {run_text[:40]!r})"
                )
            ids += run_ids
            ends += [a + e for e in run_ends]
    return ids, ends


def retokenize(
    student_decode: Callable[[list[int]], str],
    teacher_encode: Callable[[str], list[int]],
    teacher_decode: Callable[[list[int]], str],
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    teacher_unk_id: int | None = None,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The student's sample in the teacher's tokens: ``(teacher prompt ids, teacher completion
    ids, student ends, teacher ends)`` (:func:`teacher_tokens` for each). Prompt and completion
    are encoded apart, so the completion starts on a teacher token boundary."""
    student_ends, text = token_ends(student_decode, completion_ids)
    t_prompt, _ = teacher_tokens(teacher_encode, teacher_decode, teacher_unk_id, student_decode(list(prompt_ids)))
    t_completion, teacher_ends = teacher_tokens(teacher_encode, teacher_decode, teacher_unk_id, text)
    return t_prompt, t_completion, student_ends, teacher_ends
