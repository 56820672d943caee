"""Reward workers start from several request threads of one rollout actor at once. On Python >=
3.12 filelock (>= 4, a dependency of the stack) installs an audit hook that refuses `os.fork`
while another thread of the process is inside a fork (RuntimeError), which failed 27% of one GPU
run's samples. Emulated here on any Python with the same rule (a fork that starts while another
is between its before- and after-fork hooks raises), with the window widened so that concurrent
forks collide: the workers' starts must not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import os, sys, threading, time

    inside = set()          # threads between their before- and after-fork hooks
    guard = threading.Lock()

    def before():
        with guard:
            inside.add(threading.get_ident())
        time.sleep(0.05)    # widen the window in which another thread's fork is refused

    def after():
        with guard:
            inside.discard(threading.get_ident())

    def refuse_concurrent_fork(event, args):  # filelock's rule
        if event == "os.fork":
            with guard:
                others = inside - {threading.get_ident()}
            if others:
                raise RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership")

    sys.addaudithook(refuse_concurrent_fork)
    os.register_at_fork(before=before, after_in_parent=after)

    from rlcore.isolation.reward_worker_process import Worker

    class Owner:
        pass

    errors, workers = [], []

    def start():
        try:
            workers.append(Worker(Owner(), 512))
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for w in workers:
        w.kill()
    print(len(workers), len(errors), errors[:1])
""")


def test_workers_started_from_many_threads_at_once_all_start():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    started, failed, first = done.stdout.split(maxsplit=2)
    assert (int(started), int(failed)) == (6, 0), first
