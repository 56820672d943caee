"""Entry point: ``python -m rlcore.watch OUTPUT_DIR [OUTPUT_DIR ...] [--port PORT] [--host HOST]``
(a live page of one or more runs, read from their output folders); the code is
:mod:`rlcore.report.watch`."""

import sys

from rlcore.report.watch.server import main

if __name__ == "__main__":
    sys.exit(main())
