"""The configuration schema and nothing else: typed dataclasses (:mod:`.schema` and its sections
:mod:`.engines`, :mod:`.losses`, :mod:`.lifecycle`, :mod:`.teacher`, :mod:`.plugins`, :mod:`.nodes`)
and `ConfigError` (:mod:`.errors`, a leaf module). Each field's bound or allowed values are
written on the field and checked by :mod:`.bounds`; key checks and the one `validate` (what
crosses fields and sections) live in `rlcore.plan` (:mod:`rlcore.plan.keys`, :mod:`rlcore.plan.validate`).

This module re-exports the schema classes and `ConfigError` only; it imports no other rlcore
package, so importing a schema class stays cheap and free of import cycles.
"""

from rlcore.config.engines import HFOptions, VLLMOptions
from rlcore.config.errors import ConfigError
from rlcore.config.lifecycle import CheckpointConfig, EvalConfig, LoggerConfig, SFTConfig
from rlcore.config.losses import CispoOptions, DapoOptions, DrGrpoOptions, GspoOptions
from rlcore.config.pd import PDConfig
from rlcore.config.schema import (
    AlgoConfig,
    ClusterConfig,
    EnvConfig,
    LoRAConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    TrainerConfig,
)
from rlcore.config.teacher import TeacherConfig

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "CispoOptions",
    "ClusterConfig",
    "ConfigError",
    "DapoOptions",
    "DrGrpoOptions",
    "EnvConfig",
    "EvalConfig",
    "GspoOptions",
    "HFOptions",
    "LoRAConfig",
    "LoggerConfig",
    "ModelConfig",
    "PDConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SamplingConfig",
    "TeacherConfig",
    "TrainerConfig",
    "VLLMOptions",
]
