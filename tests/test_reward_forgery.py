"""The policy cannot write its own reward (issue 41): mini_swe's test results reach the reward
through a channel its code can neither write nor predict, and every reward is checked against the
environment's declared range.

Each attack class is a policy's final files: the planted bug left in, plus code that tries to
forge the result (on the code before the fix, each of them scored more than leaving the bug, most
of them 1000.0). Each must score no more than the policy that does nothing, in the real sandbox
(skipped where the kernel refuses namespaces, as tests/test_env_sandbox.py does) and in the local
`weak` fallback.
"""

import json
import math

import pytest

from rlcore.batch.meta import group_meta
from rlcore.config.reward import RewardRuntimeConfig
from rlcore.envs import make_env
from rlcore.envs.base import Environment
from rlcore.envs.mini_swe import visible_calls
from rlcore.envs.sealed_tests import read_report, run_sealed
from rlcore.report.failures import FailureLog
from rlcore.sandbox.local import namespaces_problem
from rlcore.types import Group, Task
from tests.test_env_safety import run

NO_NS = namespaces_problem()
FORGED = json.dumps({"passed": 1000, "total": 1, "failed": []})  # the old runner's summary, forged

# the visible tests' answers as `answers` (test name -> expected value), read from test_lib.py
ANSWERS = (
    "import re as _re\n"
    "answers = {n: eval(w) for n, w in _re.findall(r'def (test_\\w+)\\(\\):\\n    assert .* == (.*)',"
    " open('test_lib.py').read())}\n"
)
# a report as the runner writes it, with every visible answer right (hidden ones guessed)
REPORT = ANSWERS + (
    "import json as _json\n"
    "report = _json.dumps({**{f'hidden_{f}_{j}': {'value': 0} for f in ('add', 'is_even', 'factorial',"
    " 'largest', 'reverse', 'count_vowels', 'clamp', 'square') for j in range(3)},"
    " **{n: {'value': v} for n, v in answers.items()}})\n"
)
# the runner's memory, region by region, into `seen` (what a nonce thief reads)
READ_RUNNER = (
    "import os as _os\n"
    "seen = ''\n"
    "try:\n"
    "    with open(f'/proc/{_os.getppid()}/maps') as maps, open(f'/proc/{_os.getppid()}/mem', 'rb') as mem:\n"
    "        for region in maps:\n"
    "            lo, hi = (int(x, 16) for x in region.split()[0].split('-'))\n"
    "            if region.split()[1].startswith('rw') and hi - lo < 1 << 26:\n"
    "                try:\n                    mem.seek(lo); seen += mem.read(hi - lo).decode('latin-1')\n"
    "                except OSError: pass\n"
    "except OSError:\n    pass\n"
    "for path in ('.rlcore_tests.json', f'/proc/{_os.getppid()}/cmdline', f'/proc/{_os.getppid()}/environ',"
    " '/proc/self/environ'):\n"
    "    try: seen += open(path, 'rb').read(1 << 16).decode(errors='replace')\n    except OSError: pass\n"
)

