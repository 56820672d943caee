"""The vLLM engine (`rollout.engine=vllm`), one module per job: `vllm_engine` (the `AsyncLLM`
adapter), `vllm_versions` (per-token versions of requests in flight), `vllm_updates` (weight
receive and load), `vllm_receivers` (its receivers for the `nccl` and `ipc` transports),
`vllm_colocated` (CUDA IPC receive, sleep), `vllm_worker` (runs inside vLLM's workers),
`direct_receive` (packed buckets copied straight into the parameters), `vllm_codec` (tensors
over vLLM's RPC), `vllm_model_dir` (the model directory from a config), `vllm_checks` (its
config checks). vLLM itself is imported lazily: every module here imports without it."""
