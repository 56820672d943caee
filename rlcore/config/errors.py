"""`ConfigError`, the one exception for a bad config value: a leaf module (it imports nothing of
rlcore) so any module may raise or catch it without importing the validator."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class ConfigError(ValueError):
    """A bad config value; `str()` is one line that starts with the offending key. `problems`
    holds it and any further (key, message) pairs found in the same check."""

    def __init__(self, key: str, message: str, more: list[tuple[str, str]] | tuple = ()):
        self.key = key
        self.problems = [(key, message), *more]
        super().__init__(f"{key}: {message}")

    def lines(self) -> list[str]:
        """One `KEY: message` line per problem, the first one first."""
        return [f"{k}: {m}" for k, m in self.problems]


def raise_problems(found: list[tuple[str, str]]) -> None:
    """Raise ConfigError for the (key, message) pairs `found`, the first one first; none: return."""
    if found:
        raise ConfigError(*found[0], more=found[1:])


@contextmanager
def keyed_errors(*types: type[BaseException]) -> Iterator[None]:
    """Inside, an exception of `types` whose text is `KEY: message` (bad input data named by its
    config key, e.g. `rlcore.sft.dataset.DataError`) is reported as ConfigError(KEY, message)."""
    try:
        yield
    except types as exc:
        key, _, message = str(exc).partition(": ")
        raise ConfigError(key, message) from None