# code appended to the task's buggy lib.py; it runs when the test process imports lib. Each also
# prints the old runner's summary (what made it score 1000.0 before)
ATTACKS = {
    "forged_summary": f"print({FORGED!r}, flush=True)\nimport os\nos._exit(0)\n",
    "early_exit_sys": f"print({FORGED!r}, flush=True)\nimport sys\nsys.exit(0)\n",
    "early_exit_os": f"import os\nos.write(1, b{FORGED!r} + b'\\n')\nos._exit(0)\n",
    # the runner's own modules and process: json.dumps replaced, the runner file rewritten on disk
    "patch_runner": (
        "import json, sys\n"
        f"json.dumps = lambda *a, **k: {FORGED!r}\n"
        f"open('run_tests.py', 'w').write('print({FORGED!r})')\n"
        "main = sys.modules['__main__']\n"
        "for name in ('main', '_run_child', 'read_report'):\n"
        "    setattr(main, name, lambda *a, **k: print(" + repr(FORGED) + "))\n"
    ),
    # tests made to disappear: the file deleted, `dir` reporting only the tests that pass
    "delete_tests": (
        "import builtins, os\n"
        "try:\n    os.remove('test_lib.py'); os.rename('run_tests.py', 'x.py')\nexcept OSError:\n    pass\n"
        "_dir = builtins.dir\n"
        "def _passes(f):\n"
        "    try:\n        f(); return True\n    except Exception:\n        return False\n"
        "builtins.dir = lambda *a: [n for n in _dir(*a) if not (a and n.startswith('test_'))"
        " or _passes(getattr(a[0], n))]\n"
    ),
    # where a harness might read: work-dir files, stdout, stderr, every descriptor, /proc paths
    "write_result": REPORT
    + (
        "import os\n"
        f"lines = [({FORGED!r} + '\\n').encode(), (('f' * 32) + ' ' + report + '\\n').encode()]\n"
        "for name in ('results.json', 'report.json', '.rlcore_tests.json', 'summary.txt'):\n"
        "    open(name, 'wb').write(b''.join(lines))\n"
        "for fd in range(0, 1024):\n"
        "    for line in lines:\n"
        "        try: os.write(fd, line)\n        except OSError: pass\n"
        "for path in ('/dev/stdout', '/dev/stderr', f'/proc/{os.getppid()}/fd/1', '/proc/1/fd/1',\n"
        "             f'/proc/{os.getppid()}/fd/2'):\n"
        "    try:\n        with open(path, 'ab') as f: f.write(b''.join(lines))\n    except OSError: pass\n"
        "os._exit(0)\n"
    ),
    # the visible answers written into the test process's own value channel (a lookup table)
    "lookup_table": (
        "import json, re as _re, sys\n"
        "calls = getattr(sys.modules['__main__'], 'calls', [])\n"
        "src = open('test_lib.py').read()\n"
        "table = {(f, a): eval(w) for f, a, w in _re.findall(r'assert (\\w+)\\((.*)\\) == (.*)', src)}\n"
        "for i, (f, args) in enumerate(calls):\n"
        "    print(json.dumps({'i': i, 'value': table.get((f, ', '.join(map(repr, args))), 0)}), flush=True)\n"
        f"print({FORGED!r}, flush=True)\n"
        "import os\nos._exit(0)\n"
    ),
    # every function returns an object equal to anything; builtins and unittest patched
    "monkeypatch": (
        "import builtins, unittest\n"
        "class Anything:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __bool__(self): return True\n"
        "for _name in [n for n, v in list(globals().items()) if callable(v) and not n.startswith('_')\n"
        "              and n != 'Anything' and getattr(v, '__module__', '') == __name__]:\n"
        "    globals()[_name] = lambda *a, **k: Anything()\n"
        "builtins.isinstance = lambda *a: True\n"
        "builtins.AssertionError = type('Nothing', (Exception,), {})\n"
        "unittest.TestCase.run = lambda *a, **k: None\n"
    ),
    # the runner (or whatever started the tests) killed, after a forged summary
    "kill_parent": (
        f"print({FORGED!r}, flush=True)\n"
        "import os, signal\n"
        "for pid in (os.getppid(), 1, -1, 0):\n"
        "    try: os.kill(pid, signal.SIGKILL)\n    except (OSError, PermissionError): pass\n"
        "try: signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)\n"
        "except (OSError, AttributeError): pass\n"
        "os._exit(0)\n"
    ),
    # lines that look like the report: random nonces, and any 32-hex string the runner leaks
    "nonce_line": REPORT
    + READ_RUNNER
    + (
        "import secrets\n"
        "for nonce in set(_re.findall(r'[0-9a-f]{32}', seen)) | {secrets.token_hex(16) for _ in range(50)}:\n"
        "    print(nonce + ' ' + report, flush=True)\n"
        f"print({FORGED!r}, flush=True)\n"
        "_os._exit(0)\n"
    ),
    # the nonce stolen from the runner's memory, the report written to the runner's own stdout,
    # the runner killed so that report is the only one
    "steal_nonce": REPORT
    + READ_RUNNER
    + (
        "import signal\n"
        "try:\n"
        "    fd = _os.open(f'/proc/{_os.getppid()}/fd/1', _os.O_WRONLY | _os.O_APPEND)\n"
        "    for c in set(_re.findall(r'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])', seen)):\n"
        "        _os.write(fd, (c + ' ' + report + '\\n').encode())\n"
        "except OSError:\n    pass\n"
        "try: signal.pidfd_send_signal(_os.pidfd_open(_os.getppid()), signal.SIGKILL)\n"
        "except (OSError, AttributeError): pass\n"
        f"print({FORGED!r}, flush=True)\n"
        "_os._exit(0)\n"
    ),
}


