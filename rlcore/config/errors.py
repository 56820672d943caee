"""`ConfigError`, the one exception for a bad config value: a leaf module (it imports nothing of
rlcore) so any module may raise or catch it without importing the validator."""

from __future__ import annotations


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
