"""Per-rollout cost of a verifiers v1 rollout on CPU, by harness: verifiers' `null` (its chat
program launched through uv per rollout), rlcore's in-process tool-less loop (`id: null`, Hydra's
None) and, with --bash, verifiers' `bash` (allow_host_tools). The model is the default config's
tiny random one with 8 new tokens, so the figure is the harness's own overhead.

    python benchmarks/verifiers_rollout_cost.py [REPS] [GROUP] [--bash]
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlcore.config.reward import RewardRuntimeConfig
from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.envs import make_env
from rlcore.models.build import build_model, build_tokenizer
from rlcore.plan.compose import compose

TASKSET = """
import verifiers.v1 as vf

class Data(vf.TaskData):
    answer: str = ""

class CalcTask(vf.Task[Data]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        return [CalcTask(Data(prompt=f"{a}*{a + 7}=", answer=str(a * (a + 7))), self.config.task) for a in range(100)]

__all__ = ["CalcTaskset"]
"""


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    reps, group = (int(args[0]) if args else 5), (int(args[1]) if len(args) > 1 else 4)
    torch.set_num_threads(1)  # as the rollout actors run
    d = tempfile.mkdtemp()
    Path(d, "bench_calc.py").write_text(TASKSET)
    sys.path.insert(0, d)
    cfg = compose([])
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    engine = HFEngine(build_model(cfg.model, tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    params = SamplingParams(max_new_tokens=8)
    harnesses = [("rlcore in-process (id: null)", None), ("verifiers null (uv program)", "null")]
    if "--bash" in sys.argv:
        harnesses.append(("verifiers bash (uv program)", "bash"))
    for name, hid in harnesses:
        env = make_env(
            "verifiers",
            {
                "taskset": "bench_calc",
                "allow_host_tools": hid == "bash",
                "env_config": {"agent": {"harness": {"id": hid}}},
            },
            seed=0,
            reward_runtime=RewardRuntimeConfig(on_error="zero"),
        )
        try:
            env.run_groups([env.make_task(0, "train")], group, engine, tok, params)  # warm: server, uv cache
            per = []
            for i in range(reps):
                t = time.perf_counter()
                [g] = env.run_groups([env.make_task(i + 1, "train")], group, engine, tok, params)
                per.append((time.perf_counter() - t) / group)
                assert not any(s.failed for s in g.samples), [s.error for s in g.samples]
        finally:
            env.close()
        print(
            f"{name}: {statistics.median(per) * 1000:.0f} ms per rollout (median of {reps} groups of {group})",
            flush=True,
        )


if __name__ == "__main__":
    main()
