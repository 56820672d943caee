"""A process that serves one environment imports that environment alone: the reward zygote
unpickles the environment it serves, and neither the catalogue nor the other builtin
environments (nor their dependencies: aiohttp for verifiers, the sandbox for mini_swe) may come
with it."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from rlcore.envs import catalog, make_env

PROBE = """
import json, pickle, sys
before = set(sys.modules)
pickle.loads(open(sys.argv[1], "rb").read())
print(json.dumps(sorted(m for m in sys.modules if m not in before)))
"""


@pytest.mark.parametrize("name", ["math", "reverse_text"])
def test_unpickling_one_environment_imports_no_other(tmp_path, name):
    blob = tmp_path / "env.pkl"
    blob.write_bytes(pickle.dumps(make_env(name, {}, seed=0)))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(blob)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    imported = set(json.loads(out.strip().splitlines()[-1]))
    own = catalog.BUILTIN[name]
    assert own in imported
    others = {module for module in catalog.BUILTIN.values() if module != own}
    assert imported & others == set()
    assert "rlcore.envs.catalog" not in imported
    # the environment holds its `env.reward` section: that section alone, not the schema and OmegaConf
    assert not {m for m in imported if m.split(".")[0] in ("aiohttp", "torch", "transformers", "omegaconf")}
    assert "rlcore.config.schema" not in imported


def test_every_builtin_name_is_defined_by_its_module():
    registered = catalog.registered()
    assert set(registered) >= set(catalog.BUILTIN)
    for name, module in catalog.BUILTIN.items():
        assert registered[name].__module__ == module
