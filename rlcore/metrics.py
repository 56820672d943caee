"""Metrics sinks: one JSON object per step in metrics.jsonl, a console line, wandb if asked."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlcore.config import LoggerConfig


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, output_dir: str, run_config: dict[str, Any], total_steps: int):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self.console = cfg.console
        self._progress = None
        self._wandb = None
        if cfg.wandb:
            import wandb
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=cfg.project, name=cfg.run_name, config=run_config,
                                     dir=output_dir, mode=mode)
        if self.console:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._progress = Progress(TextColumn("[bold]rlcore"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), transient=False)
            self._task = self._progress.add_task("train", total=total_steps)
            self._progress.start()

    def log(self, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps(metrics, sort_keys=True) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=metrics["step"])
        if self._progress is not None:
            self._progress.console.print(format_line(metrics))
            self._progress.update(self._task, completed=metrics["step"])

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()


def format_line(m: dict[str, Any]) -> str:
    parts = [f"step {m['step']:>4}"]
    for key, fmt in (("reward_mean", ".3f"), ("loss", "+.4f"), ("entropy", ".3f"), ("mismatch_kl", ".1e"),
                     ("max_staleness", "d"), ("tokens_per_s", ".0f"), ("step_time_s", ".2f")):
        if key in m:
            parts.append(f"{key.removesuffix('_mean')} {m[key]:{fmt}}")
    return " | ".join(parts)
