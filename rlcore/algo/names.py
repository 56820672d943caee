"""Names the `algo.*` switches accept, torch-free so config validation can import them (losses
and estimators are registries: :mod:`rlcore.algo.registry`)."""

LENGTH_PENALTIES = ("none", "overlong", "linear")
"""Values of ``algo.length_penalty``."""
MIS_LEVELS = ("none", "token", "sequence")
"""Values of ``algo.mis_level``."""
