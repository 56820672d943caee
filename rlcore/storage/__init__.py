"""Where a run's output lives: the storage location every node reaches (:mod:`.location`), the
run folder and its lock (:mod:`.rundir`), the checkpoint layout and the newest complete
checkpoint, complete when every rank's part is there (:mod:`.checkpoint_dirs`). Ray-free and
torch-free."""
