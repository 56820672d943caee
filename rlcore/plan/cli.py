"""Hydra's command-line conventions on top of the compose API that `rlcore.run` uses.

`rlcore.run` composes with `hydra.compose` (so validation runs before Ray and every error is one
line), which leaves Hydra's own flags to this module:

- `--help` / `-h`: the config groups with their options, the recipes, and how to override.
- `--cfg job`: print the composed config (after validation) and exit.
- `-m` / `--multirun`: sweep overrides (`trainer.lr=1e-3,3e-3`, `range(...)`, `choice(...)`) run
  one job per combination, one after another, each in `OUTPUT_DIR/<job number>`; every job is
  composed and validated before the first one starts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

HELP_FLAGS = ("--help", "-h")
MULTIRUN_FLAGS = ("-m", "--multirun")


@dataclass
class Flags:
    """Hydra-style flags found on the command line, and the overrides left after them."""

    help: bool
    print_cfg: bool
    multirun: bool
    overrides: list[str]


class FlagError(ValueError):
    """A flag this CLI does not support (one line, exit 2)."""


def parse_flags(argv: list[str]) -> Flags:
    """Split `argv` into Hydra-style flags and key=value overrides."""
    help_ = print_cfg = multirun = False
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in HELP_FLAGS:
            help_ = True
        elif arg in MULTIRUN_FLAGS:
            multirun = True
        elif arg in ("--cfg", "-c"):
            what = next(args, None)
            if what != "job":
                raise FlagError(f"--cfg: only `--cfg job` (the composed config) is supported, got {what!r}")
            print_cfg = True
        elif arg.startswith("-"):
            raise FlagError(f"{arg}: unknown flag; use --help, --cfg job or -m (multirun)")
        else:
            rest.append(arg)
    return Flags(help_, print_cfg, multirun, rest)


def groups(conf_dir: Path) -> dict[str, list[str]]:
    """Config group name -> its options (the YAML files under `conf/GROUP/`)."""
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(conf_dir.iterdir())
        if d.is_dir() and d.name != "recipe"
    }


def help_text(conf_dir: Path, recipe_names: list[str]) -> str:
    lines = [
        "usage: python -m rlcore.run [+recipe=NAME] [GROUP=OPTION ...] [key=value ...] [--cfg job] [-m]",
        "",
        "With no arguments: the embedded default (reverse_text on a tiny model, this CPU, offline).",
        "",
        "recipes (+recipe=NAME):",
        "  " + ", ".join(recipe_names),
        "",
        "config groups (GROUP=OPTION):",
    ]
    lines += [f"  {name}: {', '.join(options)}" for name, options in groups(conf_dir).items()]
    lines += [
        "",
        "keys: every field of the schema in rlcore/config/, e.g. steps=20 trainer.lr=3e-4",
        "  rollout.engine=vllm env.args.eval_size=32 output_dir=outputs/try1 resume=true",
        "",
        "flags:",
        "  --cfg job        print the composed, validated config and exit",
        "  -m, --multirun   one job per combination of comma-separated values,",
        "                   e.g. -m trainer.lr=1e-3,3e-3 (jobs write to OUTPUT_DIR/0, OUTPUT_DIR/1, ...)",
        "  dry_run=true     print the placement plan and exit",
    ]
    return "\n".join(lines)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The cartesian product of the sweep overrides, as one override list per job, in Hydra's
    order (the last sweep varies fastest). Overrides that do not sweep appear in every job."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override():
            prefix = o.input_line.split("=", 1)[0]
            choices.append([f"{prefix}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def job_output_dir(base: str, job: int) -> str:
    """The folder of sweep job `job` under `base` (a path or an object store's URL: joined as text,
    since a `Path` would fold `s3://` into `s3:/`)."""
    return f"{str(base).rstrip('/')}/{job}"
