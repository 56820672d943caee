"""A cheap reward's cost per sample through a `WorkerPool` alone (no Ray, no engine): issue 54's
A/B of the reply format and the per-call checks, where `reward_overhead.py --part actor` is too
noisy on a shared machine to see 10%.

`env.score_all` of 128 reverse_text answers (16 tasks x 8), the environment's own pool (workers
from its zygote, warm after 5 rounds), 40 timed rounds; prints the median microseconds per sample.
Run it alternately in two checkouts and compare the medians of the runs. Run each from inside its
checkout (`cd`): the pool's zygote is `python -c` in the current directory, which comes before
PYTHONPATH on its sys.path, so a run from another checkout measures that checkout's workers:

    for i in 1 2 3 4 5; do (cd /tmp/base && PYTHONPATH=. python benchmarks/reward_pool_cost.py); \\
        PYTHONPATH=. python benchmarks/reward_pool_cost.py; done
"""

import statistics
import time

from rlcore.envs import make_env


def main() -> None:
    env = make_env("reverse_text", {}, seed=0)
    pool = env.reward_pool()
    until = time.monotonic() + 60
    while pool.zygote() is None and time.monotonic() < until:
        time.sleep(0.01)
    tasks = [env.make_task(i, "train") for i in range(16)]
    jobs = [(t, [*t.messages, {"role": "assistant", "content": t.answer}], {}) for t in tasks for _ in range(8)]
    for _ in range(5):
        env.score_all(jobs)
    per_sample = []
    for _ in range(40):
        start = time.perf_counter()
        outs = env.score_all(jobs)
        per_sample.append((time.perf_counter() - start) / len(jobs) * 1e6)
        assert all(o.ok and o.value == 1.0 for o in outs), [o.error for o in outs][:3]
    pool.close()
    print(f"{statistics.median(per_sample):.1f}")


if __name__ == "__main__":
    main()
