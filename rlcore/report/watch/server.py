"""The page's HTTP server: the stdlib's threading HTTP server, read-only (GET only), on
127.0.0.1 unless told otherwise.

Routes: `/` (the page), `/static/NAME` (the files shipped in `rlcore/report/watch_static/`),
`/api/runs` (the runs followed), `/api/run/I?epoch=E&rows=R&samples=S&events=V` (what a page that
holds R rows, S samples and V events of run I lacks; see `RunView.payload`).
"""

from __future__ import annotations

import argparse
import json
import mimetypes
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from rlcore.report.watch.run_view import RunView

STATIC = Path(__file__).resolve().parent.parent / "watch_static"
USAGE = "python -m rlcore.watch OUTPUT_DIR [OUTPUT_DIR ...] [--port PORT] [--host HOST]"


def make_handler(runs: list[RunView]) -> type[BaseHTTPRequestHandler]:
    static = {p.name: p for p in STATIC.iterdir() if p.is_file()}

    class Handler(BaseHTTPRequestHandler):
        server_version = "rlcore-watch"

        def log_message(self, format, *args):  # noqa: A002 (the stdlib's name): no line per request
            pass

        def _send(self, body: bytes, content_type: str, status: int = 200) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj, status: int = 200) -> None:
            self._send(json.dumps(_finite(obj), allow_nan=False, default=str).encode(), "application/json", status)

        def do_GET(self):  # noqa: N802 (the stdlib's name)
            url = urlsplit(self.path)
            parts = [p for p in url.path.split("/") if p]
            if not parts:
                return self._send(static["index.html"].read_bytes(), "text/html; charset=utf-8")
            if parts[0] == "static" and len(parts) == 2 and parts[1] in static:
                kind = mimetypes.guess_type(parts[1])[0] or "application/octet-stream"
                return self._send(static[parts[1]].read_bytes(), kind)
            if parts == ["api", "runs"]:
                return self._json([{"index": i, "name": r.name, "path": str(r.dir)} for i, r in enumerate(runs)])
            if len(parts) == 3 and parts[:2] == ["api", "run"] and parts[2].isdigit() and int(parts[2]) < len(runs):
                q = {
                    k: int(v[0])
                    for k, v in parse_qs(url.query).items()
                    if k in ("epoch", "rows", "samples", "events") and v[0].isdigit()
                }
                return self._json(
                    runs[int(parts[2])].payload(
                        q.get("epoch", 0), q.get("rows", 0), q.get("samples", 0), q.get("events", 0)
                    )
                )
            return self._json({"error": f"not found: {url.path}"}, 404)

    return Handler


def _finite(obj):
    """NaN and infinities (a diverged loss) as null: JSON has no spelling for them."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rlcore.watch",
        usage=USAGE,
        description="A live page of one or more runs, read from their output folders "
        "(metrics.jsonl, samples.jsonl, events.jsonl); read-only.",
    )
    p.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR", help="a run's output_dir (several: side by side)")
    p.add_argument("--port", type=int, default=8765, help="port to serve on (0: any free port; default 8765)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; on a cluster forward the port, as for Ray's dashboard)",
    )
    p.add_argument("--quiet", action="store_true", help="print nothing but errors (the run prints the address)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    missing = [d for d in args.output_dirs if not Path(d).is_dir()]
    if missing:
        print(f"rlcore.watch: error: {missing[0]}: no such folder (give a run's output_dir)", file=sys.stderr)
        return 2
    runs = [RunView(Path(d)) for d in args.output_dirs]
    try:
        server = ThreadingHTTPServer((args.host, args.port), make_handler(runs))
    except OSError as exc:
        print(f"rlcore.watch: error: cannot serve on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    server.daemon_threads = True
    host, port = server.server_address[:2]
    if not args.quiet:
        print(f"rlcore.watch: http://{host}:{port}/ ({len(runs)} run(s); Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
