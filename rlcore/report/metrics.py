"""Metrics sinks: one JSON object per step in metrics.jsonl, a console line, wandb if asked."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from rlcore.config import LoggerConfig
from rlcore.report.samples import TOKEN_COLUMNS
from rlcore.report.summary import is_zero_advantage
from rlcore.storage.series import SeriesFile, append_rows

log = logging.getLogger("rlcore")

ZERO_ADVANTAGE_WARNING = (
    "step %d: every group has zero advantage (each group's samples got equal rewards), so loss and "
    "grad_norm are 0 and the policy does not change; the run summary counts such steps. A policy that "
    "cannot yet earn reward needs a warm-up (sft.warmup_steps), an easier task or a larger algo.group_size"
)


SAMPLES_FILE = "samples.jsonl"


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, output_dir: str, run_config: dict[str, Any], total_steps: int):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.samples_path = Path(output_dir) / SAMPLES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = SeriesFile(self.path)  # rows appended whole (rlcore.storage.series)
        self.console = cfg.console
        self.eval_rows: list[dict[str, Any]] = []  # this run's evaluation rows (for the run summary)
        self._warned_zero_advantage = False
        self._progress = None
        self._wandb = None
        if cfg.wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            # one wandb run per output_dir: a resumed run continues the same run and series (the
            # id is wandb's own, read back from the run: only public API)
            id_file = Path(output_dir) / ".wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else None
            self._wandb = wandb.init(
                project=cfg.project,
                name=cfg.run_name,
                config=run_config,
                dir=output_dir,
                mode=os.environ.get("WANDB_MODE", mode),
                id=run_id,
                resume="allow" if run_id else None,
            )
            id_file.write_text(self._wandb.id)
            # evaluation rows finish after later train steps: they get their own x axis, since
            # wandb drops a `step=` that is behind the run's current step
            self._wandb.define_metric("eval/step")
            self._wandb.define_metric("eval/*", step_metric="eval/step")
        if self.console and total_steps > 0:  # 0: no step series (mode=eval), no progress bar
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]rlcore"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False
            )
            self._task = self._progress.add_task("train", total=total_steps)
            self._progress.start()

    def log(self, metrics: dict[str, Any]) -> None:
        """A train step's row: metrics.jsonl first (StorageError naming the file and its cause when
        it cannot be written: the row is then not in the file at all), then wandb and the console."""
        self._file.append([metrics])
        if is_zero_advantage(metrics) and not self._warned_zero_advantage:
            self._warned_zero_advantage = True  # once per run: the summary gives the count
            log.warning(ZERO_ADVANTAGE_WARNING, metrics["step"])
        if self._wandb is not None:
            self._wandb.log(metrics, step=metrics["step"])
        if self._progress is not None:
            self._progress.console.print(format_line(metrics), soft_wrap=True)
            self._progress.update(self._task, completed=metrics["step"])

    def reopen(self) -> None:
        """Open metrics.jsonl again after `rlcore.storage.rundir.truncate_series` cut it back: the cut
        replaces the file, so rows written through the old handle would land in the unlinked one."""
        self._file.reopen()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Sample completions of train step `step`: one line each in samples.jsonl, and a
        wandb.Table `samples` (columns: step and the rows' keys)."""
        if not rows:
            return
        append_rows(self.samples_path, [{"step": step, **row} for row in rows])
        if self._wandb is not None:
            import wandb

            keys = [k for k in rows[0] if k not in TOKEN_COLUMNS]  # the page's per-token lists: not a table cell
            self._wandb.log(
                {"samples": wandb.Table(columns=["step", *keys], data=[[step, *(r[k] for k in keys)] for r in rows])},
                step=step,
            )

    def log_eval(self, metrics: dict[str, Any]) -> None:
        """An evaluation row: `step` is the train step whose policy was evaluated (it may be
        logged after later steps' rows)."""
        self._file.append([metrics])
        self.eval_rows.append(metrics)
        if self._wandb is not None:
            # commit=False: joins the next train row instead of advancing wandb's step past it
            self._wandb.log({**metrics, "eval/step": metrics["step"]}, commit=False)
        if self.console:
            line = format_eval_line(metrics)
            if self._progress is not None:
                self._progress.console.print(line)
            else:
                print(line, flush=True)

    def close(self) -> None:
        """Stop the progress bar, finish wandb, close the file; a second call does nothing."""
        if self._file.closed:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()


def format_eval_line(m: dict[str, Any]) -> str:
    parts = [f"eval {m['step']:>4}"]
    for key in sorted(k for k in m if k.count("/") == 1 and (k.startswith("eval/pass@") or k == "eval/reward_mean")):
        parts.append(f"{key.removeprefix('eval/').removesuffix('_mean')} {m[key]:.3f}")
    return " | ".join(parts)


def format_line(m: dict[str, Any]) -> str:
    parts = [f"step {m['step']:>4}"]
    for key, fmt in (
        ("reward_mean", ".3f"),
        ("loss", "+.4f"),
        ("grad_norm", ".3f"),
        ("entropy", ".3f"),
        ("teacher_kl", ".3f"),
        ("teacher_top_k_kl", ".3f"),  # distillation runs only
        ("engine_mismatch_kl", ".1e"),
        ("staleness_kl", ".1e"),
        ("max_staleness", "d"),
        ("tokens_per_s", ".0f"),
        ("step_time_s", ".2f"),
    ):
        if key in m:
            parts.append(f"{key.removesuffix('_mean')} {m[key]:{fmt}}")
    return " | ".join(parts)
