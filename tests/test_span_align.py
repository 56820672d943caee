"""Cross-tokenizer distillation's span alignment (rlcore/algo/span_align.py), Ray-free: exact on
hand-built cases, and a teacher that is the student's own distribution under another tokenizer
gives a reverse KL of 0."""

from __future__ import annotations

import math

import pytest

from rlcore.algo.span_align import align, retokenize, segments, token_ends
from rlcore.models.tokenizer import BPE_VOCAB_SIZE, bpe_tokenizer, char_tokenizer


def test_the_builtin_bpe_is_the_same_in_every_build_and_round_trips():
    a, b = bpe_tokenizer(), bpe_tokenizer()
    assert a.get_vocab() == b.get_vocab() and len(a) == BPE_VOCAB_SIZE
    assert (a.pad_token_id, a.bos_token_id, a.eos_token_id) == (0, 1, 2)
    ids = a.encode("qwerty fox<|im_end|>", add_special_tokens=False)
    assert a.decode(ids) == "qwerty fox<|im_end|>" and len(ids) < len("qwerty fox") + 1


def test_token_ends_hand_built():
    pieces = {1: "ab", 2: "c", 3: "", 4: "de"}
    assert token_ends(lambda ids: "".join(pieces[i] for i in ids), [1, 2, 3, 4]) == ([2, 3, 3, 5], "abcde")


def test_a_byte_piece_inside_a_character_takes_the_end_of_the_token_completing_it():
    tok = bpe_tokenizer()
    ids = tok.encode("é!", add_special_tokens=False)  # é is two bytes: two byte tokens before '!'
    ends, text = token_ends(tok.decode, ids)
    assert text == "é!" and len(ids) == 3 and ends == [1, 1, 2]


@pytest.mark.parametrize(
    "student, teacher, want",
    [
        ([2, 4], [2, 4], [([0], [0]), ([1], [1])]),  # same boundaries: one-to-one
        ([3], [1, 2, 3], [([0], [0, 1, 2])]),  # one student token covers three
        ([1, 2, 3], [3], [([0, 1, 2], [0])]),  # one teacher token straddles three
        ([2, 4], [1, 3, 4], [([0, 1], [0, 1, 2])]),  # teacher token 1 straddles 'ab|cd'
        ([1, 3, 5, 6], [2, 3, 4, 6], [([0, 1], [0, 1]), ([2, 3], [2, 3])]),  # straddles chain, then close
    ],
)
def test_segments_hand_built(student, teacher, want):
    assert segments(student, teacher) == want


def test_align_sums_covered_teacher_tokens_and_shares_a_straddled_segment():
    # student 'ab|c|de' ends [2, 3, 5], s = [-1, -2, -3]; teacher 'a|b|cd|e' ends [1, 2, 4, 5],
    # r = [-0.1, -0.2, -0.3, -0.4]. Segments: ([0], [0, 1]) -> q_0 = -0.1 + -0.2 = -0.3 exactly;
    # ([1, 2], [2, 3]) (teacher 'cd' straddles 'c|de'): Q = -0.7, S = -5, share (Q - S)/2 = 2.15:
    # q_1 = -2 + 2.15 = 0.15, q_2 = -3 + 2.15 = -0.85 (q_1 + q_2 = Q)
    q, straddled = align([-1.0, -2.0, -3.0], [2, 3, 5], [-0.1, -0.2, -0.3, -0.4], [1, 2, 4, 5])
    assert q == pytest.approx([-0.3, 0.15, -0.85]) and straddled == 2


def test_texts_of_different_lengths_are_an_error():
    with pytest.raises(ValueError, match="3 characters, the teacher's 4"):
        segments([1, 3], [4])


def char_logprob(text: str) -> float:
    """An i.i.d. character distribution: p(c) proportional to 1 + ord(c) % 7."""
    z = sum(1 + c % 7 for c in range(32, 127))
    return sum(math.log((1 + ord(c) % 7) / z) for c in text)


