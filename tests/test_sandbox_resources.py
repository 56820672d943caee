"""Nothing the sandboxed code holds escapes the bounds, and nothing it leaves breaks the supervisor
(issue 41): kernel-memory sinks are refused or counted, work-directory objects are read back
safely, and the run names its real reason. Each case runs as root and as uid 65534."""

import pytest
from test_sandbox_boundary import NO_NS, WHO, run_as

pytestmark = pytest.mark.skipif(NO_NS is not None, reason=f"the sandbox cannot run here: {NO_NS}")

# every way to kernel memory outside the processes' resident size; each must fail with an errno
SINKS = r"""
import ctypes, errno, fcntl, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
open("f", "w").close()
def sys_(*a):
    rc = libc.syscall(*a)
    if rc < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
def call(fn, *a):
    rc = fn(*a)
    if rc < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
TRIES = {
    "memfd_create": lambda: os.write(os.memfd_create("m"), b"x" * 2**20),
    "memfd_secret": lambda: sys_(447, 0),
    "shmget": lambda: call(libc.shmget, 0, 2**20, 0o1600),
    "msgget": lambda: call(libc.msgget, 0, 0o1600),
    "semget": lambda: call(libc.semget, 0, 4, 0o1600),
    "mq_open": lambda: call(libc.mq_open, b"/q", os.O_CREAT | os.O_RDWR, 0o600, None),
    "shm_open": lambda: call(libc.shm_open, b"/s", os.O_CREAT | os.O_RDWR, 0o600),
    "setxattr": lambda: os.setxattr("f", "user.a", b"x" * 1000),
    "lsetxattr": lambda: os.setxattr("f", "user.b", b"x", follow_symlinks=False),
    "fsetxattr": lambda: os.setxattr(os.open("f", os.O_RDONLY), "user.c", b"x"),
    "setxattrat": lambda: sys_(463, -100, b"f", 0, b"user.d", None, 0),
    "inotify_init1": lambda: call(libc.inotify_init1, 0),
    "fanotify_init": lambda: call(libc.fanotify_init, 0, 0),
    "add_key": lambda: sys_(248, b"user", b"k", b"v" * 1000, 1, -2),
    "keyctl": lambda: sys_(250, 0, -3, 0),
    "F_SETPIPE_SZ": lambda: fcntl.fcntl(os.pipe()[1], 1031, 2**20),
    "SO_SNDBUF": lambda: socket.socket(socket.AF_UNIX).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2**26),
    "SO_RCVBUF": lambda: socket.socket(socket.AF_UNIX).setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2**26),
    "AF_INET": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
    "AF_INET6": lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM),
    "AF_NETLINK_route": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0),
    "AF_NETLINK_sock_diag": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4),
    "timer_create": lambda: sys_(222, 1, None, ctypes.byref(ctypes.c_int())),
    "io_setup": lambda: sys_(206, 8, ctypes.byref(ctypes.c_ulong())),
    "AF_ALG": lambda: socket.socket(38, socket.SOCK_SEQPACKET, 0),
    "AF_VSOCK": lambda: socket.socket(40, socket.SOCK_STREAM, 0),
}
for name, fn in TRIES.items():
    try:
        fn()
        print(name, "allowed")
    except OSError as exc:
        print(name, "refused")
        print(f"{name}: {exc.strerror}", file=sys.stderr)
"""


@WHO
def test_kernel_memory_sinks_are_refused_and_reported(who):
    r = run_as(who, ["python", "-I", "-c", SINKS], memory_mb=256)
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert len(lines) == 26 and {k for k, v in lines.items() if v != "refused"} == set(), r.stdout + r.stderr
    assert r.reason == "sandbox_violation", vars(r)


SOCKET_HOG = r"""
import os, socket, time
kids = []
for _ in range(12):  # 12 processes of 120 socket pairs each, every send buffer filled
    pid = os.fork()
    if pid == 0:
        held, pairs = 0, []
        for _ in range(120):
            a, b = socket.socketpair()
            a.setblocking(False)
            try:
                while True:
                    held += a.send(b"x" * 65536)
            except BlockingIOError:
                pass
            if CLOSE:  # the data stays queued in b, charged to a socket no longer listed
                a.close()
            pairs.append(b)
        print("held", held >> 20, "MiB", flush=True)
        time.sleep(20)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print("all held their buffers")
"""


@WHO
@pytest.mark.parametrize("sender", ["open", "closed"])
def test_socket_buffers_count_toward_memory_mb(who, sender):
    code = f"CLOSE = {sender == 'closed'}\n{SOCKET_HOG}"
    r = run_as(who, ["python", "-I", "-c", code], memory_mb=256, timeout_s=40)
    assert r.reason == "memory_limit" and "all held" not in r.stdout, vars(r)
    assert r.duration_s < 20


