"""Seeds derived from names: stable across processes, Python versions and restarts (unlike
`hash()`), so a request's sampling depends only on what it is, not on when or where it runs."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from `parts` (e.g. run seed, split, first task index of a request)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
