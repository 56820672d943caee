"""The documented commands (README and the guide's pages under docs/) compose to what their
comments promise."""

import re
import shlex
from pathlib import Path

from rlcore.plan.compose import compose

ROOT = Path(__file__).resolve().parent.parent
README = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def documented(marker: str) -> list[str]:
    """The overrides of the documented command whose comment contains `marker` (continuation
    lines joined)."""
    text = README.replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "python -m rlcore.run" in ln and marker in ln)
    words = shlex.split(line.split("#", 1)[0])
    return words[words.index("rlcore.run") + 1 :]


def test_rl_from_the_sft_model_skips_the_second_warmup():
    cfg = compose(documented("RL from it"))
    assert cfg.model.path == "outputs/reverse_text_sft/hf" and cfg.sft.warmup_steps == 0


def test_documented_evals_do_not_write_into_an_rl_run():
    rl_dirs = {compose(["+recipe=reverse_text"]).output_dir, compose([]).output_dir}
    for marker in ("eval a checkpoint", "eval a HF model"):
        cfg = compose(documented(marker))
        assert cfg.mode == "eval" and cfg.output_dir not in rl_dirs, (marker, cfg.output_dir)
        assert not re.match(r"outputs/reverse_text(/|$)", cfg.output_dir)
