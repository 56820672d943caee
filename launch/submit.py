"""Submit an rlcore run to a Ray cluster through the Ray Jobs API and follow it to its end.

    python -m launch.submit --address http://HEAD:8265 -- +recipe=NAME output_dir=/shared/runs/NAME key=value ...
    python -m launch.submit --address http://HEAD:8265 --follow SUBMISSION_ID
    python -m launch.submit --address http://HEAD:8265 --stop SUBMISSION_ID

Everything after ``--`` is handed to ``python -m rlcore.run`` unchanged. The run's ``output_dir``
must be a path every node mounts: a relative one (the default ``outputs/MODE``, a recipe's) would
land in each node's own copy of the working dir and is refused before anything is sent (exit 2).
The repository is shipped as the job's working directory, the job's logs stream back here, and this process exits with the
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
import os
import re
import shlex
import sys
from typing import Optional, Sequence, TextIO

from launch.jobs_api import (  # noqa: F401  (re-exported: the launcher's API in one place)
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EXIT_TIMEOUT,
    MAX_STATUS_FAILURES,
    LaunchError,
    _send_token_if_available,
    call_with_timeout,
    call_with_timeout_async,
    follow,
    follow_to_end,
    make_client,
    outcome,
    stop,
)
from launch.runtime_env import (  # noqa: F401
    REPO_ROOT,
    WORKING_DIR_EXCLUDES,
    build_runtime_env,
    default_submission_id,
    entrypoint_for,
    locked_requirements,
    node_local_output,
)

# A Hydra override: key=value, +key=value, ++key=value, or ~key (delete).
_OVERRIDE = re.compile(r"^(?:(?:\+\+|\+)?[A-Za-z_][\w.@/\-]*=.*|~[A-Za-z_][\w.@/\-]*(?:=.*)?)$", re.S)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
        "+recipe=reverse_text steps=100 output_dir=/shared/runs/reverse_text",
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_JOBS_ADDRESS", "http://127.0.0.1:8265"),
        help="the head's dashboard address, http(s)://HOST:PORT (default: $RAY_JOBS_ADDRESS or %(default)s)",
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
        help="environment variable for the job and all its actors (repeatable), e.g. WANDB_API_KEY=...",
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
        help="seconds each request to the cluster may take, the working-dir upload included (default: %(default)s)",
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
        help="submit nothing: follow that job to its end (its logs from the start, then its outcome as the exit code)",
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
        parser.error(
            f"--{'follow' if args.follow else 'stop'} acts on a submitted job: no overrides after `--`, no --no-wait"
        )

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
            parser.error(f"override {item!r} after `--` is not a Hydra override (key=value, +key=value, ~key)")
    return args, overrides


def run(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args, overrides = parse_args(argv)
    if not (args.stop or args.follow):
        problem = node_local_output(overrides)
        if problem:
            raise LaunchError(problem)
    client = make_client(args.address, args.request_timeout)
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
