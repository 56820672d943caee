"""The local sandbox stops runaway CPU, memory, network and writes outside it, with a reason."""

import os
import uuid
from pathlib import Path

import pytest

from rlcore.sandbox import Limits, LocalSandbox
from rlcore.sandbox.local import namespaces_problem

NO_NS = namespaces_problem()
needs_ns = pytest.mark.skipif(NO_NS is not None, reason=f"the kernel refuses namespaces here: {NO_NS}")


@pytest.fixture(scope="module")
def sandbox():
    if NO_NS is not None:
        pytest.skip(f"the kernel refuses namespaces here: {NO_NS}")
    return LocalSandbox(Limits(timeout_s=3, cpu_s=1, memory_mb=256))


def test_runs_and_returns_files(sandbox):
    r = sandbox.run(
        ["python", "-c", "print(open('in.txt').read()); open('out/x.txt','w').write('y')"],
        files={"in.txt": "hello", "out/keep": ""},
    )
    assert r.ok and r.stdout.strip() == "hello" and r.files["out/x.txt"] == "y"


def test_wall_clock_timeout_kills(sandbox):
    r = sandbox.run(["python", "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert r.reason == "timeout" and r.duration_s < 3


def test_cpu_limit(sandbox):
    r = sandbox.run(["python", "-c", "while True: pass"], timeout=60)  # a loaded machine: wall >> CPU
    assert r.reason == "cpu_limit"


def test_memory_limit(sandbox):
    r = sandbox.run(["python", "-c", "x = bytearray(1024 * 1024 * 1024)"])
    assert r.reason == "memory_limit" and "MemoryError" in r.stderr


def test_network_blocked_for_python(sandbox):
    r = sandbox.run(["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)"])
    assert r.returncode != 0 and r.reason == "sandbox_violation" and "network access is disabled" in r.stderr


def test_network_namespace_blocks_any_program(sandbox):
    # -I skips the Python guard: the syscall filter refuses the socket (AF_UNIX only), and the
    # namespace has no route out anyway
    r = sandbox.run(["python", "-I", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)"])
    assert r.returncode != 0 and "Operation not permitted" in r.stderr and r.reason == "sandbox_violation"


def test_write_outside_blocked(sandbox, tmp_path):
    target = f"/tmp/rlcore-escape-{uuid.uuid4().hex}"
    r = sandbox.run(["python", "-c", f"open('{target}', 'w').write('x')"])
    assert r.reason == "sandbox_violation" and "write outside the sandbox" in r.stderr
    assert not os.path.exists(target)


def test_readonly_filesystem_blocks_any_program(sandbox):
    # host /tmp is not in the sandbox at all; the system paths that are, are read-only
    target, system = f"/tmp/rlcore-escape-{uuid.uuid4().hex}", f"/usr/rlcore-escape-{uuid.uuid4().hex}"
    r = sandbox.run(["sh", "-c", f"echo x > {target}; echo x > {system}; echo y > inside.txt"])
    assert "Read-only file system" in r.stderr and r.files == {"inside.txt": "y\n"}
    assert r.reason == "sandbox_violation"
    assert not os.path.exists(target) and not os.path.exists(system)


def test_paths_must_stay_inside(sandbox):
    with pytest.raises(ValueError):
        sandbox.run(["true"], files={"../evil": "x"})


# -- escapes tried against the sandbox (issue 22): each fails and is reported as a violation --
def _alive(marker: str) -> list[int]:
    """Host pids whose command line holds `marker` (a sleeper the sandboxed code started)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            pass
    return out


ESCAPE_SH = "id -u; mount -o remount,bind,rw /; echo x > {target}; echo y > {target2}"


def test_fork_exec_shell_cannot_remount_or_write(sandbox):
    # _posixsubprocess.fork_exec skips the audit hook: only the kernel boundary stands in the way
    target, target2 = f"/tmp/rlcore-escape-{uuid.uuid4().hex}", f"/rlcore-escape-{uuid.uuid4().hex}"
    code = f"""
import _posixsubprocess, os, sys
script = {ESCAPE_SH.format(target=target, target2=target2)!r}
r, w = os.pipe()
head = [[b"/bin/sh", b"-c", script.encode()], [b"/bin/sh"], True, (r, w), None, None,
        -1, -1, -1, -1, -1, -1, r, w, False, False]
for tail in ([-1, None, None, None, -1, None, False], [-1, None, None, None, -1, None]):  # 3.11-3.12, 3.13+
    try:
        pid = _posixsubprocess.fork_exec(*head, *tail)
        break
    except TypeError:
        continue
os.waitpid(pid, 0)
"""
    r = sandbox.run(["python", "-c", code])
    assert not os.path.exists(target) and not os.path.exists(target2)
    assert r.reason == "sandbox_violation", r
    assert any("mount" in v for v in r.violations) and any("Read-only" in v or "denied" in v for v in r.violations)
    assert r.stdout.split()[0] != "0"  # never root


def test_ctypes_fork_execve_cannot_remount_or_write(sandbox):
    target = f"/tmp/rlcore-escape-{uuid.uuid4().hex}"
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None)
argv = (ctypes.c_char_p * 4)(b"/bin/sh", b"-c", {ESCAPE_SH.format(target=target, target2=target + "b").encode()!r}, None)
envp = (ctypes.c_char_p * 1)(None)
pid = libc.fork()
if pid == 0:
    libc.execve(b"/bin/sh", argv, envp)
    os._exit(127)
os.waitpid(pid, 0)
"""
    r = sandbox.run(["python", "-I", "-c", code])  # -I: no audit hook (it would refuse ctypes)
    assert not os.path.exists(target)
    assert r.reason == "sandbox_violation" and r.violations, r


@pytest.mark.parametrize("isolated", [False, True], ids=["hooked", "no-hook"])
def test_cannot_signal_the_caller(sandbox, isolated):
    code = "import os, signal; os.kill(os.getppid(), signal.SIGKILL); os.kill(0, 0); print('alive')"
    r = sandbox.run(["python", *(["-I"] if isolated else []), "-c", code])
    assert os.getpid()  # this process (the caller) is alive to check
    if isolated and os.geteuid() != 0:
        # a user-namespace sandbox's init ignores the signal silently (the kernel protects a
        # namespace's init); nothing outside is reachable either way
        return
    assert r.reason == "sandbox_violation", r


def test_new_session_child_dies_with_the_command(sandbox):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = f"import subprocess; subprocess.Popen(['sleep', '{marker}'], start_new_session=True); print('started')"
    r = sandbox.run(["python", "-I", "-c", code])
    assert r.stdout.strip() == "started" and _alive(marker) == []
    assert r.reason == "sandbox_violation" and "outlived" in r.violations[0], r


def test_timeout_kills_the_whole_tree(sandbox):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = f"import subprocess, time; subprocess.Popen(['sleep', '{marker}'], start_new_session=True); time.sleep(60)"
    r = sandbox.run(["python", "-I", "-c", code], timeout=1.0)
    assert r.reason == "timeout" and r.duration_s < 5 and _alive(marker) == []
    assert any("outlived" in v for v in r.violations)


def test_forkpty_loop_hits_the_process_limit():
    sandbox = LocalSandbox(Limits(timeout_s=20, max_processes=16)) if NO_NS is None else pytest.skip(NO_NS)
    marker = f"{uuid.uuid4().int % 10**6}"
    code = f"""
import os, time
made = 0
try:
    for _ in range(120):
        pid, fd = os.forkpty()
        if pid == 0:
            os.execvp("sleep", ["sleep", "{marker}"])
        made += 1
finally:
    print("made", made, flush=True)
"""
    r = sandbox.run(["python", "-I", "-c", code])
    made = int(r.stdout.split()[1])
    assert made < 16 and _alive(marker) == []
    assert r.reason == "sandbox_violation" and any("temporarily unavailable" in v for v in r.violations), r


def test_not_root_and_own_pid_namespace(sandbox):
    r = sandbox.run(["python", "-I", "-c", "import os; print(os.getuid(), os.getpid(), os.getppid())"])
    uid, pid, ppid = map(int, r.stdout.split())
    assert uid != 0 and pid == 2 and ppid == 1


def test_weak_mode_warns(caplog):
    with caplog.at_level("WARNING", logger="rlcore"):
        LocalSandbox(isolation="weak")
    assert "SANDBOX IS WEAK" in caplog.text


def test_the_command_cannot_forge_its_report(sandbox):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = (
        "import os, subprocess\n"
        "for fd in range(3, 256):\n"
        '    try: os.write(fd, b\'{"status": 0, "timed_out": false, "leftover": 0}\')\n'
        "    except OSError: pass\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
    )
    r = sandbox.run(["python", "-I", "-c", code])
    assert r.reason == "sandbox_violation" and "outlived" in r.violations[0] and _alive(marker) == []


def test_without_namespaces_the_env_is_refused_in_one_line_or_weak_on_request(monkeypatch, caplog):
    from rlcore.envs import make_env
    from rlcore.sandbox import local

    monkeypatch.setitem(local._PROBE, "ns", "unshare: Operation not permitted")  # what such a kernel says
    with pytest.raises(ValueError, match=r"^env.args.sandbox_isolation: .*Operation not permitted.*weak") as err:
        make_env("mini_swe", {}, seed=0)
    assert "\n" not in str(err.value)
    with caplog.at_level("WARNING", logger="rlcore"):
        env = make_env("mini_swe", {"sandbox_isolation": "weak"}, seed=0)
    assert "SANDBOX IS WEAK" in caplog.text and env.sandbox.isolation == "weak"
