"""What a verifiers v1 environment would run on this host, and what failed when its taskset
does not import: the checks made before an environment is accepted (so before Ray starts).

Default-deny, by identity: an environment runs without `env.args.allow_host_tools=true` only
when every part that sees the policy's output is one rlcore knows to be safe, recognised by what
it *is* (the class object, the runtime config class), never by what it says of itself (verifiers'
`Harness.EXECUTES_CODE` is the harness's own claim; a taskset can export a harness that sets it
False and pipes the model's reply to `sh`):

- the env class is verifiers' `SingleAgentEnv` (a taskset's own `vf.Env` runs code rlcore has
  not read);
- each agent's harness is one of `safe_harnesses()` (tool-less or with a reviewed tool: rlcore's
  in-process chat loop and calculator, verifiers' `null` chat program), or its runtime is one of
  `isolating_runtimes()` (a container or a remote sandbox: its own network and filesystem;
  `subprocess` and `apptainer` share the host's);
- each tool server runs where the policy's calls cannot reach this host: a runtime of
  `isolating_runtimes()` (its own, or the agent's when colocated) or an existing server named by
  `url`; verifiers' default placement is this host (`subprocess`), whatever the agent's runtime.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

ALLOW_KEY = "env.args.allow_host_tools"
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


def safe_harnesses() -> tuple[type, ...]:
    """Harness classes that run none of the policy's output as code, whatever the runtime."""
    from verifiers.v1.harnesses.null import NullHarness

    from rlcore.envs.vf_calculator import CalculatorHarness
    from rlcore.envs.vf_chat import InProcessChatHarness

    return (InProcessChatHarness, CalculatorHarness, NullHarness)


def isolating_runtimes() -> tuple[type, ...]:
    """Runtime config classes whose programs get their own network and filesystem."""
    from verifiers.v1.runtimes import DockerConfig, E2BConfig, ModalConfig, PodmanConfig, PrimeConfig

    return (DockerConfig, PodmanConfig, PrimeConfig, ModalConfig, E2BConfig)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _runtime(config: Any) -> str:
    return repr(getattr(config, "type", type(config).__name__))


def host_tools(vf_env: Any) -> list[str]:
    """One line per part of `vf_env` that could run the policy's output on this host (empty: none)."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.envs.single_agent import SingleAgentEnv

    out = []
    if type(vf_env) is not SingleAgentEnv:
        out.append(f"env class {_name(type(vf_env))} is the taskset's own (rlcore knows verifiers' SingleAgentEnv)")
    agents = agent_config_fields(vf_env.config)
    isolating = isolating_runtimes()
    ids = vf_env.config.agent_harnesses()
    for name, agent in agents.items():
        harness = vf_env._harnesses.get(name)  # the loaded harness (verifiers keeps no public map)
        if type(harness) in safe_harnesses() or type(agent.runtime) in isolating:
            continue
        out.append(
            f"agent {name!r}: harness {ids[name].id!r} ({_name(type(harness))}, not one rlcore knows to run "
            f"none of the policy's output; its own EXECUTES_CODE is not read) in runtime "
            f"{_runtime(agent.runtime)}"
        )
    taskset = vf_env.taskset
    servers = [*type(taskset).toolsets(taskset.config), *type(taskset).task_type().toolsets(taskset.config.task)]
    for server in servers:
        cfg = getattr(server, "config", None)
        if getattr(cfg, "url", None):
            continue  # an existing server, reached over the network
        if getattr(cfg, "colocated", False):
            hosts = [_runtime(a.runtime) for a in agents.values() if type(a.runtime) not in isolating]
        else:
            runtime = getattr(cfg, "runtime", None)
            hosts = [] if type(runtime) in isolating else [_runtime(runtime)]
        if hosts:
            out.append(f"tool server {type(server).__name__} in runtime {', '.join(sorted(set(hosts)))}")
    return out


def refusal(found: list[str]) -> str:
    """The one-line refusal for `found` (from host_tools)."""
    return (
        f"{ALLOW_KEY}: this verifiers environment could run the policy's output on this host, as this user, "
        f"outside rlcore's sandbox ({'; '.join(found)}). rlcore trusts a harness, runtime or env class by what "
        f"it is, never by its own flags. Pick a tool-less harness "
        f"(env.args.env_config={{agent: {{harness: {{id: null}}}}}}), a container runtime for the agent and "
        f"its tool servers (agent.runtime.type: docker), or set {ALLOW_KEY}=true to accept it"
    )


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
                hint = (
                    " (written for verifiers' classic 0.3.x API? rlcore runs verifiers 0.4.0, whose only API "
                    "is v1: `import verifiers.v1 as vf`)"
                )
            return f"module {module!r} ({spec.origin}) failed to import: {type(e).__name__}: {text}{hint}"
        return None
    return None
