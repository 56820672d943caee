"""The local sandbox stops runaway CPU, memory, network and writes outside it, with a reason."""

import os
import uuid

import pytest

from rlcore.sandbox import Limits, LocalSandbox
from rlcore.sandbox.local import can_readonly_fs, can_unshare_net


@pytest.fixture(scope="module")
def sandbox():
    return LocalSandbox(Limits(timeout_s=3, cpu_s=1, memory_mb=256))


def test_runs_and_returns_files(sandbox):
    r = sandbox.run(["python", "-c", "print(open('in.txt').read()); open('out/x.txt','w').write('y')"],
                    files={"in.txt": "hello", "out/keep": ""})
    assert r.ok and r.stdout.strip() == "hello" and r.files["out/x.txt"] == "y"


def test_wall_clock_timeout_kills(sandbox):
    r = sandbox.run(["python", "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert r.reason == "timeout" and r.duration_s < 3


def test_cpu_limit(sandbox):
    r = sandbox.run(["python", "-c", "while True: pass"])
    assert r.reason == "cpu_limit"


def test_memory_limit(sandbox):
    r = sandbox.run(["python", "-c", "x = bytearray(1024 * 1024 * 1024)"])
    assert r.reason == "memory_limit" and "MemoryError" in r.stderr


def test_network_blocked_for_python(sandbox):
    r = sandbox.run(["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)"])
    assert r.returncode != 0 and r.reason == "sandbox_violation" and "network access is disabled" in r.stderr


@pytest.mark.skipif(not can_unshare_net(), reason="network namespaces need root / CAP_SYS_ADMIN")
def test_network_namespace_blocks_any_program(sandbox):
    # -I skips the Python guard: only the namespace stands in the way
    r = sandbox.run(["python", "-I", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)"])
    assert r.returncode != 0 and ("unreachable" in r.stderr or "OSError" in r.stderr)


def test_write_outside_blocked(sandbox, tmp_path):
    target = f"/tmp/rlcore-escape-{uuid.uuid4().hex}"
    r = sandbox.run(["python", "-c", f"open('{target}', 'w').write('x')"])
    assert r.reason == "sandbox_violation" and "write outside the sandbox" in r.stderr
    assert not os.path.exists(target)


@pytest.mark.skipif(not can_readonly_fs(), reason="mount namespaces need root / CAP_SYS_ADMIN")
def test_readonly_filesystem_blocks_any_program(sandbox):
    target = f"/tmp/rlcore-escape-{uuid.uuid4().hex}"
    r = sandbox.run(["sh", "-c", f"echo x > {target}; echo y > inside.txt"])
    assert "Read-only file system" in r.stderr and r.files == {"inside.txt": "y\n"}
    assert not os.path.exists(target)


def test_paths_must_stay_inside(sandbox):
    with pytest.raises(ValueError):
        sandbox.run(["true"], files={"../evil": "x"})
