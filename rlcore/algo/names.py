"""Names the `algo.*` switches accept, torch-free so config validation can import them (losses
and estimators are registries: :mod:`rlcore.algo.registry`)."""

from rlcore.config import AlgoConfig
from rlcore.config.bounds import choices_of

LENGTH_PENALTIES = choices_of(AlgoConfig, "length_penalty")
"""Values of ``algo.length_penalty`` (written on the field)."""
MIS_LEVELS = choices_of(AlgoConfig, "mis_level")
"""Values of ``algo.mis_level`` (written on the field)."""
