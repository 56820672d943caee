"""Cost of one poll of the sandbox supervisor (what it does every 1-10 ms while a command runs):
the resident memory of the tree, the AF_UNIX sockets' memory, the work directory's inodes.
Run it as root in a fresh network and PID namespace, as the sandbox's PID 1 sees them:

    unshare -n -p -f --mount-proc python benchmarks/sandbox_poll_cost.py
"""

import statistics
import timeit

from rlcore.sandbox import supervisor as s


def us(fn, n: int = 2000) -> str:
    runs = [timeit.timeit(fn, number=n) / n * 1e6 for _ in range(5)]
    return f"{statistics.median(runs):.0f} us ({min(runs):.0f}-{max(runs):.0f}; median of 5 x {n} calls)"


def main() -> None:
    diag, charge = s.open_diag(), s.socket_charge()
    print("resident memory only (the poll before issue 41):", us(s.resident_mb))
    print("socket memory:", us(lambda: s.socket_mb(diag, charge)))
    print("work-dir inodes:", us(lambda: s.used_inodes("/tmp")))
    print("the whole poll now:", us(lambda: (s.resident_mb(), s.socket_mb(diag, charge), s.used_inodes("/tmp"))))


if __name__ == "__main__":
    main()