@pytest.fixture(scope="module", params=["namespaces", "weak"])
def env(request):
    if request.param == "namespaces" and NO_NS is not None:
        pytest.skip(f"the kernel refuses namespaces here: {NO_NS}")
    return make_env("mini_swe", {"functions": 2, "bugs": 1, "sandbox_isolation": request.param}, seed=0)


def score(env, task, files):
    return env.score(task, [], {"files": files})


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_forged_result_scores_no_more_than_leaving_the_bug(env, attack):
    for index in (0, 3):  # two tasks: different functions broken
        task = env.make_task(index, "train")
        files = dict(task.info["files"])
        nothing = score(env, task, files)
        assert nothing < 1.0 and score(env, task, {**files, "lib.py": task.info["fixed"]}) == 1.0
        forged = {
            **files,
            "lib.py": files["lib.py"] + "\n\n" + ATTACKS[attack],
            "test_lib.py": "def test_ok():\n    pass\n",
            "run_tests.py": f"print({FORGED!r})\n",
            "json.py": f"def dumps(*a, **k):\n    return {FORGED!r}\n",
            ".local/lib/python3.11/site-packages/usercustomize.py": f"print({FORGED!r})\n",
        }
        got = score(env, task, forged)
        assert 0.0 <= got <= nothing, (attack, index, got, nothing)
        if attack != "lookup_table":  # the channel itself: no visible test passes that the bug fails
            visible = visible_calls(task.info["functions"])
            honest = run_sealed(env.sandbox, files, visible, env.budget_s).passed
            assert set(run_sealed(env.sandbox, forged, visible, env.budget_s).passed) <= set(honest), attack


def test_the_report_is_read_only_from_the_one_line_keyed_by_the_nonce():
    nonce = "ab" * 16
    good = nonce + " " + json.dumps({"test_a_0": {"value": 1}})
    assert read_report(f"noise\n{good}\n", nonce) == ({"test_a_0": {"value": 1}}, None)
    assert read_report(f"{good}\n{good}\n", nonce)[0] is None  # a second report: none is believed
    assert read_report("cd" * 16 + good[32:], nonce)[0] is None
    assert read_report(FORGED, nonce) == (None, "no test report")


class Scaled(Environment):
    """A reward outside [0, 1] unless the environment declares its scale."""

    def make_task(self, index, split):
        return Task(id=f"t/{index}", messages=[{"role": "user", "content": "hi"}], answer="")

    def reward(self, task, completion):
        return 1000.0


@pytest.mark.parametrize("on_error", ["fail", "zero"])
def test_a_reward_outside_the_declared_range_is_a_failed_sample_with_its_reason(on_error):
    samples = run(Scaled(reward_runtime=RewardRuntimeConfig(on_error=on_error, isolation="thread")))
    for s in samples:  # never trained on, whatever env.reward.on_error says
        assert s.failed and s.reward == 0.0
        assert "1000 is outside the environment's declared range [0, 1]" in s.error
    failures = FailureLog(stop_after=0)  # counted like any other failure, under its reason
    failures.request_done([group_meta(Group(task=Scaled().make_task(0, "train"), samples=samples))], actor=0)
    [(reason, count)] = failures.step_metrics()["failed_by_reason"].items()
    assert count == 2 and "outside the environment's declared range" in reason
    declared = run(Scaled(reward_range=[0, 1000], reward_runtime=RewardRuntimeConfig(isolation="thread")))
    assert [s.reward for s in declared] == [1000.0, 1000.0] and not any(s.failed for s in declared)


@pytest.mark.parametrize("bad", [[1, 0], [0, math.nan], "x", [0]])
def test_a_bad_declared_range_names_the_key(bad):
    with pytest.raises(ValueError, match="^env.args.reward_range: "):
        Scaled(reward_range=bad)
