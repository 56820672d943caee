"""Engines are plug-ins: a third engine, defined in this file with its own options section and
added by one `register_engine` call, gets `rollout.recompute.*` (and `teacher.recompute.*`) in the
schema, reads its section, passes validation and runs the real episode loop, weight update and
canary scoring.

The engine is real, not a stand-in: the run's transformers model decoded without a KV cache
(every step recomputes the whole sequence), one prompt at a time.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import pytest
import torch

from rlcore.canary import teacher_forced_logprobs
from rlcore.config import RolloutConfig
from rlcore.config.errors import ConfigError
from rlcore.config.validate import problems
from rlcore.engine.base import Generation, RolloutEngine, SamplingParams
from rlcore.engine.hf_engine import sample_with_logprobs
from rlcore.engine.registry import (
    EngineSpec,
    engine_class,
    make_engine,
    register_engine,
    tensor_parallel_size,
    unregister_engine,
    weight_transport,
)
from rlcore.envs import make_env
from rlcore.models.build import build_model, build_tokenizer
from rlcore.placement import placement_problems
from rlcore.run import compose
from rlcore.teacher import teacher_run_config


@dataclass
class RecomputeOptions:
    """Options of the recompute engine (`rollout.recompute.*`)."""

    max_tokens: int = 0
    """Tokens a completion may take at most, below `rollout.sampling.max_new_tokens` (0 = no cap)."""


class RecomputeEngine(RolloutEngine):
    """A transformers model sampled without a KV cache."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, seed: int, max_tokens: int = 0):
        self.model, self.eos_token_id, self.max_tokens = model.eval(), eos_token_id, max_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self.policy_version = 0

    @classmethod
    def from_config(cls, cfg, seed=0, tokenizer=None):
        tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg.model)
        return cls(build_model(cfg.model, tokenizer), tokenizer.eos_token_id, seed, cfg.rollout.recompute.max_tokens)

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams, images=None):
        out = []
        for i, prompt in enumerate(prompts):
            gen = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed + i)
            tokens, logprobs, versions, finish = [], [], [], "length"
            for _ in range(min(params.max_new_tokens, self.max_tokens or params.max_new_tokens)):
                with self.lock:
                    logits = self.model(input_ids=torch.tensor([list(prompt) + tokens])).logits[:, -1]
                    version = self.policy_version
                token, logprob = sample_with_logprobs(logits, params.temperature, params.top_p, gen)
                tokens.append(int(token))
                logprobs.append(float(logprob))
                versions.append(version)
                if tokens[-1] == self.eos_token_id or tokens[-1] in params.stop_token_ids:
                    finish = "stop"
                    break
            out.append(Generation(tokens, logprobs, versions, finish))
        return out

    @torch.inference_mode()
    def score(self, prompt_ids, completion_ids):
        return teacher_forced_logprobs(self.model, [(prompt_ids, completion_ids)])[0]

    def load_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        with self.lock, torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)

    def set_version(self, version):
        with self.lock:
            self.policy_version = version

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@pytest.fixture(autouse=True, scope="module")
def recompute_engine():
    """The one registry line, for this module's tests only: the section must not outlive them
    (every later config would carry it, and Ray actors cannot import this test module)."""
    register_engine(EngineSpec("recompute", f"{__name__}:RecomputeEngine", section="recompute", options=RecomputeOptions))
    yield
    unregister_engine("recompute")
    assert "recompute" not in {f.name for f in dataclasses.fields(RolloutConfig)}

BASE = ["rollout.engine=recompute", "rollout.sampling.max_new_tokens=6"]


