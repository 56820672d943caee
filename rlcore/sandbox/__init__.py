"""Sandboxed code execution: the `Sandbox` interface and a local subprocess implementation."""

from rlcore.sandbox.base import Limits, Sandbox, SandboxResult, check_relative
from rlcore.sandbox.local import LocalSandbox

__all__ = ["Limits", "LocalSandbox", "Sandbox", "SandboxResult", "check_relative"]
