"""Generation slots (rlcore.engine.slots): a rollout actor's training requests generate in at most
`rollout.max_requests_per_actor` threads at once, and what they do after generating (scoring, a
reward hung until its deadline) holds no slot, so the next request generates meanwhile."""

import threading
import time

from rlcore.engine.slots import GenerationSlots


class CountingEngine:
    """Records how many generate calls overlap; each takes `gen_s`."""

    def __init__(self, gen_s: float):
        self.gen_s, self.now, self.most = gen_s, 0, 0
        self.lock = threading.Lock()
        self.policy_version = 7

    def generate(self, prompts, params=None):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(self.gen_s)
        with self.lock:
            self.now -= 1
        return [f"out {p}" for p in prompts]


def test_at_most_n_generate_at_once_and_scoring_holds_no_slot():
    engine = CountingEngine(gen_s=0.05)
    slots = GenerationSlots(engine, 2)
    generated = [threading.Event() for _ in range(4)]

    def request(i: int) -> None:
        assert slots.generate([i]) == [f"out {i}"]
        generated[i].set()
        if i < 2:  # the first two score (a hung reward) until the last two have generated
            assert generated[2].wait(10) and generated[3].wait(10), "scoring held a generation slot"

    threads = [threading.Thread(target=request, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.01)  # 0 and 1 take the slots first
    for t in threads:
        t.join(15)
    assert all(e.is_set() for e in generated) and not any(t.is_alive() for t in threads)
    assert engine.most == 2


def test_everything_but_generate_is_the_engines_own():
    engine = CountingEngine(gen_s=0.0)
    slots = GenerationSlots(engine, 1)
    assert slots.policy_version == 7 and slots.engine is engine
