"""Weight-transfer transports, each a trainer-side sender and an engine-side receiver: `ipc`
(CUDA IPC, trainer and engine on one GPU). The NCCL and gloo transports still live in
`rlcore.engine.vllm_sync` and `actors.weight_group`."""
