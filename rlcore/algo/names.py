"""Names the `algo.*` switches accept, torch-free so config validation can import them."""

ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
"""Values of ``algo.name``."""
LENGTH_PENALTIES = ("none", "overlong", "linear")
"""Values of ``algo.length_penalty``."""
MIS_LEVELS = ("none", "token", "sequence")
"""Values of ``algo.mis_level``."""
LOSSES = ("ppo_clip", "dr_grpo", "dapo", "gspo", "cispo")
"""Values of ``algo.loss``."""
