"""The Ray Jobs API as `launch.submit` uses it: every request under a timeout of our own (Ray's
job client sets none), the job's logs followed to its end, its outcome as an exit code, a stop
that waits for Ray to report it. The command line is in :mod:`launch.submit`."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, Callable, Optional, TextIO, TypeVar

EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
MAX_STATUS_FAILURES = 5
LOG_GRACE_S = 10.0
"""How long a job's log stream may take, once its status is terminal, to deliver its last lines."""
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


def make_client(address: str, request_timeout: float):
    from ray.job_submission import JobSubmissionClient

    _send_token_if_available()
    # the SDK logs "WebSocket closed for job ... with close code 1000" at INFO after every follow;
    # the launcher's own [launch] lines say how the job ended
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)

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
                # The stream ends after the job does: wait for its end (the last lines the driver
                # printed, e.g. a config error) up to LOG_GRACE_S. Bounded by poll_s (2 s in a
                # test) it lost a failed job's error line under load, and `outcome` drops Ray's
                # copy of those lines from the job's message.
                grace_end = time.monotonic() + LOG_GRACE_S
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


def outcome(client: Any, job_id: str, status: Any, args: argparse.Namespace, err: TextIO) -> int:
    """Print the job's final status line and return its exit code (the table in the module doc)."""
    from ray.job_submission import JobStatus

    info = call_with_timeout(lambda: client.get_job_info(job_id), args.request_timeout, "reading the job info")
    # Ray appends the job's last 20 KB of logs to a failed job's message: the stream printed them
    message = (info.message or "").split(", last available logs", 1)[0].strip()
    print(f"[launch] {job_id} {status}: {message}".rstrip(), file=err, flush=True)
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
