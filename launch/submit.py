"""Submit an rlcore run to a Ray cluster through the Ray Jobs API and follow it to its end.

    python -m launch.submit --address http://HEAD:8265 -- +recipe=NAME key=value ...
    python -m launch.submit --address http://HEAD:8265 --follow SUBMISSION_ID
    python -m launch.submit --address http://HEAD:8265 --stop SUBMISSION_ID

Everything after ``--`` is handed to ``python -m rlcore.run`` unchanged. The repository is shipped
as the job's working directory, the job's logs stream back here, and this process exits with the
job's outcome:

    0    SUCCEEDED
    N    FAILED: the entrypoint's own exit code N when Ray reports one, else 1
    3    STOPPED (by someone else, e.g. ``--stop``; Ctrl-C here leaves the job running)
    124  --timeout ran out (the job is stopped, so it does not hold the cluster)
    2    bad arguments, or the cluster could not be reached or did not answer in time
    130  interrupted here (the job keeps running)

Dependencies (``--deps``):

* ``lock`` (default): the pins of ``uv.lock`` (``uv export --frozen``, no dev group, the chosen
  extras) go to Ray's ``uv`` runtime-env plugin. Ray builds one virtualenv per distinct pin list
  on each node and caches it, so the first job on a node pays for the install and later jobs with
  the same lock start at once. uv rather than pip because it is the tool that wrote the lock and
  installs the ~230 wheels of a torch + vLLM environment several times faster. The project itself
  is not installed: the shipped working directory is the job's cwd, so ``rlcore`` and ``conf/``
  import from there. Hashes are left out because the pin list travels inside the job's metadata.
* ``preinstalled``: ship only the code; the cluster's Python already has the locked environment
  (nodes running the image from docker/, or a local cluster started from this repo's venv).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent

# Never worth shipping: environments, caches, run outputs, VCS data, GPU staging. Ray also honours
# .gitignore files, but the repository may not ignore everything here (e.g. a local outputs/).
WORKING_DIR_EXCLUDES = [
    ".venv/",
    ".git/",
    ".gpu-stage/",
    "outputs/",
    "multirun/",
    "wandb/",
    "**/__pycache__/",
    "*.pyc",
    ".pytest_cache/",
    ".hypothesis/",
    ".ruff_cache/",
    ".mypy_cache/",
]

EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
MAX_STATUS_FAILURES = 5

# A Hydra override: key=value, +key=value, ++key=value, or ~key (delete).
_OVERRIDE = re.compile(r"^(?:(?:\+\+|\+)?[A-Za-z_][\w.@/\-]*=.*|~[A-Za-z_][\w.@/\-]*(?:=.*)?)$", re.S)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

T = TypeVar("T")


class LaunchError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run a blocking call in a daemon thread and give up after ``timeout_s``.

    Ray's job client issues its HTTP requests without any timeout, so a head that accepts the
    connection but never answers would hang us forever. A daemon thread is abandoned, not joined,
    when we give up, so a stuck request cannot keep the process alive at exit either.
    """
    result: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            result.set_result(fn())
        except BaseException as exc:  # handed over to the caller's thread as-is
            result.set_exception(exc)

    threading.Thread(target=target, name=f"launch:{what}", daemon=True).start()
    try:
        return result.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise LaunchError(f"{what}: no answer within {timeout_s:g} s") from None


