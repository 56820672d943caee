"""What a fork per reward call costs (issue 54), without a pool or Ray: one reverse_text reward
call run in this process (`reward_worker_loop.run_one`) against the same call in a fork of it
(`reward_worker_loop.run_forked`, what a reward worker does for every call), 5 x 100 calls each;
prints the microseconds per call (median and each repetition) and this process's resident size.

    uv run python benchmarks/reward_call_fork_cost.py
"""

import gc
import pickle
import socket
import statistics
import time

from rlcore.envs import make_env
from rlcore.isolation import reward_worker_loop as loop


def main() -> None:
    env = make_env("reverse_text", {}, seed=0)
    task = env.make_task(0, "train")
    blob = pickle.dumps(("reward", (task, task.answer)))
    _, pipe = socket.socketpair()  # stands for the worker's pipe to the actor (the call's process closes it)
    print(f"resident: {int(open('/proc/self/statm').read().split()[1]) * 4096 / 1e6:.1f} MB")
    gc.freeze()  # as a worker does before it serves
    for name, call in [
        ("in-process", lambda: loop.run_one(env, blob)),
        ("forked", lambda: loop.run_forked(env, blob, pipe.fileno())),
    ]:
        per = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(100):
                out = call()
            per.append((time.perf_counter() - start) / 100 * 1e6)
        assert out.value == 1.0, out
        print(f"{name}: {statistics.median(per):.0f} us a call ({', '.join(f'{p:.0f}' for p in per)})")


if __name__ == "__main__":
    main()
