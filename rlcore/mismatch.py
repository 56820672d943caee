"""The mismatch contract of a model: `python -m rlcore.mismatch [overrides]` loads the run's model
in the trainer (its own forward and chunked logprob head) and in the run's engine (`hf` on CPU,
`vllm` on a GPU), with the same weights, scores the same tokens on both sides and prints:

    token_mult_prob_error = mean_t exp(|engine_t - trainer_t|)          (NeMo-RL's figure; 1 = identical)
    kl                    = mean_t (rho_t - 1 - log rho_t), rho_t = p_trainer(y_t) / p_engine(y_t)

the k3 estimate of KL(engine || trainer) over tokens the engine chose (exact for the sampled ones,
at temperature 1). The tokens are the canary's (`rlcore.weights.canary.own_completion_pairs`): greedy and
temperature-1 completions of the environment's eval prompts by the engine, `rollout.canary_tokens`
of them. Exit 1, with one line saying why, when `rollout.max_mismatch` is set and the figure passes
it (a run checks the same bound on its first sync's canary). The last line printed is the figures
as JSON.

Same weights: a checkpoint (`model.path`) is loaded by both sides; a random-weight model is built
by the trainer and copied into the engine, as a run's first sync does. On a GPU the engine starts
first (vLLM sizes its memory at start-up): give it `+rollout.vllm.engine_kwargs.gpu_memory_utilization`
to leave the trainer room on the same GPU.

A second entry point beside `rlcore.run`, in the entry layer of the import contract; it composes
and validates through `rlcore.plan` as the run does and imports nothing of the run.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Sequence


def mismatch_figures(engine: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> dict[str, float]:
    """The figures of the module docstring from per-token logprobs (one list per completion):
    `token_mult_prob_error`, `kl`, `mean_abs_diff`, `max_abs_diff`, `tokens`."""
    diffs = [float(t) - float(e) for es, ts in zip(engine, trainer, strict=True) for e, t in zip(es, ts, strict=True)]
    if not diffs:
        raise ValueError("mismatch: no tokens to compare")
    n = len(diffs)
    return {
        "token_mult_prob_error": sum(math.exp(min(abs(d), 700.0)) for d in diffs) / n,
        "kl": sum(math.expm1(d) - d for d in diffs) / n,
        "mean_abs_diff": sum(abs(d) for d in diffs) / n,
        "max_abs_diff": max(abs(d) for d in diffs),
        "tokens": float(n),
    }


def measure(cfg) -> dict[str, float]:
    """Load, score and compare (see the module docstring) for a validated, resolved RunConfig."""
    import torch

    from rlcore.engine.base import SamplingParams
    from rlcore.engine.registry import make_engine
    from rlcore.envs import build_env
    from rlcore.models.build import build_tokenizer
    from rlcore.models.render import render_prompt
    from rlcore.trainer.core import TrainerCore, free_port
    from rlcore.weights.canary import canary_prompts, own_completion_pairs

    tok = build_tokenizer(cfg.model)
    engine = make_engine(cfg, tok, seed=cfg.seed)  # first: vLLM sizes its memory at start-up
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = "cuda" if cfg.trainer.gpus_per_rank > 0 and torch.cuda.is_available() else "cpu"
    core = TrainerCore(cfg, 0, 1, device)
    try:
        if not cfg.model.path:  # random weights: the trainer's, as a run's first sync gives them
            engine.apply_weights(core.full_parameters(), 1)
        env = build_env(cfg.env)
        n = max(cfg.rollout.canary_prompts, 1)
        tasks = [] if env.uses_images else [env.make_task(i, "eval") for i in range(min(n, env.eval_size))]

        def generate(prompts, temperature, max_new_tokens, seed):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
            return [g.token_ids for g in engine.generate(prompts, params)]

        pairs = own_completion_pairs(
            [render_prompt(tok, t.messages) for t in tasks],
            generate,
            cfg.rollout.canary_tokens,
            1.0,
            seed=cfg.seed + 1234,
        )
        if not pairs:
            pairs = canary_prompts(
                len(tok), num_prompts=n, completion_len=-(-cfg.rollout.canary_tokens // n), seed=cfg.seed + 1234
            )
        return mismatch_figures(engine.score_batch(pairs), core.score_pairs(pairs))
    finally:
        core.shutdown()
        getattr(engine, "shutdown", lambda: None)()


USAGE = """usage: python -m rlcore.mismatch [+recipe=NAME] [GROUP=OPTION ...] [key=value ...]

Scores the same tokens with the run's model in the trainer and in the run's engine (same weights)
and prints token_mult_prob_error, the k3 KL(engine || trainer) and the logprob differences; the
last line is the figures as JSON. Takes the overrides of `python -m rlcore.run` (see its --help);
exit 1 when rollout.max_mismatch is set and the figure passes it, 2 on a config error."""


def main(argv: list[str] | None = None) -> int:
    from rlcore.config.errors import ConfigError
    from rlcore.models.shipped import resolve as resolve_model
    from rlcore.plan.compose import compose
    from rlcore.plan.validate import validate
    from rlcore.report.console import report_config_error as report

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        cfg = compose(argv)
        validate(cfg)
        cfg.model = resolve_model(cfg.model)
    except ConfigError as exc:
        return report(exc)
    fig = measure(cfg)
    where = f"model {cfg.model.path or 'random weights'}, engine {cfg.rollout.engine}"
    print(
        f"mismatch ({where}, {int(fig['tokens'])} tokens): token_mult_prob_error {fig['token_mult_prob_error']:.6f}, "
        f"kl {fig['kl']:.3e}, mean |dlogprob| {fig['mean_abs_diff']:.3e}, max {fig['max_abs_diff']:.3e}"
    )
    bound = cfg.rollout.max_mismatch
    over = bound is not None and fig["token_mult_prob_error"] > bound
    if over:
        print(
            f"rlcore: mismatch: token_mult_prob_error {fig['token_mult_prob_error']:.6f} passes "
            f"rollout.max_mismatch={bound}: a run with this model and engine would stop at its first sync",
            file=sys.stderr,
        )
    print(json.dumps({**fig, "max_mismatch": bound}))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
