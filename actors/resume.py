"""The one resume path of RL and SFT: a checkpoint of the mode's kind, its config compared with
the run's, the trainer's weights and optimizer loaded, the driver's RNG restored, and the run's
series cut back to its step. What each mode restores besides (RL: the run state, the engines'
weights and RNG; SFT: nothing) stays with that mode."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

from actors.remote import RunError
from actors.trainer_group import TrainerGroup
from rlcore.config import RunConfig
from rlcore.config.nodes import config_dict
from rlcore.storage import checkpoint as ckpt

log = logging.getLogger("rlcore")

OTHER_KIND = {
    "rl": "; to start RL from it, export it (python -m rlcore.export {path} OUT) and set model.path=OUT",
    "sft": "",
}


def resume_from(
    path: Path,
    kind: str,
    cfg: RunConfig,
    trainers: TrainerGroup,
    series: tuple[str, ...],
    phase: Callable[[str], Any] | None = None,
    drop_eval_at_step: Callable[[dict], bool] | None = None,
) -> tuple[dict[str, Any], int]:
    """Load checkpoint `path` of `kind` (`rl`, `sft`) into `trainers` and cut each of `series`
    (files of `output_dir`) back to its step. Returns (the driver state it holds, the policy
    version the trainer loaded). RunError naming `checkpoint.resume` when it is another kind.
    `phase`: the timer of the load (a start-up phase); `drop_eval_at_step(state)`: whether the
    evaluation row at the checkpoint's own step goes too (its result was not logged)."""
    state = ckpt.load_driver_state(path)
    if state.get("kind") != kind:
        raise RunError(
            f"checkpoint.resume: {path} is a {state.get('kind')!r} checkpoint, not an {kind.upper()} one"
            + OTHER_KIND.get(kind, "").format(path=path)
        )
    warn_config_changes(path, cfg)
    with (phase or (lambda _: contextlib.nullcontext()))("loading the checkpoint"):
        version = trainers.load(path)
    ckpt.set_rng_state(state["rng"])
    step = int(state["step"])
    drop_eval = bool(drop_eval_at_step and drop_eval_at_step(state))
    for name in series:
        removed = ckpt.truncate_series(Path(cfg.output_dir) / name, step, drop_eval_at_step=drop_eval)
        if removed:
            log.info("resume: dropped %d rows of %s logged after step %d", removed, name, step)
    return state, version


def warn_config_changes(path: Path, cfg: RunConfig) -> None:
    """One warning line naming the keys whose values differ from the checkpoint's config."""
    try:
        changed = ckpt.config_differences(ckpt.read_meta(path).get("config") or {}, config_dict(cfg))
    except Exception:  # an unreadable meta is not a reason to refuse a resume
        return
    if changed:
        log.warning(
            "resume: config differs from the checkpoint's in %s%s",
            ", ".join(changed[:8]),
            " ..." if len(changed) > 8 else "",
        )