@pytest.mark.parametrize("student_is_bpe", [True, False])
def test_the_same_distribution_under_another_tokenizer_gives_a_reverse_kl_of_zero(student_is_bpe):
    # one side byte-level BPE, the other the char tokenizer; both the same distribution over text
    # (a token's logprob is the logprob of the characters it adds), so every q_t = s_t and the
    # per-token reverse KL s_t - q_t is 0, straddled segments (a BPE teacher's tokens over
    # several characters of a char student) included
    bpe, char = bpe_tokenizer(), char_tokenizer()
    student, teacher = (bpe, char) if student_is_bpe else (char, bpe)
    prompt = student.encode("reverse the text: ", add_special_tokens=False)
    completion = student.encode("dlrow olleh, the fox jumps<|im_end|>", add_special_tokens=False)
    s_ends, text = token_ends(student.decode, completion)
    s = [char_logprob(text[a:b]) for a, b in zip([0] + s_ends[:-1], s_ends)]
    t_prompt, t_completion, s_ends2, t_ends = retokenize(
        student.decode, lambda x: teacher.encode(x, add_special_tokens=False), teacher.decode, prompt, completion
    )
    assert s_ends2 == s_ends and teacher.decode(t_prompt) == "reverse the text: "
    assert (len(t_completion) > len(completion)) == student_is_bpe  # chars: more tokens than the BPE's
    r = [char_logprob(text[a:b]) for a, b in zip([0] + t_ends[:-1], t_ends)]
    q, straddled = align(s, s_ends, r, t_ends)
    assert max(abs(a - b) for a, b in zip(s, q)) < 1e-9
    # a char teacher never straddles a BPE student's boundary; a BPE teacher straddles a char one's
    assert (straddled == 0) == student_is_bpe


def test_a_character_the_teacher_cannot_write_becomes_its_unknown_token():
    # 'h\x18é!' from the BPE student: the char teacher writes neither '\x18' nor 'é'; each becomes
    # <|unk|> over its one character, the runs around them are encoded apart
    char, bpe = char_tokenizer(), bpe_tokenizer()
    completion = bpe.encode("h\x18é!", add_special_tokens=False)
    _, t_ids, s_ends, t_ends = retokenize(
        bpe.decode, lambda x: char.encode(x, add_special_tokens=False), char.decode, [], completion, char.unk_token_id
    )
    assert t_ids == [char.convert_tokens_to_ids(c) for c in "h"] + [char.unk_token_id] * 2 + [
        char.convert_tokens_to_ids("!")
    ]
    assert t_ends == [1, 2, 3, 4] and s_ends[-1] == 4
    with pytest.raises(ValueError, match="no unknown token"):
        retokenize(bpe.decode, lambda x: char.encode(x, add_special_tokens=False), char.decode, [], completion)


def test_a_char_teacher_scores_a_bpe_students_text_and_the_sums_telescope():
    # the teacher worker's cross-tokenizer path on a real (random-weight, char-level) hf engine:
    # the student's BPE sample is scored in the teacher's char tokens, carried back one logprob
    # per student token, and they add up to the teacher's logprob of the whole completion text
    from actors.teacher import TeacherWorker
    from rlcore.engine.registry import make_engine
    from rlcore.plan.compose import compose
    from rlcore.plan.teacher import teacher_run_config
    from rlcore.report.busy import BusyClock
    from rlcore.types import Sample

    cfg = compose(["teacher.enabled=true", "teacher.cross_tokenizer=true"])
    worker = object.__new__(TeacherWorker)  # its engine and tokenizers, without Ray's redirected logs
    worker.tokenizer, worker.student_tokenizer, worker.clock = char_tokenizer(), bpe_tokenizer(), BusyClock()
    worker.engine = make_engine(teacher_run_config(cfg), worker.tokenizer, seed=1)
    student = worker.student_tokenizer
    prompt = student.encode("reverse the text: fox", add_special_tokens=False)
    completion = student.encode("xof the<|im_end|>", add_special_tokens=False)
    s = Sample(prompt, completion, [-1.0] * len(completion), [0] * len(completion), [1] * len(completion))
    (busy, sums, error, straddle), out = worker.score([s])
    assert error is None and straddle == (0, len(completion))  # a char teacher never straddles
    q = out[0].teacher_logprobs
    char = worker.tokenizer
    whole = worker.engine.score(
        char.encode("reverse the text: fox", add_special_tokens=False),
        char.encode("xof the<|im_end|>", add_special_tokens=False),
    )
    assert len(q) == len(completion) < len(whole) and sum(q) == pytest.approx(sum(whole), abs=1e-4)
    assert sums[0][0][0] == pytest.approx(sum(s.logprobs) - sum(whole), abs=1e-4)
