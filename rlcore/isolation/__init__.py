"""Where reward code runs: worker processes forked from a lean zygote (:mod:`.reward_zygote`,
:mod:`.reward_workers`), the worker's loop, which runs each call in a fork of its own
(:mod:`.reward_worker_loop`), its progress memory (:mod:`.reward_worker_progress`), namespaces
(:mod:`.reward_worker_ns`) and the thread/process isolation of one call (:mod:`.safety`).
It imports no environment: the zygote loads only the one it serves. Episode code (the policy's
programs) runs in `rlcore.sandbox` instead."""
