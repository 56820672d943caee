"""Where a run's output lives: the storage location every node reaches, a folder or an object
store (:mod:`.location`), the run folder and its lock (:mod:`.rundir`), an object-store run's
local staging folder, its uploads and its lease (:mod:`.staging`), the checkpoint layout and the
newest complete checkpoint, complete when every rank's part is there (:mod:`.checkpoint_dirs`).
Ray-free; checkpoints (:mod:`.checkpoint`) and exports (:mod:`.export`) use torch, the
rest is torch-free."""
