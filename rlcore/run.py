"""Entry point: ``python -m rlcore.run [+recipe=NAME] [key=value ...]``.

Composes ``conf/`` (plus ``recipes/NAME.yaml``) with Hydra, validates the whole config before
Ray starts (a bad key or value exits with code 2 and one line naming it), connects to
``RAY_ADDRESS`` or starts a local Ray, runs, and shuts everything down, also on Ctrl-C.

The composition root, the one module of `rlcore` that may import `ray` and `actors/`
(`tests/test_layers.py` checks the layers). It imports hydra, torch (through
`rlcore.models.build` and `rlcore.sft.dataset`), `ray` and `actors/` inside the functions that need
them, so validation (:mod:`rlcore.plan`, torch- and Ray-free) answers a bad config before any
of them loads (`tests/test_config_keys.py` checks it). Every config problem is decided in
:mod:`rlcore.plan`; this module only reports `ConfigError` (exit code 2).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from actors.session import RayStartError, live_nodes, local_ray_environment, ray_address, start_ray
from rlcore.config import RunConfig
from rlcore.config.errors import ConfigError, keyed_errors
from rlcore.config.nodes import config_dict, to_node
from rlcore.engine.registry import inert_options
from rlcore.models.shipped import resolve as resolve_model
from rlcore.plan.cli import FlagError, help_text, job_output_dir, parse_flags, sweep_jobs
from rlcore.plan.compose import CONF_DIR, compose, recipes
from rlcore.plan.interrupt import StopRequest
from rlcore.plan.layout import format_plan, make_plan, run_plan
from rlcore.plan.overrides import one_line, override_key
from rlcore.plan.placement import resolve
from rlcore.plan.validate import Capacity, validate
from rlcore.report.console import EXIT_CONFIG, log_error_detail, report_config_error, report_error
from rlcore.report.events import EventLog
from rlcore.report.metrics import MetricsLogger
from rlcore.report.plot import write_run_plot
from rlcore.report.startup import StartupPhases
from rlcore.report.summary import run_summary
from rlcore.report.watch.beside import start_page, stop_page
from rlcore.storage.errors import StorageError
from rlcore.storage.location import with_local_paths
from rlcore.storage.rundir import claim_output_dir, last_checkpoint_hint
from rlcore.storage.staging import Sync, claim, download

EXIT_RUN = 1
QUIET_LIBRARIES = ("aiobotocore", "botocore", "s3fs", "gcsfs", "adlfs", "fsspec")
"""Libraries whose INFO lines stay off the run's console (warnings and errors still show)."""
EXIT_INTERRUPTED = 130


def warn_inert(cfg: RunConfig) -> None:
    """One warning line per option a YAML file (a recipe) set for an engine the run does not use
    (e.g. the recipe's `rollout.vllm.*` under `rollout.engine=hf`): kept, it changes nothing."""
    for key, message in inert_options(cfg):
        print(f"rlcore: warning: {key}: {message}: ignored", file=sys.stderr)


