"""What a reward worker sends the rollout actor: data in a fixed schema, never code.

A reply is one frame: a 4-byte big-endian length (what `multiprocessing.Connection.send_bytes`
writes) and that many bytes of UTF-8 JSON, at most `FRAME_LIMIT`. Its body:
``{"batch": int, "start": int, "final": bool, "retire": bool, "outs": [outcome, ...]}`` and each
outcome ``[value, error, output]``: `value` plain, `error` a string or null, `output` a string, where `plain` is JSON's own
types (null, bool, number, string, list, object with string keys), nested at most `DEPTH` deep.
The actor parses it with `json` alone (no pickle: nothing in a reply can run in the actor), and
a frame that is too long, does not parse or breaks the schema raises :class:`BadReply`, which
fails the calls it was for, not the pool. A reward's value is made plain in the worker
(:func:`plain_value`): numbers of other types (numpy, sympy, Fraction) become floats, which is
what the environment does with them anyway (`rlcore.envs.base.as_reward`).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from rlcore.isolation.safety import Outcome

FRAME_LIMIT = 1 << 20
"""Bytes one reply may take (a reward is a number: this is generous)."""
TEXT_LIMIT = 8192
"""Characters of an outcome's `error` or `output` kept."""
DEPTH = 8
"""How deeply a value's lists and objects may nest."""
_HEADER = struct.Struct("!i")


class BadReply(ValueError):
    """A frame that is not a reply: too long, not JSON, or not the schema."""


def plain_value(value: Any, depth: int = 0) -> Any:
    """`value` as JSON's own types; TypeError when it has none (an object, a set, bytes...)."""
    if value is None or isinstance(value, (bool, str)):
        return value if not isinstance(value, str) else str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if depth < DEPTH and isinstance(value, (list, tuple)):
        return [plain_value(v, depth + 1) for v in value]
    if depth < DEPTH and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {str(k): plain_value(v, depth + 1) for k, v in value.items()}
    try:  # a number of another type (numpy.float32, sympy.Float, Fraction): its float, as scoring takes it
        return float(value)
    except Exception:
        raise TypeError(
            f"a value of type {type(value).__name__} is not plain data (a number, string, list or dict of them)"
        ) from None


def encode_row(out: Outcome) -> list:
    """One outcome as a reply's row ``[value, error, output]``; a value that is not plain data
    becomes its call's error."""
    error, value = out.error, out.value
    if error is not None:
        value, error = None, error[:TEXT_LIMIT]
    elif type(value) is not float:  # a float (the usual reward) is plain already
        try:
            value = plain_value(value)
        except (TypeError, RecursionError) as exc:
            value, error = None, f"reward value cannot be sent back: {exc}"
    return [value, error, out.output[:TEXT_LIMIT]]


def encode_reply(batch: int, outs: list[Outcome], start: int, final: bool, retire: bool) -> bytes:
    """The body of a reply (the caller frames it); an outcome whose value is not plain data, or
    that would make the reply too long, becomes its call's error."""
    rows = [encode_row(out) for out in outs]
    body = {"batch": batch, "start": start, "final": final, "retire": retire, "outs": rows}
    data = json.dumps(body, allow_nan=True).encode()
    if len(data) <= FRAME_LIMIT - 64 * len(rows) - 256:
        return data
    for row in rows:  # too long: the large values become errors, outputs are cut
        size = len(json.dumps(row[0], allow_nan=True))
        if size > 1024:
            row[0], row[1] = None, f"reward returned a value of {size} bytes as JSON (limit {FRAME_LIMIT})"
        row[2] = row[2][:1024]
    return json.dumps(body, allow_nan=True).encode()


def _check_plain(value: Any, depth: int = 0) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if depth < DEPTH and isinstance(value, list):
        for v in value:
            _check_plain(v, depth + 1)
        return
    if depth < DEPTH and isinstance(value, dict):
        for v in value.values():
            _check_plain(v, depth + 1)
        return
    raise BadReply("a value nests too deeply")


def decode_reply(data: bytes) -> dict:
    """A reply's body as `{"batch", "start", "final", "retire", "outs": [Outcome]}`; BadReply
    when it is not one."""
    if len(data) > FRAME_LIMIT:
        raise BadReply(f"a reply of {len(data)} bytes (limit {FRAME_LIMIT})")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadReply(f"a reply that is not JSON ({exc})") from None
    if not isinstance(body, dict) or set(body) != {"batch", "start", "final", "retire", "outs"}:
        raise BadReply("a reply without the reply's fields")
    batch, start, final, retire, rows = (body[k] for k in ("batch", "start", "final", "retire", "outs"))
    if not (
        type(batch) is int
        and type(start) is int
        and start >= 0
        and type(final) is bool
        and type(retire) is bool
        and isinstance(rows, list)
    ):
        raise BadReply("a reply whose fields have the wrong types")
    outs = [decode_row(row) for row in rows]
    return {"batch": batch, "start": start, "final": final, "retire": retire, "outs": outs}


def decode_row(row: Any) -> Outcome:
    """A reply's row ``[value, error, output]`` as an Outcome; BadReply when it is not one."""
    if type(row) is not list or len(row) != 3:
        raise BadReply("an outcome that is not [value, error, output]")
    value, error, output = row
    if not (error is None or type(error) is str) or type(output) is not str:
        raise BadReply("an outcome whose fields have the wrong types")
    if type(value) is not float:
        try:
            _check_plain(value)
        except RecursionError:
            raise BadReply("a value nests too deeply") from None
    return Outcome(value=value, error=error, output=output)


class StaleReply(BadReply):
    """A reply for a batch that had ended: what a call wrote on its pipe for later calls. The
    worker is lost; the calls it runs now are not to blame."""


class FrameReader:
    """Frames out of a byte stream read in whatever pieces arrive (never blocks: the caller reads
    only what is there, so half a frame waits for its deadline instead of blocking the actor)."""

    def __init__(self, limit: int = FRAME_LIMIT):
        self.limit = limit
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames complete after `data`; BadReply for a length past the limit (or negative)."""
        self.buffer += data
        frames = []
        while len(self.buffer) >= 4:
            (size,) = _HEADER.unpack_from(self.buffer)
            if size < 0 or size > self.limit:
                raise BadReply(f"a frame of {size} bytes announced (limit {self.limit})")
            if len(self.buffer) < 4 + size:
                break
            frames.append(bytes(self.buffer[4 : 4 + size]))
            del self.buffer[: 4 + size]
        return frames

    @property
    def partial(self) -> bool:
        """Whether part of a frame waits for the rest."""
        return bool(self.buffer)


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body
