"""CPU checks of the vLLM side's pure parts: canary, update info, per-token version marks.
(The engine itself is covered by tests/gpu/test_vllm_engine.py on the GPU machine.)"""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

from rlcore.engine.vllm.vllm_versions import InFlightRequest, sampled_logprobs
from rlcore.transfer import nccl
from rlcore.transfer.plan import update_info_bytes, update_info_for
from rlcore.weights.canary import (
    CanaryError,
    canary_prompts,
    compare_logprobs,
    teacher_forced_logprobs,
)


def test_canary_passes_small_gaps_and_raises_on_large_or_nan():
    ok = compare_logprobs([[-1.0, -2.0], [-3.0]], [[-1.02, -2.01], [-3.0]])
    assert ok.passed and ok.num_tokens == 3 and math.isclose(ok.max_gap, 0.02, abs_tol=1e-9)
    with pytest.raises(CanaryError, match="max gap 2.0"):
        compare_logprobs([[-1.0, -2.0]], [[-3.0, -2.0]], max_gap=1.0, mean_gap=1.5)
    assert not compare_logprobs([[float("nan")]], [[0.0]], raise_on_fail=False).passed
    bad_mean = compare_logprobs([[-1.0] * 10], [[-1.2] * 10], max_gap=1.0, mean_gap=0.1, raise_on_fail=False)
    assert not bad_mean.passed and bad_mean.worst == (0, 0)
    with pytest.raises(ValueError):
        compare_logprobs([[-1.0]], [[-1.0, -2.0]])


def test_canary_prompts_are_fixed_and_teacher_forcing_matches_a_manual_pass():
    assert canary_prompts(100, 2, 3, 4) == canary_prompts(100, 2, 3, 4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return types.SimpleNamespace(logits=self.m(ids))

    lm = LM()
    got = teacher_forced_logprobs(lm, [([1, 2], [3, 4])], temperature=0.5)[0]
    logits = model(torch.tensor([1, 2, 3, 4])).float() / 0.5
    want = [torch.log_softmax(logits[1], -1)[3].item(), torch.log_softmax(logits[2], -1)[4].item()]
    assert got == pytest.approx(want, abs=1e-5)


def test_update_info_lists_tensors_in_order_with_wire_dtypes():
    info = update_info_for(
        [("a", torch.zeros(3, 4, dtype=torch.bfloat16)), ("b", torch.float32, (5,))], bucket_bytes=100, num_buffers=3
    )
    assert info == dict(
        names=["a", "b"],
        dtype_names=["bfloat16", "float32"],
        shapes=[[3, 4], [5]],
        packed=True,
        packed_buffer_size_bytes=100,
        packed_num_buffers=3,
    )
    assert update_info_bytes(info) == 3 * 4 * 2 + 5 * 4
    with pytest.raises(ValueError):
        update_info_for([])
    with pytest.raises(ValueError, match=r"names\[1\]"):
        nccl._check_same(
            update_info_for([("a", torch.float32, (1,)), ("c", torch.float32, (1,))]),
            update_info_for([("a", torch.float32, (1,)), ("b", torch.float32, (1,))]),
        )


def _out(tokens, finished=False, reason=None):
    lps = [{t: types.SimpleNamespace(logprob=-0.1 * t)} for t in tokens]
    comp = types.SimpleNamespace(token_ids=tokens, logprobs=lps, finish_reason=reason)
    return types.SimpleNamespace(finished=finished, outputs=[comp])


def test_version_marks_count_tokens_pending_in_the_collector_as_old():
    collector = types.SimpleNamespace(output=_out([4, 5]))  # delivered before the pause, not yet read
    req = InFlightRequest("r", version=3, collector=collector)
    req.absorb(_out([1, 2, 3]))
    req.marks.append((len(req.token_ids) + req.pending_tokens(), 4))  # what _bump_version does
    req.absorb(_out([4, 5]))
    req.absorb(_out([6], finished=True, reason="length"))
    gen = req.result()
    assert gen.token_ids == [1, 2, 3, 4, 5, 6]
    assert gen.versions == [3, 3, 3, 3, 3, 4]
    assert gen.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    assert gen.finish_reason == "length"


def test_an_image_prompt_vllm_expanded_to_another_length_is_named():
    """vLLM's prompt (image placeholders as it expanded them) must be the sample's: its routed
    experts and the trainer's positions are rows of that prompt."""
    for ran, holds, fine in ((12, 12, True), (12, 16, False)):
        req = InFlightRequest("r", version=0)
        out = _out([1, 2], finished=True, reason="stop")
        out.prompt_token_ids = list(range(ran))
        req.absorb(out)
        problem = req.expansion_problem(holds)
        assert (problem is None) == fine, problem
    assert "to 12 tokens, rlcore's sample holds 16" in problem
    assert InFlightRequest("r", version=0).expansion_problem(16) is None  # vLLM said nothing


def test_sampled_logprobs_flat_fast_path():
    class Flat(list):  # stands in for vLLM's FlatLogprobs: a sequence with flat lists attached
        logprobs = [-1.0, -2.0]
        token_ids = [7, 9]

    assert sampled_logprobs([7, 9], Flat([{}, {}])) == [-1.0, -2.0]
    with pytest.raises(RuntimeError):
        sampled_logprobs([1], None)


def _absorb_token_by_token(version, marks, outputs):
    """The per-token rule `absorb` implements: a token's version is that of the last mark whose
    first index is at or before it."""
    versions, pos, i = [], 0, 0
    for out in outputs:
        for _ in out.outputs[0].token_ids:
            while i < len(marks) and marks[i][0] <= pos:
                version, i = marks[i][1], i + 1
            versions.append(version)
            pos += 1
    return versions


@pytest.mark.parametrize("seed", range(20))
def test_absorb_versions_match_the_per_token_rule(seed):
    rng = random.Random(seed)
    chunks = [rng.randrange(0, 6) for _ in range(rng.randrange(1, 5))]
    total = sum(chunks)
    # marks in order, several may share an index (two updates between two outputs), some past the end
    marks = sorted((rng.randrange(0, total + 3), v) for v in range(1, rng.randrange(1, 5)))
    marks = [(first, 10 + k) for k, (first, _) in enumerate(marks)]
    outputs, tok = [], 0
    for n in chunks:
        outputs.append(_out(list(range(tok, tok + n))))
        tok += n
    req = InFlightRequest("r", version=7, marks=list(marks))
    for out in outputs:
        req.absorb(out)
    assert req.token_ids == list(range(total))
    assert req.versions == _absorb_token_by_token(7, marks, outputs)
    assert len(req.logprobs) == total