def local_gpu_bytes(cfg: RunConfig) -> int | None:
    """Memory of one GPU for the colocated memory plan: `cluster.gpu_memory_gib`, else this
    machine's GPU 0, else None (plan skipped)."""
    if cfg.cluster.gpu_memory_gib:
        return int(cfg.cluster.gpu_memory_gib * 2**30)
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def check_cluster(cfg: RunConfig) -> RunConfig:
    """Resources asked vs. resources present: locally before Ray starts, remotely right after.
    Returns `cfg` with its placement resolved for those GPUs (`rlcore.plan.placement.resolve`)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        res = ray.cluster_resources()
        cpus, gpus, where = res.get("CPU", 0), res.get("GPU", 0), "the Ray cluster"
        gpu_bytes = int(cfg.cluster.gpu_memory_gib * 2**30) if cfg.cluster.gpu_memory_gib else None
        nodes = tuple(live_nodes())
    else:
        import torch

        cpus = cfg.cluster.num_cpus or os.cpu_count() or 1
        gpus = cfg.cluster.num_gpus if cfg.cluster.num_gpus is not None else torch.cuda.device_count()
        where, gpu_bytes = "this machine", local_gpu_bytes(cfg) if gpus else None
        nodes = ()  # one node without labels
    cfg = resolve(cfg, gpus, gpu_bytes)
    validate(cfg, on=Capacity(cpus, gpus, gpu_bytes, where, nodes))
    return cfg


def prepare(cfg: RunConfig):
    """Input a mode reads before Ray starts, so bad data fails like a bad config (exit 2): the
    tokenized SFT dataset for `mode=sft`, nothing otherwise."""
    if cfg.mode != "sft":
        return None
    from rlcore.models.tokenizer_build import build_tokenizer
    from rlcore.sft.dataset import DataError, build_dataset

    with keyed_errors(DataError):
        return build_dataset(cfg, build_tokenizer(cfg.model))


def make_runner(cfg: RunConfig, prepared=None, stop: StopRequest | None = None):
    """The driver of `cfg.mode` (placement resolved), handed the run's plan, made here once
    (`rlcore.plan.layout.run_plan`: the groups it places, their pools and shares); each has
    setup(), run(logger) -> step records, shutdown(). `stop`: the RL driver stops at the step
    boundary after it is requested."""
    plan = run_plan(cfg)
    if cfg.mode == "sft":
        from actors.sft import SFTDriver

        return SFTDriver(plan, prepared)
    if cfg.mode == "eval":
        from actors.evaluation import EvalDriver

        return EvalDriver(plan)
    from actors.driver import Driver

    return Driver(plan, stop)


def summary(
    cfg: RunConfig,
    history: list[dict],
    eval_rows: list[dict] = (),
    phases: list[tuple[str, float]] = (),
    startup_s: float | None = None,
) -> str:
    """The end-of-run summary (rlcore.report.summary), pointing to the plot when the run wrote one;
    `startup_s`: the wall time from the process's start to step 1 (RL)."""
    out = Path(cfg.output_dir)
    where = cfg.storage.url or str(out)  # an object-store run's files end there, not in its staging folder
    artifact = f"plot: {where}/plot.png" if (out / "plot.png").is_file() else f"metrics: {where}/metrics.jsonl"
    return run_summary(cfg.mode, history, eval_rows, phases, artifact, startup_s)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LIBRARIES:  # their INFO lines are not the run's (an object store's credentials found)
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        flags = parse_flags(argv)
    except FlagError as exc:
        print(f"rlcore: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if flags.help:
        print(help_text(CONF_DIR, recipes()))
        return 0
    if flags.multirun:
        return multirun(flags.overrides)
    return run_job(flags.overrides, print_cfg=flags.print_cfg)


def multirun(overrides: list[str]) -> int:
    """One job per combination of the sweep overrides, in OUTPUT_DIR/<job>; all jobs are
    composed and validated before the first starts. Returns the worst exit code."""
    try:
        jobs = sweep_jobs(overrides)
        base = compose(jobs[0]).output_dir
        jobs = [
            [o for o in job if override_key(o) != "output_dir"] + [f"output_dir={job_output_dir(base, i)}"]
            for i, job in enumerate(jobs)
        ]
        for job in jobs:
            validate(compose(job))
    except ConfigError as exc:
        return report_config_error(exc)
    except Exception as exc:  # Hydra's override grammar errors
        print(f"rlcore: config error: multirun: {one_line(exc)}", file=sys.stderr)
        return EXIT_CONFIG
    codes = []
    for i, job in enumerate(jobs):
        print(f"rlcore: multirun job {i + 1}/{len(jobs)}: {' '.join(job)}", flush=True)
        codes.append(run_job(job))
    print(f"rlcore: multirun: {sum(c == 0 for c in codes)}/{len(jobs)} jobs succeeded under {base}")
    return max(codes)


def run_job(argv: list[str], print_cfg: bool = False) -> int:
    """Compose, validate, place and run one job."""
    try:
        # the run's storage as absolute paths: every actor, on any node, gets the same folder
        cfg = with_local_paths(compose(argv))
        download(cfg)  # an object-store output_dir: its files into the local staging folder first
        validate(cfg)
        warn_inert(cfg)
        if print_cfg:
            print(OmegaConf.to_yaml(to_node(cfg)), end="")
            return 0
        if cfg.cluster.nodes is not None or cfg.dry_run:
            plan = make_plan(cfg)  # the described cluster (or this machine as one node)
            cfg = plan.config  # placement resolved for the plan's GPUs
            if cfg.dry_run:
                print(format_plan(cfg, plan))
            validate(cfg, planned=plan.problems)
            if cfg.dry_run:
                return 0
        elif ray_address(cfg.cluster) is None:
            cfg = check_cluster(cfg)
        cfg.model = resolve_model(cfg.model)  # pypi:PACKAGE -> its converted directory, before any actor
        prepared = prepare(cfg)
        out, lock = claim_output_dir(cfg)
        try:
            claim(cfg)  # an object-store output_dir: its lease
        except ConfigError:
            lock.close()
            raise
    except ConfigError as exc:
        return report_config_error(exc)
    try:
        with Sync(cfg) as sync:  # an object-store output_dir: uploads during the run and at its end
            code = _run_prepared(cfg, prepared, out, sync)
        return EXIT_RUN if sync.failed and code == 0 else code
    finally:
        lock.close()  # the folder is free for the next run (exit or a crash frees it too)


def _run_prepared(cfg: RunConfig, prepared, out: Path, sync: Sync) -> int:
    """Run the job with its timeline in events.jsonl and, with `logger.watch_port`, the live page
    beside it (its own process: the run pays nothing for it)."""
    events = EventLog(out)
    events.write("start", f"{cfg.mode} run started", mode=cfg.mode, steps=cfg.steps)
    page = start_page(out, cfg.logger.watch_port)
    code = EXIT_RUN
    try:
        with events.capture(logging.getLogger("rlcore")):  # fault lines tagged as events (`report.events.event`)
            code = _run_session(cfg, prepared, out, events, sync)
        return code
    finally:
        events.write("end", f"run ended (exit code {code})", exit_code=code)
        stop_page(page)


def _run_session(cfg: RunConfig, prepared, out: Path, events: EventLog, sync: Sync) -> int:
    """Start Ray and run the job of a validated config into its (locked) folder. A run refused
    before it began (Ray would not start, the cluster does not fit) uploads nothing (`sync`)."""

    address = ray_address(cfg.cluster)
    if address is None:
        local_ray_environment()
    import ray

    from actors.remote import RunError

    ray_phase = StartupPhases()
    ray_phase.listener = events.phase
    try:
        with ray_phase.phase("starting Ray" if address is None else f"connecting to Ray at {address}"):
            start_ray(cfg)
    except RayStartError as exc:
        sync.discard()
        print(f"rlcore: error: {exc}", file=sys.stderr)
        return EXIT_RUN
    # after ray.init: it installs a fatal-signal handler that prints a C++ stack on SIGTERM
    stop = StopRequest(graceful=cfg.mode == "rl").install()
    driver = None
    logger = None
    try:
        if address is not None:
            cfg = check_cluster(cfg)
        driver = make_runner(cfg, prepared, stop)
        driver.startup.listener = events.phase
        driver.setup()
        logger = MetricsLogger(cfg.logger, str(out), config_dict(cfg), 0 if cfg.mode == "eval" else cfg.steps)
        history = driver.run(logger)
        logger.close()  # before the summary: the progress bar stops, the files are complete
        if history:
            write_run_plot(out)  # before the summary, which points to it
            print(
                summary(
                    cfg,
                    history,
                    logger.eval_rows,
                    ray_phase.done + driver.startup.done,
                    getattr(driver, "ready_at", None),
                )
            )
            profiler = getattr(driver, "profiler", None)  # profile.steps: the recorded steps' timeline
            for line in profiler.report() if profiler is not None else []:
                print(line)
        if stop.requested:
            events.write(
                "interrupt",
                f"{stop.signal_name or 'SIGINT'}: stopped after the step in flight",
                step=history[-1].get("step") if history else None,
            )
        return EXIT_INTERRUPTED if stop.requested else 0
    except ConfigError as exc:
        if driver is None:  # refused before the run began (the cluster's check)
            sync.discard()
        return report_config_error(exc)
    except KeyboardInterrupt:
        events.write("interrupt", f"{stop.signal_name or 'SIGINT'}: stopped at once")
        print(
            f"rlcore: interrupted ({stop.signal_name or 'SIGINT'}); stopped at once, no checkpoint kept of this "
            f"point; {last_checkpoint_hint(cfg)}; shutting down",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except (RunError, TimeoutError, ray.exceptions.RayError) as exc:  # RayError: an actor's own exception
        print(report_error(str(exc), cfg.output_dir), file=sys.stderr)
        return EXIT_RUN
    except StorageError as exc:  # a series row or a file of the run not written (a full disk): SFT, eval
        log_error_detail(cfg.output_dir, traceback.format_exc())
        print(f"rlcore: error: {exc}; {last_checkpoint_hint(cfg)}", file=sys.stderr)
        return EXIT_RUN
    finally:
        if logger is not None:
            logger.close()
        if driver is not None:
            driver.shutdown()
        ray.shutdown()
        stop.restore()


if __name__ == "__main__":
    sys.exit(main())
