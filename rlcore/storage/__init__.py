"""Where a run's output lives: the run folder and its lock (:mod:`.rundir`), the checkpoint
layout and the newest complete checkpoint (:mod:`.checkpoint_dirs`). Ray-free and torch-free."""
