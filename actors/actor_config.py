"""The run config reaches every actor through its runtime_env, never as a constructor argument.

Ray keeps a constructor argument larger than `max_direct_call_object_size` (100 KiB by default;
1 KiB where a real run's path is tested, `RAY_max_direct_call_object_size=1024`) in the object
store, and frees it once the first construction has run: every restart of that actor then fails
(`ReferenceCountingAssertionError`: "the object's owner has exited or the object was freed"). A
restart must not depend on an object Ray may have freed, whatever the settings; an environment
variable of the actor's runtime_env is part of the actor's own creation spec, replayed by every
restart. The config is a few KiB (pickled, compressed, base64). What stays a constructor
argument is a small int (the actor's index), which Ray inlines under any setting.

`remote_class(cls)` gives the Ray class whose constructor takes the config from there and the
rest of its arguments as given; `config_env(cfg)` is the runtime_env that carries it.
"""

from __future__ import annotations

import base64
import os
import pickle
import zlib

import ray

from actors.logs import runtime_env
from rlcore.config import RunConfig
from rlcore.plan.process_env import group_env

CONFIG_ENV = "RLCORE_ACTOR_CONFIG"
"""The environment variable that holds the run config of an actor (pickled, zlib, base64)."""


def config_env(cfg: RunConfig, env_vars: dict | None = None) -> dict:
    """`actors.logs.runtime_env()`, the group's own ``env_vars`` (`trainer.env_vars`, ...) over
    it, and the run config (`CONFIG_ENV`)."""
    env = runtime_env()
    blob = base64.b64encode(zlib.compress(pickle.dumps(cfg))).decode("ascii")
    return {**env, "env_vars": {**env["env_vars"], **group_env(env_vars or {}), CONFIG_ENV: blob}}


def actor_config() -> RunConfig:
    """The run config this actor process was started with (`config_env`)."""
    blob = os.environ.get(CONFIG_ENV)
    if not blob:
        raise RuntimeError(f"{CONFIG_ENV} is not set: start this actor with runtime_env=config_env(cfg)")
    return pickle.loads(zlib.decompress(base64.b64decode(blob)))


def remote_class(cls: type):
    """`ray.remote` of a subclass of `cls` (whose constructor takes the run config first) that
    reads the config from `CONFIG_ENV`: create it with `.options(runtime_env=config_env(cfg))`
    and the constructor's other arguments only."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, actor_config(), *args, **kwargs)

    sub = type(
        cls.__name__,
        (cls,),
        {"__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
    )
    return ray.remote(sub)
