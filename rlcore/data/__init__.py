"""Small datasets shipped with rlcore (no downloads at run time) and the scripts that made them."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent


def data_path(name: str) -> Path:
    """Absolute path of a shipped data file."""
    return DATA_DIR / name
