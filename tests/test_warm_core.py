"""The warm engine-core server (`rlcore.engine.vllm.warm_core`), on CPU: what a process forked
from it inherits (its starter's environment and cwd at `start()`, not the server's), that it
dies with its starter, and that vLLM's launcher is redirected only where vLLM would spawn. Each
case runs in a fresh interpreter (a forkserver lives as long as the process that started it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


TARGETS = """
import json, os, sys, time

def report(path):
    json.dump({"env": os.environ.get("RLCORE_WARM_PROBE"), "cwd": os.getcwd(), "ppid": os.getppid()},
              open(path, "w"))

def sleep_forever(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(600)
"""


def run_script(body: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)], cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw
    )


def targets_env(tmp_path: Path) -> dict:
    """An environment whose Python finds the processes' targets (module `warm_targets`): a
    forked child imports its target by name."""
    (tmp_path / "warm_targets.py").write_text(TARGETS)
    return dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")


def test_a_forked_core_runs_with_its_starters_environment_and_cwd_not_the_servers(tmp_path):
    out = tmp_path / "seen.json"
    done = run_script(
        f"""
        import json, os
        from rlcore.engine.vllm import warm_core
        from warm_targets import report
        warm_core.start(("json",))
        os.environ["RLCORE_WARM_PROBE"] = "set after the server started"
        os.chdir({str(tmp_path)!r})
        p = warm_core.CONTEXT.Process(target=report, args=({str(out)!r},))
        p.start(); p.join(60)
        print(json.dumps({{"exit": p.exitcode, "me": os.getpid(), "server": warm_core.server_pid()}}))
    """,
        env=targets_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    parent = json.loads(done.stdout.strip().splitlines()[-1])
    seen = json.loads(out.read_text())
    assert parent["exit"] == 0
    assert seen["env"] == "set after the server started"  # the server started before the variable
    assert Path(seen["cwd"]) == tmp_path
    assert seen["ppid"] == parent["server"] != parent["me"]  # forked by the server, not the starter


def test_a_forked_core_dies_with_the_process_that_started_its_server(tmp_path):
    pid_file = tmp_path / "child.pid"
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time
        from rlcore.engine.vllm import warm_core
        from warm_targets import sleep_forever
        warm_core.start(("json",))
        warm_core.CONTEXT.Process(target=sleep_forever, args=({str(pid_file)!r},), daemon=False).start()
        time.sleep(600)
    """),
        ],
        cwd=REPO,
        env=targets_env(tmp_path),
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        os.kill(starter.pid, signal.SIGKILL)  # as Ray kills an actor: no cleanup in the starter
        starter.wait(30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the engine core outlived the actor that started its server"
    finally:
        starter.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_vllms_launcher_forks_from_the_server_only_where_vllm_would_spawn(tmp_path):
    # a module standing where vLLM's engine-core launcher lives, with the same function
    pkg = tmp_path / "vllm" / "v1" / "engine"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "v1", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "utils.py").write_text(
        textwrap.dedent("""
        import multiprocessing, os
        def get_mp_context():
            return multiprocessing.get_context(os.environ["METHOD"])
    """)
    )
    body = """
        from rlcore.engine.vllm import warm_core
        assert warm_core.use_for_vllm() is False  # nothing started: vLLM's own context
        warm_core.start(("json",))
        assert warm_core.use_for_vllm() is True
        assert warm_core.use_for_vllm() is True  # once, not wrapped twice
        import vllm.v1.engine.utils as u
        print(u.get_mp_context() is warm_core.CONTEXT)
    """
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    spawn = run_script(body, env=dict(env, METHOD="spawn"))
    fork = run_script(body, env=dict(env, METHOD="fork"))
    assert spawn.returncode == 0 and fork.returncode == 0, spawn.stderr + fork.stderr
    assert spawn.stdout.split()[-1] == "True"
    assert fork.stdout.split()[-1] == "False"


def test_the_early_start_follows_the_engine_and_its_option():
    done = run_script("""
        from rlcore.config import RunConfig
        from rlcore.engine import registry
        from rlcore.engine.vllm import warm_core
        import dataclasses
        cfg = RunConfig()
        hf = cfg.rollout
        registry.prestart_engine(hf)  # the hf engine starts nothing early
        off = dataclasses.replace(hf, engine="vllm", gpus_per_actor=1.0,
                                  vllm=dataclasses.replace(hf.vllm, warm_engine_core=False))
        registry.prestart_engine(off)
        cpu = dataclasses.replace(hf, engine="vllm", gpus_per_actor=0.0)
        registry.prestart_engine(cpu)
        before = warm_core.started()
        registry.prestart_engine(dataclasses.replace(hf, engine="vllm", gpus_per_actor=1.0))
        print(before, warm_core.started(), warm_core.server_pid() is not None)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["False", "True", "True"]
