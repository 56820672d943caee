"""Entry point: ``python -m rlcore.export CHECKPOINT_DIR OUT_DIR [--force]`` (a checkpoint as a
Hugging Face model directory); the code is :mod:`rlcore.storage.export`."""

import sys

from rlcore.storage.export import main

if __name__ == "__main__":
    sys.exit(main())
