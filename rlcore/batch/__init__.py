"""The batch path of one RL step, Ray-free: finished groups as metadata (:mod:`.meta`), the
staleness rule (:mod:`.staleness`), the rollout buffer (:mod:`.buffer`) and overdue groups
(:mod:`.stragglers`), the step page (:mod:`.step`: advantages -> packed per-rank shards),
packing (:mod:`.packing`), the ranks' split (:mod:`.parallel_dims`), routing replay's
per-sample data (:mod:`.routing`) and seeds (:mod:`.seeding`). SFT's data and batches are
`rlcore.sft`."""