async def call_with_timeout_async(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``call_with_timeout`` for use inside the event loop, without blocking it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            value, exc = fn(), None
        except BaseException as caught:
            value, exc = None, caught
        try:
            loop.call_soon_threadsafe(_settle, fut, value, exc)
        except RuntimeError:  # the loop is closed: the waiter gave up long ago
            pass

    threading.Thread(target=target, name=f"launch:{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(fut, timeout_s)
    except asyncio.TimeoutError:
        raise LaunchError(f"{what}: no answer within {timeout_s:g} s") from None


def _settle(fut: asyncio.Future, value: Any, exc: Optional[BaseException]) -> None:
    if fut.done():  # the waiter already gave up
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def locked_requirements(extras: Sequence[str], repo_root: Path = REPO_ROOT) -> list[str]:
    """The exact pins of uv.lock for a runtime (no dev group, no project), one requirement each."""
    uv = shutil.which("uv")
    if uv is None:
        raise LaunchError(
            "`uv` is not on PATH, so uv.lock cannot be exported for --deps lock; install uv, or "
            "pass --deps preinstalled if the cluster already has the environment"
        )
    cmd = [
        uv, "export", "--frozen", "--format", "requirements.txt", "--no-dev", "--no-emit-project",
        "--no-hashes", "--no-header", "--no-annotate",
    ]
    for extra in extras:
        cmd += ["--extra", extra]
    try:
        proc = subprocess.run(
            cmd, cwd=repo_root, capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        raise LaunchError("`uv export` did not finish within 120 s") from None
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise LaunchError(f"`uv export` failed (exit {proc.returncode}): {detail}")
    pins = [
        line.strip()
        for line in proc.stdout.splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "-"))
    ]
    if not pins:
        raise LaunchError("`uv export` produced no requirements; is uv.lock empty?")
    return pins


def build_runtime_env(
    deps: str,
    extras: Sequence[str],
    env_vars: dict[str, str],
    repo_root: Path = REPO_ROOT,
) -> dict[str, Any]:
    runtime_env: dict[str, Any] = {
        "working_dir": str(repo_root),
        "excludes": list(WORKING_DIR_EXCLUDES),
    }
    if deps == "lock":
        runtime_env["uv"] = {"packages": locked_requirements(extras, repo_root)}
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    return runtime_env


def entrypoint_for(overrides: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "rlcore.run", *overrides])


