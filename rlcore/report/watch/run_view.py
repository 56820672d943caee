"""One run as the page sees it: the rows, samples and events read so far (incrementally), the
events that other files imply (evaluations, restarts, checkpoints) and the health alarms."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from rlcore.report.events import EVENTS_FILE
from rlcore.report.metrics import SAMPLES_FILE
from rlcore.report.watch.alarms import WINDOW, alarms
from rlcore.report.watch.tail import JsonlTail

CHECKPOINT = re.compile(r"step_(\d+)$")
RESTART_COUNTERS = {
    "rollout_restarts": "rollout engine died and was restarted",
    "rollout_stalls": "rollout engine stopped answering and was taken out",
    "trainer_restarts": "trainer group restarted after a rank died",
}
# the events.jsonl kinds that tell of the same restarts (a run that writes them): the counter's
# own event would say it twice
EXPLICIT = {
    "rollout_restarts": ("rollout_died",),
    "rollout_stalls": ("rollout_stalled",),
    "trainer_restarts": ("trainer_restart",),
}


class RunView:
    """The state of one OUTPUT_DIR, brought up to date by `update` (only new bytes are read)."""

    def __init__(self, output_dir: Path):
        self.dir = Path(output_dir)
        self.name = self.dir.name or str(self.dir)
        self._lock = threading.Lock()
        self._tails = {
            k: JsonlTail(self.dir / f)
            for k, f in (("rows", "metrics.jsonl"), ("samples", SAMPLES_FILE), ("events", EVENTS_FILE))
        }
        self.epoch = 0
        """Bumped when a file was cut back or replaced (a resumed run): the page starts over."""
        self._clear()

    def _clear(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._counters: dict[str, int] = {}
        self._checkpoints: set[int] = set()

    def update(self) -> None:
        """Read what the run appended since the last update."""
        with self._lock:
            new = {k: tail.poll() for k, tail in self._tails.items()}
            if any(reset for _, reset in new.values()):
                self.epoch += 1
                self._clear()
                for tail in self._tails.values():
                    tail.offset = 0
                new = {k: (tail.poll()[0], True) for k, tail in self._tails.items()}
            self.samples += new["samples"][0]
            self.events += new["events"][0]
            for row in new["rows"][0]:
                self.rows.append(row)
                self.events += self._implied(row)
            self.events += self._new_checkpoints()

    def _implied(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Events a metrics row tells of: an evaluation, a restart counter that went up (unless
        events.jsonl tells of those restarts itself: a run that writes fault events)."""
        out = []
        if "eval/reward_mean" in row:
            out.append(
                {
                    "kind": "eval",
                    "step": row["step"],
                    "text": f"evaluation of step {row['step']}: reward {row['eval/reward_mean']:.3f}",
                    "time": None,
                }
            )
        for key, text in RESTART_COUNTERS.items():
            value = row.get(key)
            if isinstance(value, int):
                if value > self._counters.get(key, 0) and not any(e.get("kind") in EXPLICIT[key] for e in self.events):
                    out.append(
                        {"kind": "restart", "step": row["step"], "time": None, "text": f"{text} ({key} {value})"}
                    )
                self._counters[key] = value
        return out

    def _new_checkpoints(self) -> list[dict[str, Any]]:
        """Checkpoints committed since the last look (one directory listing)."""
        try:
            names = [p.name for p in (self.dir / "checkpoints").iterdir()]
        except OSError:
            return []
        steps = {int(m.group(1)) for n in names if (m := CHECKPOINT.match(n))} - self._checkpoints
        self._checkpoints |= steps
        return [
            {"kind": "checkpoint", "step": s, "time": None, "text": f"checkpoint step_{s:08d}"} for s in sorted(steps)
        ]

    def payload(self, epoch: int, rows: int, samples: int, events: int) -> dict[str, Any]:
        """What a page that holds `rows`/`samples`/`events` items of `epoch` lacks, plus the
        current alarms and whether the run has ended."""
        self.update()
        with self._lock:
            if epoch != self.epoch:
                rows = samples = events = 0
            return {
                "epoch": self.epoch,
                "name": self.name,
                "path": str(self.dir),
                "rows": self.rows[rows:],
                "samples": self.samples[samples:],
                "events": self.events[events:],
                "alarms": alarms(self.rows[-4 * WINDOW :]),
                "ended": any(e.get("kind") == "end" for e in self.events),
            }
