"""The live page beside a run (`logger.watch_port`): its own process, so the driver pays nothing
for a page that is open, and it goes when the run ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def start_page(output_dir: Path, port: int) -> subprocess.Popen | None:
    """Start `python -m rlcore.watch OUTPUT_DIR --port PORT` and print the page's address; None
    when `port` is 0. A page that cannot bind says so in its own line; the run goes on."""
    if not port:
        return None
    page = subprocess.Popen(
        [sys.executable, "-m", "rlcore.watch", str(output_dir), "--port", str(port), "--quiet"],
        stdin=subprocess.DEVNULL,
    )
    print(
        f"rlcore: live page: http://127.0.0.1:{port}/ (on a cluster: ssh -L {port}:127.0.0.1:{port} HEAD_NODE; "
        f"or later: python -m rlcore.watch {output_dir})",
        flush=True,
    )
    return page


def stop_page(page: subprocess.Popen | None) -> None:
    """End the page process (it only reads files: nothing to flush)."""
    if page is None:
        return
    page.terminate()
    try:
        page.wait(timeout=5)
    except subprocess.TimeoutExpired:
        page.kill()
        page.wait(timeout=5)
