"""The broadcast transport's weight group gives up on the driver's word (`broadcast.abort`): a
member that never joins (it died before the rendezvous) or freezes in the middle of a sync holds
the others for the driver's detection time, not the whole `weight_sync_timeout_s`, and the
trainer's side is free at once for a group formed anew (gloo's destructor would otherwise block
it for the rest of the timeout)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import torch

from rlcore.transfer.broadcast import WeightGroup, WeightGroupAborted, abort

TIMEOUT_S = (
    120.0  # the operations' own deadline (the default weight_sync_timeout_s): every wait below ends long before it
)
BIG = 16 * 2**20  # floats per bucket: more than the socket buffers hold, so a frozen peer blocks the root


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(rank: int, port: int, world: int, numel: int, out: mp.Queue) -> None:
    try:
        group = WeightGroup("127.0.0.1", port, rank, world, TIMEOUT_S)
        out.put(("joined", rank, os.getpid()))
        t = torch.empty(numel)
        group.broadcast(t)
        out.put(("received", rank, float(t[0])))
    except WeightGroupAborted as exc:
        out.put(("aborted", rank, str(exc)))
    time.sleep(TIMEOUT_S)  # stays alive: the test ends it


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.fixture
def spawn():
    ctx = mp.get_context("spawn")
    procs: list = []

    def start(*args):
        p = ctx.Process(target=_member, args=args, daemon=True)
        p.start()
        procs.append(p)
        return p

    yield ctx, start
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.kill()
        p.join(5)


def test_a_rendezvous_missing_a_member_gives_up_on_abort(spawn):
    ctx, start = spawn
    out, port = ctx.Queue(), _port()
    start(1, port, 3, 1, out)  # member 2 never comes (it died before joining)
    thread, box = _in_thread(lambda: WeightGroup("127.0.0.1", port, 0, 3, TIMEOUT_S))
    time.sleep(3.0)
    assert thread.is_alive()  # still waiting for member 2
    began = time.monotonic()
    assert abort("127.0.0.1", port)
    thread.join(TIMEOUT_S)
    assert time.monotonic() - began < 20.0, "the trainer's side waited on past the abort"
    assert isinstance(box.get("error"), WeightGroupAborted), box
    kind, rank, _ = out.get(timeout=10)
    assert (kind, rank) == ("aborted", 1)  # the member that came gives up too


def test_a_broadcast_held_by_a_frozen_member_gives_up_on_abort_and_a_new_group_forms_at_once(spawn):
    ctx, start = spawn
    out, port = ctx.Queue(), _port()
    for rank in (1, 2):
        start(rank, port, 3, BIG, out)
    group = WeightGroup("127.0.0.1", port, 0, 3, TIMEOUT_S)
    pids = {}
    for _ in range(2):
        _, rank, pid = out.get(timeout=30)
        pids[rank] = pid
    os.kill(pids[2], signal.SIGSTOP)
    thread, box = _in_thread(lambda: group.broadcast(torch.ones(BIG)))  # noqa: F821  (the `del group` below is the point of the test)
    time.sleep(3.0)
    assert thread.is_alive()  # held by the frozen member
    began = time.monotonic()
    assert abort("127.0.0.1", port)
    thread.join(TIMEOUT_S)
    assert time.monotonic() - began < 20.0, "the send waited on past the abort"
    assert isinstance(box.get("error"), WeightGroupAborted), box
    del group  # the caller drops the group it gave up: that must not block it either
    # the group formed anew without the frozen member (a new port) works at once
    port2, out2 = _port(), ctx.Queue()
    began = time.monotonic()
    start(1, port2, 2, 4, out2)
    fresh = WeightGroup("127.0.0.1", port2, 0, 2, TIMEOUT_S)
    fresh.broadcast(torch.full((4,), 7.0))
    assert [out2.get(timeout=30)[0], out2.get(timeout=30)] == ["joined", ("received", 1, 7.0)]
    assert time.monotonic() - began < 60.0  # a new process's torch import included


def test_abort_of_a_group_nobody_hosts_returns_false_quickly():
    began = time.monotonic()
    assert not abort("127.0.0.1", _port(), timeout_s=1.0)
    assert time.monotonic() - began < 10.0
