"""The configuration schema and nothing else: typed dataclasses (:mod:`.schema` and its sections
:mod:`.engines`, :mod:`.losses`, :mod:`.lifecycle`, :mod:`.reward`, :mod:`.teacher`, :mod:`.plugins`,
:mod:`.nodes`) and `ConfigError` (:mod:`.errors`, a leaf module). Each field's bound or allowed
values are written on the field and checked by :mod:`.bounds`; key checks and the one `validate`
(what crosses fields and sections) live in `rlcore.plan` (:mod:`rlcore.plan.keys`, :mod:`rlcore.plan.validate`).

This module re-exports the schema classes and `ConfigError` only, each resolved on first use (PEP
562): importing one section (`rlcore.config.reward`, which the reward zygote unpickles with an
environment) does not import the whole schema and OmegaConf. It imports no other rlcore package.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "HFOptions": "rlcore.config.engines",
    "VLLMOptions": "rlcore.config.engines",
    "ConfigError": "rlcore.config.errors",
    "CheckpointConfig": "rlcore.config.lifecycle",
    "EvalConfig": "rlcore.config.lifecycle",
    "LoggerConfig": "rlcore.config.lifecycle",
    "ProfileConfig": "rlcore.config.lifecycle",
    "SFTConfig": "rlcore.config.lifecycle",
    "CispoOptions": "rlcore.config.losses",
    "DapoOptions": "rlcore.config.losses",
    "DrGrpoOptions": "rlcore.config.losses",
    "GspoOptions": "rlcore.config.losses",
    "PDConfig": "rlcore.config.pd",
    "RewardRuntimeConfig": "rlcore.config.reward",
    "AlgoConfig": "rlcore.config.schema",
    "ClusterConfig": "rlcore.config.schema",
    "EnvConfig": "rlcore.config.schema",
    "LoRAConfig": "rlcore.config.schema",
    "ModelConfig": "rlcore.config.schema",
    "RolloutConfig": "rlcore.config.schema",
    "RunConfig": "rlcore.config.schema",
    "SamplingConfig": "rlcore.config.schema",
    "TrainerConfig": "rlcore.config.schema",
    "TeacherConfig": "rlcore.config.teacher",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'rlcore.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name]), name)