def default_submission_id(overrides: Sequence[str]) -> str:
    recipe = "default"
    for item in overrides:
        if item.startswith(("+recipe=", "recipe=", "++recipe=")):
            recipe = re.sub(r"[^A-Za-z0-9_-]", "-", item.split("=", 1)[1]) or "default"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"rlcore-{recipe}-{stamp}-{secrets.token_hex(2)}"


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Options for this launcher before ``--``, Hydra overrides for the run after it."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    own, overrides = split_argv(argv)
    parser = argparse.ArgumentParser(
        prog="python -m launch.submit",
        description="Submit `python -m rlcore.run OVERRIDES...` to a Ray cluster as a Ray job.",
        epilog="Example: python -m launch.submit --address http://127.0.0.1:8265 -- "
        "+recipe=reverse_text steps=100",
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_JOBS_ADDRESS", "http://127.0.0.1:8265"),
        help="the head's dashboard address, http(s)://HOST:PORT (default: $RAY_JOBS_ADDRESS or "
        "%(default)s)",
    )
    parser.add_argument(
        "--deps",
        choices=("lock", "preinstalled"),
        default="lock",
        help="lock: install uv.lock's pins in the job's runtime_env; preinstalled: the cluster's "
        "Python already has them (default: %(default)s)",
    )
    parser.add_argument(
        "--extras",
        default="vllm",
        help="comma-separated optional-dependency groups to install with --deps lock; '' for "
        "none (default: %(default)s)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the job and all its actors (repeatable), e.g. "
        "WANDB_API_KEY=...",
    )
    parser.add_argument("--submission-id", default=None, help="job id (default: generated)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=72 * 3600.0,
        help="seconds to wait for the job to finish before stopping it (default: 72 h)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds each request to the cluster may take, the working-dir upload included "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=10.0,
        help="seconds between status checks while no logs arrive (default: %(default)s)",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="print the submission id and exit 0 once the job is accepted",
    )
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--follow",
        metavar="SUBMISSION_ID",
        default=None,
        help="submit nothing: follow that job to its end (its logs from the start, then its "
        "outcome as the exit code)",
    )
    existing.add_argument(
        "--stop",
        metavar="SUBMISSION_ID",
        default=None,
        help="submit nothing: stop that job and wait until Ray reports it STOPPED (exit 0), "
        "or finished otherwise (its outcome's exit code)",
    )
    args = parser.parse_args(own)
    if (args.follow or args.stop) and (overrides or args.no_wait):
        parser.error(f"--{'follow' if args.follow else 'stop'} acts on a submitted job: no overrides after "
                     "`--`, no --no-wait")

    if not re.match(r"^https?://[^/\s]+", args.address):
        parser.error(
            f"--address {args.address!r} is not a dashboard URL; pass http://HOST:PORT of the "
            "head's dashboard (port 8265 by default), not the GCS address"
        )
    for name in ("timeout", "request_timeout", "poll"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    env_vars = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(key):
            parser.error(f"--env {item!r} is not KEY=VALUE")
        env_vars[key] = value
    args.env_vars = env_vars
    args.extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    for item in overrides:
        if not _OVERRIDE.match(item):
            parser.error(
                f"override {item!r} after `--` is not a Hydra override (key=value, +key=value, "
                "~key)"
            )
    return args, overrides


def _send_token_if_available() -> None:
    """Let Ray's HTTP client send this machine's cluster token.

    Ray clusters require a token by default, but Ray's job client attaches one only when
    RAY_AUTH_MODE=token; `ray start` and `ray.init` switch that on when a token exists
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). Do the same, and leave an explicit
    RAY_AUTH_MODE alone.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    # It logs a warning meant for cluster operators; for a client it is noise.
    setup_logger = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
    level = setup_logger.level
    setup_logger.setLevel(logging.ERROR)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        setup_logger.setLevel(level)


def _make_client(address: str, request_timeout: float):
    from ray.job_submission import JobSubmissionClient

    _send_token_if_available()

    def connect():
        try:
            return JobSubmissionClient(address)
        except ConnectionError as exc:
            raise LaunchError(f"cannot reach the Ray dashboard at {address}: {exc}") from None

    return call_with_timeout(connect, request_timeout, f"connecting to {address}")


async def follow(
    client: Any,
    job_id: str,
    *,
    timeout_s: float,
    request_timeout_s: float,
    poll_s: float,
    out: TextIO,
) -> Optional[Any]:
    """Stream the job's logs to ``out`` until it reaches a terminal state.

    Returns the final JobStatus, or None when ``timeout_s`` ran out first. The log stream is
    best-effort (its websocket has no timeout of its own and may drop); the job's status, polled
    whenever the stream is quiet for ``poll_s``, is what decides the end.
    """
    deadline = time.monotonic() + timeout_s
    queue: asyncio.Queue = asyncio.Queue()
    end_of_stream = object()

    async def pump() -> None:
        try:
            async for chunk in client.tail_job_logs(job_id):
                await queue.put(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dropped stream only ends streaming; status still decides
            await queue.put(f"[launch] log stream ended early ({exc}); polling the job status\n")
        await queue.put(end_of_stream)

    pump_task = asyncio.create_task(pump())
    streaming = True
    failures = 0
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if streaming:
                try:
                    item = await asyncio.wait_for(queue.get(), min(poll_s, remaining))
                except asyncio.TimeoutError:
                    item = None
                if item is end_of_stream:
                    streaming = False
                elif item is not None:
                    out.write(item)
                    out.flush()
                    continue
            try:
                status = await call_with_timeout_async(
                    lambda: client.get_job_status(job_id),
                    request_timeout_s,
                    "reading the job status",
                )
            except (LaunchError, RuntimeError, OSError) as exc:
                # A head that restarts or a flaky link should not end the follow; one that stays
                # silent for several polls in a row has gone, and we say so.
                failures += 1
                if failures >= MAX_STATUS_FAILURES:
                    raise LaunchError(
                        f"lost contact with the cluster ({failures} status checks failed, last: "
                        f"{exc}); the job may still be running"
                    ) from None
                out.write(f"[launch] status check failed ({exc}); retrying\n")
                await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
                continue
            failures = 0
            if status.is_terminal():
                # Give the stream a moment to deliver the last lines the driver printed.
                grace_end = time.monotonic() + min(5.0, poll_s)
                while streaming and time.monotonic() < grace_end:
                    try:
                        item = await asyncio.wait_for(queue.get(), grace_end - time.monotonic())
                    except asyncio.TimeoutError:
                        break
                    if item is end_of_stream:
                        break
                    out.write(item)
                    out.flush()
                return status
            if not streaming:
                await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    finally:
        pump_task.cancel()
        try:
            await pump_task
        except (asyncio.CancelledError, Exception):
            pass


def run(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args, overrides = parse_args(argv)
    client = _make_client(args.address, args.request_timeout)
    if args.stop:
        return stop(client, args.stop, args, err)
    if args.follow:
        return follow_to_end(client, args.follow, args, out, err)
    runtime_env = build_runtime_env(args.deps, args.extras, args.env_vars)
    entrypoint = entrypoint_for(overrides)
    submission_id = args.submission_id or default_submission_id(overrides)
    job_id = call_with_timeout(
        lambda: client.submit_job(
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env=runtime_env,
            metadata={"launcher": "rlcore launch.submit", "overrides": shlex.join(overrides)},
        ),
        args.request_timeout,
        "submitting the job",
    )
    print(f"[launch] submitted {job_id} to {args.address}: {entrypoint}", file=err, flush=True)
    if args.no_wait:
        print(job_id, file=out, flush=True)
        return 0
    return follow_to_end(client, job_id, args, out, err)


def outcome(client: Any, job_id: str, status: Any, args: argparse.Namespace, err: TextIO) -> int:
    """Print the job's final status line and return its exit code (the table in the module doc)."""
    from ray.job_submission import JobStatus

    info = call_with_timeout(
        lambda: client.get_job_info(job_id), args.request_timeout, "reading the job info"
    )
    print(f"[launch] {job_id} {status}: {info.message or ''}".rstrip(), file=err, flush=True)
    if status == JobStatus.SUCCEEDED:
        return 0
    if status == JobStatus.STOPPED:
        return EXIT_STOPPED
    code = info.driver_exit_code
    return code if isinstance(code, int) and 0 < code < 256 else 1


def follow_to_end(client: Any, job_id: str, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Stream the job's logs until it ends; its outcome's exit code (or --timeout's: the job is
    stopped then)."""
    stop_hint = f"python -m launch.submit --address {args.address} --stop {job_id}"
    try:
        status = asyncio.run(
            follow(
                client,
                job_id,
                timeout_s=args.timeout,
                request_timeout_s=args.request_timeout,
                poll_s=args.poll,
                out=out,
            )
        )
    except KeyboardInterrupt:
        print(f"\n[launch] interrupted; the job keeps running. Stop it with: {stop_hint}", file=err)
        return EXIT_INTERRUPTED

    if status is None:
        print(
            f"[launch] {job_id} did not finish within --timeout {args.timeout:g} s; stopping it",
            file=err,
        )
        try:
            call_with_timeout(lambda: client.stop_job(job_id), args.request_timeout, "stopping the job")
        except (LaunchError, RuntimeError) as exc:
            print(f"[launch] could not stop it ({exc}); run: {stop_hint}", file=err)
        return EXIT_TIMEOUT
    return outcome(client, job_id, status, args, err)


def stop(client: Any, job_id: str, args: argparse.Namespace, err: TextIO) -> int:
    """Ask Ray to stop the job, then poll its status (each request within --request-timeout,
    all within --timeout) until it is terminal: 0 when STOPPED, else its outcome's code (it had
    finished by itself); EXIT_TIMEOUT when it is still running at --timeout."""
    from ray.job_submission import JobStatus

    asked = call_with_timeout(lambda: client.stop_job(job_id), args.request_timeout, "stopping the job")
    print(f"[launch] {job_id}: {'stop requested' if asked else 'not running'}", file=err, flush=True)
    deadline = time.monotonic() + args.timeout
    while True:
        status = call_with_timeout(
            lambda: client.get_job_status(job_id), args.request_timeout, "reading the job status"
        )
        if status.is_terminal():
            code = outcome(client, job_id, status, args, err)
            return 0 if status == JobStatus.STOPPED else code
        if time.monotonic() > deadline:
            print(f"[launch] {job_id} still {status} after --timeout {args.timeout:g} s", file=err)
            return EXIT_TIMEOUT
        time.sleep(min(args.poll, 1.0))


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        # Before the job id is known (while connecting or uploading); once it is, run() says how
        # to stop the job.
        print("\npython -m launch.submit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except LaunchError as exc:
        print(f"python -m launch.submit: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (RuntimeError, OSError) as exc:
        # Ray's job client reports refused submissions (duplicate id, bad runtime_env, HTTP
        # errors) as RuntimeError with the server's message, and a dropped connection as an
        # OSError from requests; the message is the useful part, a traceback is not.
        print(f"python -m launch.submit: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        # Looked up, not imported: bad arguments fail before Ray is ever imported.
        auth_error = getattr(sys.modules.get("ray.exceptions"), "AuthenticationError", None)
        if auth_error is None or not isinstance(exc, auth_error):
            raise
        # Ray's message is a page long; its first line says what is missing.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"python -m launch.submit: error: the cluster refused us ({first}); make its token "
            "available as RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
