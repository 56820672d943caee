"""Weights between trainer and engines, the parts both sides share: the protocol a transport and
an engine agree on (:mod:`.protocol`), the CUDA IPC handle (:mod:`.cuda_ipc`) and the canary that
checks every sync (:mod:`.canary`). The transports themselves are in `rlcore.transfer`."""