@WHO
def test_inodes_are_bounded_by_max_files(who):
    # empty files, directories and hard links cost kernel memory that no disk quota counts
    code = (
        "import os\nopen('f', 'w').close()\n"
        "for i in range(200_000):\n"
        "    os.link('f', f'l{i}') if i % 2 else os.mkdir(f'd{i}')\n"
        "print('done')"
    )
    r = run_as(who, ["python", "-I", "-c", code], max_files=5000)
    assert r.reason == "work_dir_limit" and "done" not in r.stdout, vars(r)
    assert any("more than 5000 files" in v for v in r.violations), vars(r)


@WHO
def test_a_fifo_left_behind_is_not_opened(who):
    r = run_as(
        who,
        ["python", "-I", "-c", "import os; os.mkfifo('pipe'); os.mkfifo('p2', 0); open('ok.txt', 'w').write('fine')"],
    )
    assert r.reason is None and r.returncode == 0 and r.files == ["ok.txt"], vars(r)
    assert r.duration_s < 10


DEEP = "import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')\nprint('deep')"


@WHO
def test_a_deep_tree_is_a_work_dir_limit_not_a_crash(who):
    r = run_as(who, ["python", "-I", "-c", DEEP])
    assert r.returncode == 0 and "deep" in r.stdout and r.reason == "work_dir_limit", vars(r)
    assert any("deeper than" in v for v in r.violations), vars(r)


def test_weak_mode_survives_a_deep_tree_and_a_fifo(caplog):
    from rlcore.sandbox import LocalSandbox

    # -I: without the audit hook, whose realpath of every deeper path makes 3000 levels slow
    r = LocalSandbox(isolation="weak").run(["python", "-I", "-c", f"import os; os.mkfifo('p')\n{DEEP}"])
    assert r.returncode == 0 and r.reason == "work_dir_limit" and r.duration_s < 10, r


ODD_OBJECTS = r"""
import os, socket
open("ok.txt", "w").write("fine")
open("new\nline", "w").write("x")
s = socket.socket(socket.AF_UNIX); s.bind("sock")            # a socket file
os.symlink("loop2", "loop1"); os.symlink("loop1", "loop2")   # a symlink loop
os.symlink("/etc/passwd", "passwd"); os.symlink(".", "self")  # links out and back in
open("secret", "w").write("s"); os.chmod("secret", 0)         # no permissions
os.mkdir("closed"); open("closed/in", "w").write("i"); os.chmod("closed", 0)
with open("sparse", "wb") as f:
    f.seek(15 * 2**20); f.write(b"x")                        # sparse, larger than what is read back
open("huge", "wb").write(b"y" * (15 * 2**20))
open(b"\xff\xfename", "w").write("odd bytes")                # not UTF-8
try:
    os.mknod("null", 0o666 | 0o020000, os.makedev(1, 3))    # a device node
except OSError as exc:
    print("mknod", exc.errno)
"""


@WHO
def test_odd_work_dir_objects_are_skipped_safely(who):
    r = run_as(who, ["python", "-I", "-c", ODD_OBJECTS])
    assert r.returncode == 0 and r.reason is None, vars(r)
    assert r.files == ["new\nline", "ok.txt"], vars(r)  # no capability reads past chmod 0


@WHO
def test_signals_from_inside_do_not_reach_the_supervisor(who):
    code = (
        "import os, signal, time\n"
        "for sig in range(1, 65):\n"
        "    try: os.kill(1, sig)\n"
        "    except OSError: pass\n"
        "time.sleep(0.5); print('alive')"
    )
    r = run_as(who, ["python", "-I", "-c", code])
    assert r.returncode == 0 and r.stdout.strip() == "alive" and r.reason is None, vars(r)


@WHO
def test_etc_passwd_is_readable(who):
    r = run_as(who, ["python", "-I", "-c", "import pwd; print(pwd.getpwuid(0).pw_name)"])
    assert r.returncode == 0 and r.stdout.strip() == "root", vars(r)


@WHO
def test_many_files_cost_the_caller_a_bounded_result(who):
    # under max_files, yet 9000 names of 200 bytes: what comes back stays within the read-back budget
    code = "for i in range(9000):\n    open(f'{i:0>200}', 'w').write('x')\nprint('made')"
    r = run_as(who, ["python", "-I", "-c", code])
    assert r.reason is None and "made" in r.stdout, vars(r)
    assert 0 < len(r.files) and sum(len(name) for name in r.files) <= 256 * 1024, len(r.files)


@WHO
def test_idle_sockets_are_not_counted_as_full(who):
    # the other side of counting closed sockets at their most: open, idle ones count what they hold
    code = (
        "import asyncio, socket, time\n"
        "pairs = [socket.socketpair() for _ in range(100)]\n"
        "for a, b in pairs: a.send(b'y' * 1000)\n"
        "srv = socket.socket(socket.AF_UNIX); srv.bind('srv'); srv.listen(50)\n"
        "clients = [socket.socket(socket.AF_UNIX) for _ in range(20)]\n"
        "for c in clients: c.connect('srv'); c.send(b'z' * 100)  # never accepted\n"
        "asyncio.run(asyncio.sleep(0.01)); time.sleep(1); print('ok')"
    )
    r = run_as(who, ["python", "-I", "-c", code], memory_mb=60)
    assert r.reason is None and r.stdout.strip() == "ok", vars(r)