def test_validation_knows_the_plugin_and_refuses_other_engines_options():
    assert problems(compose(BASE)) == []
    # another engine's option, typed with this engine selected, changes nothing: refused, that engine named
    with pytest.raises(ConfigError, match=r"^rollout.vllm.quantization: an option of the vllm engine "
                                          r"\(rollout.engine=vllm\), not of rollout.engine=recompute"):
        compose([*BASE, "rollout.vllm.quantization=fp8"])
    with pytest.raises(ConfigError, match=r"^rollout.recompute.max_tokens: an option of the recompute engine"):
        compose(["rollout.recompute.max_tokens=2"])  # the default engine is hf
    with pytest.raises(ConfigError, match=r"rollout.recompute.max_tokenz: unknown key in rollout.recompute"):
        compose([*BASE, "rollout.recompute.max_tokenz=2"])
    with pytest.raises(ConfigError, match=r"^rollout.max_tokens: moved to rollout.recompute.max_tokens"):
        compose([*BASE, "rollout.max_tokens=2"])
    unknown = dict(problems(compose(["rollout.engine=nope"])))["rollout.engine"]
    assert "'recompute'" in unknown and "'vllm'" in unknown
    # colocated placement needs the ipc transport, which this engine does not take
    cfg = compose([*BASE, "placement=colocated", "trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1"])
    assert "rollout.engine" in dict(placement_problems(cfg, gpus=1, gpu_bytes=None, where="this machine"))
    # a teacher may use it too
    teacher = compose([*BASE, "teacher.enabled=true", "teacher.engine=recompute", "teacher.recompute.max_tokens=2"])
    assert "teacher.engine" not in dict(problems(teacher))
    assert teacher_run_config(teacher).rollout.recompute.max_tokens == 2  # the teacher's engine gets its section


def test_the_section_reaches_the_engine():
    cfg = compose([*BASE, "rollout.recompute.max_tokens=2"])
    assert problems(cfg) == [] and cfg.rollout.recompute == RecomputeOptions(max_tokens=2)
    tokenizer = build_tokenizer(cfg.model)
    engine = make_engine(cfg, tokenizer, seed=0)
    assert engine.max_tokens == 2
    gens = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    assert max(len(g.token_ids) for g in gens) == 2  # capped by the section (sampling allows 6)


def test_plugin_runs_episodes_takes_weights_and_scores_like_the_trainer():
    cfg = compose(BASE)
    assert weight_transport(cfg) == "broadcast" and tensor_parallel_size(cfg.rollout) == 1
    tokenizer = build_tokenizer(cfg.model)
    engine = make_engine(cfg, tokenizer, seed=0)
    assert type(engine) is engine_class("recompute") is RecomputeEngine
    env = make_env(cfg.env.name, dict(cfg.env.args), cfg.env.seed)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    groups = env.run_groups([env.make_task(i, "train") for i in range(2)], 3, engine, tokenizer, params)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 6 and all(not s.failed for s in samples)
    assert all(len(s.completion_ids) == len(s.logprobs) == len(s.versions) > 0 for s in samples)
    assert all(v == 0 for s in samples for v in s.versions)

    # a weight update: the trainer's model (another seed) lands as version 1
    trainer = build_model(dataclasses.replace(cfg.model, seed=cfg.model.seed + 1), tokenizer)
    engine.apply_weights(trainer.named_parameters(), version=1)
    assert all(torch.equal(engine.state_dict()[n], p) for n, p in trainer.named_parameters())
    (gen,) = engine.generate([samples[0].prompt_ids], params)
    assert set(gen.versions) == {1}

    # the canary's engine side (the contract's default score_batch) against the trainer's logprobs
    pairs = [(s.prompt_ids, s.completion_ids) for s in samples[:2]]
    with torch.no_grad():
        want = teacher_forced_logprobs(trainer, pairs)
    got = engine.score_batch(pairs)
    assert all(g == pytest.approx(w, abs=1e-5) for g, w in zip(got, want))
    assert engine.rng_state() is None and engine.set_rng_state(object()) is False  # no RNG to resume


def test_the_section_leaves_the_schema_classes_unchanged_and_travels_with_the_config():
    import pickle

    from rlcore.config.nodes import config_dict
    assert "recompute" not in {f.name for f in dataclasses.fields(RolloutConfig)}  # registration adds no field
    cfg = compose([*BASE, "rollout.recompute.max_tokens=2"])
    assert config_dict(cfg)["rollout"]["recompute"] == {"max_tokens": 2}  # config.yaml, loggers, checkpoints
    assert pickle.loads(pickle.dumps(cfg)).rollout.recompute == RecomputeOptions(max_tokens=2)  # to the actors
    assert RolloutConfig().recompute == RecomputeOptions()  # a config built in Python reads the defaults
    with pytest.raises(AttributeError, match="no attribute 'recompose'"):
        RolloutConfig().recompose
