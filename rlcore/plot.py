"""Entry point: ``python -m rlcore.plot OUTPUT_DIR [OUTPUT_DIR ...] [-o FILE]`` (the curves of
one or more runs as a PNG); the code is :mod:`rlcore.report.plot`."""

import sys

from rlcore.report.plot import main

if __name__ == "__main__":
    sys.exit(main())
