"""A trainer rank killed mid-run, healed from the engines' weights vs from the last checkpoint:
recovery seconds, steps trained again, samples dropped, and the run's last rewards (docs/scale_out.md).

    python -m benchmarks.trainer_heal --reps 2

One Ray instance (2 CPUs), the default job (SFT warm-up on) with steps=10 and
checkpoint.interval=4 in both arms (so a checkpoint exists; the kill comes at step 6, two steps
after it). The arms alternate within each repetition (engines, checkpoint, engines, ...) so both
see the same load; each figure is printed with the load average before and after it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def one(source: str, out: str, steps: int, kill_at: int) -> dict:
    import ray

    from actors.driver import Driver
    from rlcore.plan.compose import compose
    from rlcore.plan.layout import run_plan
    from rlcore.plan.validate import validate
    from rlcore.report.metrics import MetricsLogger

    cfg = compose(
        [
            f"output_dir={out}",
            f"steps={steps}",
            "checkpoint.interval=4",
            "logger.console=false",
            f"trainer.heal_from={source}",
        ]
    )
    validate(cfg)
    driver = Driver(run_plan(cfg))
    logger = MetricsLogger(cfg.logger, cfg.output_dir, {}, cfg.steps)
    killed: dict = {}

    def kill() -> None:
        while driver.run_state.step < kill_at:
            time.sleep(0.05)
        killed["step"] = driver.run_state.step
        ray.kill(driver.trainers.handles[0], no_restart=True)

    try:
        driver.setup()
        threading.Thread(target=kill, daemon=True).start()
        history = driver.run(logger)
    finally:
        logger.close()
        driver.shutdown()
    step, seconds = driver.recovery.last
    return {
        "source": driver.recovery.source,
        "seconds": seconds,
        "killed_at": killed["step"],
        "steps_again": killed["step"] - step,
        "last_reward": statistics.mean(r["reward_mean"] for r in history[-3:]),
        "failed": history[-1]["samples_failed"],
        "generated": history[-1]["samples_generated"],
        "trained": history[-1]["samples_trained"],
    }


def main() -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=6)
    a = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    results: dict[str, list[dict]] = {"engines": [], "checkpoint": []}
    try:
        for rep in range(a.reps):
            for source in ("engines", "checkpoint"):
                before = load()
                with tempfile.TemporaryDirectory() as out:
                    r = one(source, out, a.steps, a.kill_at)
                results[source].append(r)
                print(
                    f"rep {rep} {source}: recovery {r['seconds']:.1f}s, killed at step {r['killed_at']}, "
                    f"{r['steps_again']} step(s) trained again, generated {r['generated']} trained {r['trained']} "
                    f"failed {r['failed']}, reward (last 3 steps) {r['last_reward']:.3f} (load {before} -> {load()})",
                    flush=True,
                )
    finally:
        ray.shutdown()
    for source, rs in results.items():
        s = [r["seconds"] for r in rs]
        print(
            f"{source}: recovery median {statistics.median(s):.1f}s (range {min(s):.1f}-{max(s):.1f}) over "
            f"{len(s)}; steps trained again {[r['steps_again'] for r in rs]}; reward (last 3 steps) "
            f"{[round(r['last_reward'], 3) for r in rs]}"
        )


if __name__ == "__main__":
    main()
