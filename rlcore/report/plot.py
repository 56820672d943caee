"""Curves of one or more runs from their metrics.jsonl, as a PNG (matplotlib, Agg backend).

    python -m rlcore.plot OUTPUT_DIR [OUTPUT_DIR ...] [-o OUT.png]

One row per metric, two columns: against the train step and against wall-clock minutes
(`elapsed_s`). Several runs overlay in one figure, labelled by their directory names (async vs
sync, two learning rates). A metric no run logged has no row. A finished run writes its own plot
to `OUTPUT_DIR/plot.png` (`write_run_plot`, called by `rlcore.run`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rlcore")


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    """Metric keys drawn in this panel (one line per key and run)."""
    eval_rows: bool = False
    """Drawn from the evaluation rows (keys `eval/...`) rather than the train-step rows."""


PANELS = (
    Panel("reward", ("reward_mean",)),
    Panel("eval reward", ("eval/reward_mean", "eval/pass@1"), eval_rows=True),
    Panel("loss", ("loss",)),
    Panel("entropy", ("entropy",)),
    Panel("mismatch KL", ("engine_mismatch_kl", "staleness_kl")),
    Panel("staleness", ("max_staleness",)),
    Panel("samples/s", ("samples_per_s",)),
    Panel("busy fraction", ("rollout_busy_frac", "trainer_busy_frac")),
)


@dataclass
class Run:
    name: str
    steps: list[dict]
    """Train-step rows, one per step (the last written wins: a resumed run rewrites steps)."""
    evals: list[dict]
    """Evaluation rows (keys `eval/...`), one per evaluated step."""


def read_run(output_dir: str | Path) -> Run:
    """The rows of `output_dir/metrics.jsonl` split into train and eval rows, ordered by step.
    Eval rows get the wall-clock of the train step they evaluated (0 for step 0); in a run
    with no train rows (`mode=eval` of a checkpoint) the clock is the evaluations' own time
    (`eval/time_s`), summed in step order."""
    path = Path(output_dir) / "metrics.jsonl"
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write leaves half a last line
            continue
        if not isinstance(row, dict) or "step" not in row:
            continue
        is_eval = any(k.startswith("eval/") for k in row)
        (evals if is_eval else steps)[int(row["step"])] = row
    elapsed = {s: r["elapsed_s"] for s, r in steps.items() if "elapsed_s" in r}
    elapsed.setdefault(0, 0.0)
    clock = 0.0
    for s, row in sorted(evals.items()):
        if "elapsed_s" in row:
            continue
        if not steps and isinstance(row.get("eval/time_s"), (int, float)):
            clock += row["eval/time_s"]
            row["elapsed_s"] = clock
        elif s in elapsed:
            row["elapsed_s"] = elapsed[s]
    return Run(Path(output_dir).resolve().name, [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)])


def panel_keys(panel: Panel, runs: list[Run]) -> list[str]:
    """The keys of `panel` that at least one run logged (pass@k: the smallest and largest k)."""
    rows = [r for run in runs for r in (run.evals if panel.eval_rows else run.steps)]
    keys = [k for k in panel.keys if any(k in r for r in rows)]
    if panel.eval_rows:
        ks = sorted(
            {int(k.split("@")[1]) for r in rows for k in r if k.startswith("eval/pass@") and k.split("@")[1].isdigit()}
        )
        keys = [k for k in keys if not k.startswith("eval/pass@")]
        keys += [f"eval/pass@{k}" for k in sorted({ks[0], ks[-1]})] if ks else []
    return keys


def plot_runs(output_dirs: list[str | Path], out_path: str | Path) -> list[str]:
    """Draw the runs' curves to `out_path` (PNG); returns the titles of the panels drawn.
    Raises ValueError when no run has a metric to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(d) for d in output_dirs]
    panels = [(p, keys) for p in PANELS if (keys := panel_keys(p, runs))]
    if not panels:
        raise ValueError(f"no plottable metrics in {[str(Path(d) / 'metrics.jsonl') for d in output_dirs]}")
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 2.6 * len(panels)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    for row, (panel, keys) in enumerate(panels):
        for col, (xkey, xlabel, scale) in enumerate((("step", "step", 1.0), ("elapsed_s", "wall-clock (min)", 1 / 60))):
            ax = axes[row][col]
            for i, run in enumerate(runs):
                rows = run.evals if panel.eval_rows else run.steps
                for j, key in enumerate(keys):
                    pts = [
                        (r[xkey] * scale, r[key]) for r in rows if xkey in r and isinstance(r.get(key), (int, float))
                    ]
                    if not pts:
                        continue
                    label = run.name if len(keys) == 1 else f"{run.name}: {key.removeprefix('eval/')}"
                    ax.plot(
                        *zip(*pts),
                        styles[j % len(styles)],
                        color=colors[i % len(colors)],
                        marker="o" if panel.eval_rows or len(pts) < 30 else None,
                        markersize=3,
                        label=label,
                    )
            ax.set_title(panel.title, fontsize=10)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7, loc="best")
    fig.suptitle(" vs ".join(run.name for run in runs), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return [p.title for p, _ in panels]


def write_run_plot(output_dir: str | Path) -> Path | None:
    """`output_dir/plot.png` of a finished run; a failure is one warning, never an error (the
    run's results are already written)."""
    out = Path(output_dir) / "plot.png"
    try:
        plot_runs([output_dir], out)
    except Exception as exc:  # any plotting failure must not fail a finished run
        log.warning("could not write %s: %s: %s", out, type(exc).__name__, exc)
        return None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.plot", description=__doc__.splitlines()[0])
    parser.add_argument("output_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument(
        "-o", "--out", help="PNG to write (default: OUTPUT_DIR/plot.png for one run, plot.png here for several)"
    )
    args = parser.parse_args(argv)
    for d in args.output_dirs:
        if not (Path(d) / "metrics.jsonl").is_file():
            print(f"rlcore.report.plot: error: {d}: no metrics.jsonl", file=sys.stderr)
            return 2
    out = args.out or (Path(args.output_dirs[0]) / "plot.png" if len(args.output_dirs) == 1 else "plot.png")
    try:
        drawn = plot_runs(args.output_dirs, out)
    except ValueError as exc:
        print(f"rlcore.report.plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"rlcore.report.plot: wrote {out} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
