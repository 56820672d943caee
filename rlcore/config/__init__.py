"""The configuration: the schema (typed dataclasses, :mod:`.schema` and its sections
:mod:`.engines`, :mod:`.lifecycle`, :mod:`.teacher`), key checks (:mod:`.keys`), the one
`validate` (:mod:`.validate`) and `ConfigError` (:mod:`.errors`, a leaf module).

This module re-exports the schema classes and `ConfigError` only; it does not import the
validator, so importing a schema class stays cheap and free of import cycles.
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
    "AlgoConfig", "CheckpointConfig", "CispoOptions", "ClusterConfig", "ConfigError", "DapoOptions",
    "DrGrpoOptions", "EnvConfig", "EvalConfig", "GspoOptions",
    "HFOptions", "LoRAConfig", "LoggerConfig", "ModelConfig", "PDConfig", "RolloutConfig", "RunConfig",
    "SFTConfig", "SamplingConfig", "TeacherConfig", "TrainerConfig", "VLLMOptions",
]
