"""What a verifiers v1 environment would run on this host, and what failed when its taskset
does not import: the checks made before an environment is accepted (so before Ray starts).

A harness that executes code (verifiers' `Harness.EXECUTES_CODE`: `bash` and the coding agents)
or a tool server (`Taskset.toolsets` / `Task.toolsets`), in verifiers' `subprocess` runtime,
runs the policy's commands or tool calls as this user on this machine, outside rlcore's sandbox.
Such an environment is refused unless `env.args.allow_host_tools=true` says so; a container
runtime (`agent.runtime.type: docker`, ...) or a tool-less harness (`null`) needs no flag.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

ALLOW_KEY = "env.args.allow_host_tools"
HOST_RUNTIME = "subprocess"
IN_PROCESS_CHAT = "rlcore_vf_chat"
"""Harness id of :mod:`rlcore.envs.vf_chat` (the tool-less chat loop, in process): verifiers
resolves a harness id as a top-level module name, so the module is registered under it."""


def null_harness_id(cfg: dict[str, Any]) -> dict[str, Any]:
    """`agent.harness.id: null` (Hydra's None) means the tool-less chat loop, as the README says:
    rlcore's in-process one (verifiers' own is `id: "null"`, a uv-launched program per rollout);
    verifiers itself would read None as "unset" and fall back to `bash`."""
    harness = (cfg.get("agent") or {}).get("harness")
    if isinstance(harness, dict) and "id" in harness and harness["id"] is None:
        import sys

        from rlcore.envs import vf_chat
        sys.modules.setdefault(IN_PROCESS_CHAT, vf_chat)
        cfg["agent"] = {**cfg["agent"], "harness": {**harness, "id": IN_PROCESS_CHAT}}
    return cfg


def host_tools(vf_env: Any) -> list[str]:
    """One line per part of `vf_env` that would run tools on this host (empty: none)."""
    from verifiers.v1.configs.agent import agent_config_fields

    out = []
    harnesses = vf_env.config.agent_harnesses()
    for name, agent in agent_config_fields(vf_env.config).items():
        if agent.runtime.type != HOST_RUNTIME:
            continue
        harness = vf_env._harnesses.get(name)  # the loaded harness (verifiers keeps no public map)
        if harness is not None and harness.EXECUTES_CODE:
            out.append(f"agent {name!r}: harness {harnesses[name].id!r} executes code")
    runs_on_host = any(a.runtime.type == HOST_RUNTIME for a in agent_config_fields(vf_env.config).values())
    if runs_on_host:
        taskset = vf_env.taskset
        servers = [*type(taskset).toolsets(taskset.config), *type(taskset).task_type().toolsets(taskset.config.task)]
        if servers:
            out.append(f"taskset {taskset.config.id!r}: {len(servers)} tool server(s) "
                       f"({', '.join(sorted({type(s).__name__ for s in servers}))})")
    return out


def refusal(found: list[str]) -> str:
    """The one-line refusal for `found` (from host_tools)."""
    return (f"{ALLOW_KEY}: this verifiers environment would run the policy's tools on this host, as this user, "
            f"outside rlcore's sandbox ({'; '.join(found)}; runtime {HOST_RUNTIME!r}). Pick a tool-less harness "
            f"(env.args.env_config={{agent: {{harness: {{id: null}}}}}}), a container runtime "
            f"(agent.runtime.type: docker), or set {ALLOW_KEY}=true to accept it")


def taskset_import_error(taskset: str) -> str | None:
    """Why the module of taskset id `taskset` fails to import, when it exists (None: it imports,
    or there is no such module, which verifiers reports itself). verifiers reads any
    ModuleNotFoundError raised inside the module as "taskset not found"."""
    name = taskset.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    for module in (f"verifiers.v1.tasksets.{name}", name):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 (any failure of the module's own code is the answer)
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            hint = ""
            if "verifiers" in text or getattr(e, "name", "") and str(getattr(e, "name", "")).startswith("verifiers"):
                hint = (" (written for verifiers' classic 0.3.x API? rlcore runs verifiers 0.4.0, whose only API "
                        "is v1: `import verifiers.v1 as vf`)")
            return f"module {module!r} ({spec.origin}) failed to import: {type(e).__name__}: {text}{hint}"
        return None
    return None
