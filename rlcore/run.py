"""Entry point: ``python -m rlcore.run [+recipe=NAME] [key=value ...]``.

Composes ``conf/`` (plus ``recipes/NAME.yaml``) with Hydra, validates the whole config before
Ray starts (a bad key or value exits with code 2 and one line naming it), connects to
``RAY_ADDRESS`` or starts a local Ray, runs, and shuts everything down, also on Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlcore.config import RunConfig
from rlcore.models.shipped import resolve as resolve_model
from rlcore.plan import format_plan, make_plan
from rlcore.plot import write_run_plot
from rlcore.validate import ConfigError, resource_problems, validate

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
RECIPES_DIR = REPO / "recipes"

EXIT_CONFIG = 2
EXIT_RUN = 1
EXIT_INTERRUPTED = 130


def recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors span several lines (key, value, type); keep the first two
    meaningful ones on one line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        lines += [ln.strip() for ln in str(cause).splitlines()[:1] if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("object_type", "Set the environment variable"))]
    return " | ".join(keep[:3]) or type(exc).__name__


def compose(overrides: list[str]) -> RunConfig:
    """Hydra composition of conf/config.yaml, the recipe, and the command-line overrides,
    typed against the RunConfig schema. Raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    recipe = None
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "recipe":
            recipe = value
            if value not in recipes():
                raise ConfigError("recipe", f"unknown recipe {value!r}; choose one of {recipes()}")
    overrides = ["+recipe=" + recipe if o.lstrip("+").startswith("recipe=") else o for o in overrides]
    # `resume=true|PATH` is the documented spelling of `checkpoint.resume=...`
    overrides = ["checkpoint." + o.lstrip("+") if o.lstrip("+").startswith("resume=") else o for o in overrides]

    ConfigStore.instance().store(name="rlcore_schema", node=RunConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except Exception as exc:  # Hydra/OmegaConf raise many types; all mean "bad config"
        key = getattr(exc, "full_key", None) or _key_from(exc)
        raise ConfigError(key or "config", _one_line(exc)) from None
    obj: RunConfig = OmegaConf.to_object(cfg)
    obj.recipe = recipe
    return obj


def _key_from(exc: BaseException) -> str | None:
    cause = exc.__cause__ or exc.__context__
    return getattr(cause, "full_key", None) if cause else None


def check_cluster(cfg: RunConfig) -> None:
    """Resources asked vs. resources present: locally before Ray starts, remotely right after."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        res = ray.cluster_resources()
        found = resource_problems(cfg, res.get("CPU", 0), res.get("GPU", 0), "the Ray cluster")
    else:
        import torch
        cpus = cfg.cluster.num_cpus or os.cpu_count() or 1
        gpus = cfg.cluster.num_gpus if cfg.cluster.num_gpus is not None else torch.cuda.device_count()
        found = resource_problems(cfg, cpus, gpus, "this machine")
    if found:
        raise ConfigError(*found[0])


def local_ray_environment() -> None:
    """Settings for a single-node Ray started by this process; Ray reads them at import."""
    # the cluster shares this interpreter and checkout: keep Ray's `uv run` integration from
    # packaging the working dir and building a new venv for every worker
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # single-node mode: Ray, gloo and the weight-sync store all stay on the loopback address
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def prepare(cfg: RunConfig):
    """Input a mode reads before Ray starts, so bad data fails like a bad config (exit 2): the
    tokenized SFT dataset for `mode=sft`, nothing otherwise."""
    if cfg.mode != "sft":
        return None
    from rlcore.models.build import build_tokenizer
    from rlcore.sft import DataError, build_dataset
    try:
        return build_dataset(cfg, build_tokenizer(cfg.model))
    except DataError as exc:
        key, _, msg = str(exc).partition(": ")
        raise ConfigError(key, msg) from None


def make_runner(cfg: RunConfig, prepared=None):
    """The driver of `cfg.mode`; each has setup(), run(logger) -> step records, shutdown()."""
    if cfg.mode == "sft":
        from rlcore.sft import SFTDriver
        return SFTDriver(cfg, prepared)
    if cfg.mode == "eval":
        from rlcore.evaluation import EvalDriver
        return EvalDriver(cfg)
    from rlcore.driver import Driver
    return Driver(cfg)


def summary(cfg: RunConfig, history: list[dict]) -> str:
    first, last = history[0], history[-1]
    if cfg.mode == "sft":
        return f"{len(history)} SFT steps, loss {first['loss']:.4f} -> {last['loss']:.4f}"
    if cfg.mode == "eval":
        passes = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in sorted(last.items())
                           if k.startswith("eval/pass@"))
        return f"eval of step {last['step']}: reward_mean {last['eval/reward_mean']:.3f}, {passes}"
    return f"{len(history)} steps, reward_mean {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}"


def ray_address(cfg: RunConfig) -> str | None:
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = compose(argv)
        validate(cfg)
        if cfg.cluster.nodes is not None or cfg.dry_run:
            plan = make_plan(cfg)  # the described cluster (or this machine as one node)
            if cfg.dry_run:
                print(format_plan(cfg, plan))
            if plan.problems:
                raise ConfigError(*plan.problems[0])
            if cfg.dry_run:
                return 0
        elif ray_address(cfg) is None:
            check_cluster(cfg)
        cfg.model = resolve_model(cfg.model)  # pypi:PACKAGE -> its converted directory, before any actor
        prepared = prepare(cfg)
    except ConfigError as exc:
        print(f"rlcore: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    if ray_address(cfg) is None:
        local_ray_environment()
    import ray

    from rlcore.driver import RunError, config_dict
    from rlcore.metrics import MetricsLogger

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), out / "config.yaml")
    address = ray_address(cfg)
    ray.init(address=address, num_cpus=None if address else cfg.cluster.num_cpus,
             num_gpus=None if address else cfg.cluster.num_gpus, include_dashboard=False,
             log_to_driver=True, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}} if address is None else None)
    driver = None
    logger = None
    try:
        if address is not None:
            check_cluster(cfg)
        driver = make_runner(cfg, prepared)
        driver.setup()
        logger = MetricsLogger(cfg.logger, str(out), config_dict(cfg), 0 if cfg.mode == "eval" else cfg.steps)
        history = driver.run(logger)
        if history:
            plot = write_run_plot(out)  # metrics.jsonl is line-buffered: every row is written
            print(f"rlcore: done: {summary(cfg, history)}; metrics in {out / 'metrics.jsonl'}"
                  + (f"; plot in {plot}" if plot else ""))
        return 0
    except ConfigError as exc:
        print(f"rlcore: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("rlcore: interrupted; shutting down", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RunError, TimeoutError) as exc:
        print(f"rlcore: error: {exc}", file=sys.stderr)
        return EXIT_RUN
    finally:
        if logger is not None:
            logger.close()
        if driver is not None:
            driver.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
