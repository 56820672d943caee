"""Entry point: ``python -m rlcore.timeline OUTPUT_DIR`` prints the timeline summary of a run's
recorded steps (`profile.steps`) and writes their merged Chrome trace; the code is
:mod:`rlcore.report.timeline`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlcore.report.timeline import build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rlcore.timeline",
        description="The timeline of a run's recorded steps (profile.steps=[...]): per step and GPU, how long the "
        "trainer's and the engines' kernels ran, both at once, and idle; writes "
        "OUTPUT_DIR/profile/timeline.json.gz (one Chrome trace of every process, for ui.perfetto.dev).",
    )
    p.add_argument("output_dir", help="the run's output_dir (or its profile/ folder)")
    a = p.parse_args(argv)
    folder = Path(a.output_dir)
    folder = folder if (folder / "windows.jsonl").is_file() else folder / "profile"
    if not folder.is_dir():
        print(
            f"rlcore.timeline: error: {folder} does not exist: the run recorded no step (set profile.steps=[N])",
            file=sys.stderr,
        )
        return 2
    try:
        lines = build(folder)
    except (OSError, ValueError, KeyError) as exc:  # a truncated or foreign file: name it, no traceback
        print(
            f"rlcore.timeline: error: cannot read the traces under {folder}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
