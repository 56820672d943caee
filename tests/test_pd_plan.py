"""Prefill/decode disaggregation and KV offload before Ray starts: the dry-run plan of a 2-node
disaggregated layout, and what is refused in one line (exit 2)."""

import pytest

from rlcore.plan.compose import compose
from rlcore.plan.layout import make_plan
from rlcore.run import main

TWO_NODES = [
    "dry_run=true",
    "cluster.nodes=2",
    "cluster.gpus_per_node=8",
    "cluster.memory_per_node_gib=1024",
    "placement=split",
    "trainer.world_size=4",
    "trainer.gpus_per_rank=1",
    "rollout.engine=vllm",
    "rollout.num_actors=4",
    "rollout.gpus_per_actor=1",
    "rollout.pd.enabled=true",
    "rollout.pd.connector=nixl",
    "rollout.pd.prefill_actors=4",
    "rollout.pd.prefill_gpus_per_actor=2",
    "rollout.pd.prefill_tensor_parallel_size=2",
]
OFFLOAD = [
    *TWO_NODES[:8],
    "rollout.num_actors=8",
    "rollout.gpus_per_actor=1",  # no pd: 8 engines of 1 GPU
    "rollout.vllm.kv_offload_gb=100",
]


def test_two_node_disaggregated_plan(capsys):
    plan = make_plan(compose(TWO_NODES))
    assert plan.problems == []
    decode = [b for b in plan.rollout if b.role == "decode"]
    prefill = [b for b in plan.rollout if b.role == "prefill"]
    assert [b.gpus for b in decode] == [1] * 4 and [b.gpus for b in prefill] == [2] * 4
    assert {b.node for b in plan.trainer + decode} == {0} and {b.node for b in prefill} == {1}
    assert main(TWO_NODES) == 0
    out = capsys.readouterr().out
    assert "8 bundles: 4 decode of {CPU: 1, GPU: 1}, 4 prefill of {CPU: 1, GPU: 2}" in out
    assert "decode nodes: node 0: 4 bundle(s)" in out and "prefill nodes: node 1: 4 bundle(s)" in out
    assert "4 prefill x vllm (tensor_parallel_size=2)" in out and "over nixl" in out
    assert "trainer rank 0 -> 8 engine(s)" in out  # one weight group over both pools


def test_kv_offload_counted_against_the_nodes_ram(capsys):
    assert main(OFFLOAD) == 0
    assert "KV offload: 100 GiB of host memory per engine" in capsys.readouterr().out
    assert main([*OFFLOAD, "rollout.vllm.kv_offload_gb=300"]) == 2  # 4 engines on node 0 + 4 on node 1
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "rlcore: config error: rollout.vllm.kv_offload_gb: 4 engine(s) on node 0 x 300 GiB of KV offload = 1200.0 GiB"
        )
    )
    assert main([*OFFLOAD, "rollout.vllm.kv_offload_gb=-1"]) == 2
    assert "rollout.vllm.kv_offload_gb: must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["rollout.pd.prefill_actors=0"], "rollout.pd.prefill_actors: the prefill pool needs at least one engine"),
        (["rollout.pd.connector=object_store"], "rollout.pd.connector: the vllm engine disaggregates over nixl"),
        (["rollout.pd.connector=shm"], "rollout.pd.connector: unknown connector 'shm'"),
        (
            ["rollout.pd.prefill_gpus_per_actor=0"],
            "rollout.pd.prefill_gpus_per_actor: the vllm engine runs on GPUs only",
        ),
        (
            ["rollout.pd.prefill_gpus_per_actor=0.5", "rollout.gpus_per_actor=0.5"],
            "rollout.vllm.engine_kwargs.gpu_memory_utilization: a prefill and a decode engine sharing one GPU",
        ),
        (["rollout.vllm.kv_offload_gb=8"], "rollout.vllm.kv_offload_gb: vLLM's CPU offload is a KV connector"),
    ],
)
def test_refused_in_one_line(overrides, line, capsys):
    assert main([*TWO_NODES, *overrides]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"rlcore: config error: {line}")


def test_missing_connector_package_is_named(capsys):
    """Not a dry run: the connector's package must be where the run starts (nixl is not here)."""
    assert (
        main(
            [
                "rollout.engine=vllm",
                "rollout.gpus_per_actor=1",
                "rollout.pd.enabled=true",
                "rollout.pd.connector=nixl",
                "rollout.pd.prefill_gpus_per_actor=1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rlcore: config error: rollout.pd.connector: nixl needs the Python package 'nixl'"), err


def test_cpu_disaggregation_fits_this_machine_and_colocation_is_refused(capsys):
    halves = ["rollout.cpus_per_actor=0.5", "rollout.pd.prefill_cpus_per_actor=0.5", "cluster.num_cpus=2"]
    assert main(["dry_run=true", "rollout.pd.enabled=true", *halves]) == 0
    assert "1 decode of {CPU: 0.5, GPU: 0}, 1 prefill of {CPU: 0.5, GPU: 0}" in capsys.readouterr().out
    assert (
        main(
            [
                "dry_run=true",
                "rollout.pd.enabled=true",
                "placement=colocated",
                "trainer.gpus_per_rank=1",
                "rollout.gpus_per_actor=1",
                "cluster.num_gpus=1",
            ]
        )
        == 2
    )
    assert (
        "rlcore: config error: rollout.pd.enabled: prefill/decode pools have GPUs of their own"
        in capsys.readouterr().err
    )


def test_vllm_disaggregation_and_offload_arguments():
    """What a vLLM engine of each pool is started and asked with (vLLM itself runs on the GPU
    machine only: benchmarks/gpu_pd.sh): the KV transfer config, NIXL's request flow, the
    offload engine arguments, one NIXL side-channel port per actor."""
    from rlcore.engine.vllm.vllm_model_dir import engine_args
    from rlcore.engine.vllm.vllm_pd import decode_overrides, kv_transfer_config, prefill_overrides, prefilled_handle
    from rlcore.engine.vllm.vllm_versions import InFlightRequest
    from rlcore.plan.pd import connector_env

    assert kv_transfer_config("nixl") == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    sp = prefill_overrides()
    assert sp["max_tokens"] == 1 and sp["extra_args"]["kv_transfer_params"]["do_remote_decode"] is True
    reqs = [
        InFlightRequest(rid=str(i), version=4, versions=[4], kv_transfer_params={"remote_block_ids": [i]})
        for i in range(2)
    ]
    handle = prefilled_handle([[1, 2], [3]], reqs)
    assert handle.version == 4 and decode_overrides(handle, 1) == {
        "extra_args": {"kv_transfer_params": {"remote_block_ids": [1]}}
    }
    reqs[1].kv_transfer_params = None
    with pytest.raises(RuntimeError, match="no kv_transfer_params for prompt"):
        prefilled_handle([[1, 2], [3]], reqs)
    cfg = compose([*OFFLOAD[1:]])
    kwargs = engine_args(cfg.rollout.vllm, cfg.model)[1]
    assert kwargs["kv_offloading_size"] == 100.0 and kwargs["kv_offloading_backend"] == "native"
    assert connector_env(cfg, 0) == {}  # no disaggregation: no connector
    cfg = compose([*TWO_NODES[1:]])
    ports = {connector_env(cfg, i)["VLLM_NIXL_SIDE_CHANNEL_PORT"] for i in range(8)}
    assert len(ports) == 8


def test_vllm_decode_keeps_one_version_per_sample():
    """The version rule on the vLLM path (`rlcore.engine.vllm.vllm_pd`, run by `VLLMEngine` on the
    GPU machine): a prefill batch an update split is no handle; a decode request enters only on
    the handle's version and outside an update; a first token decoded on other weights is refused."""
    from rlcore.engine.base import Generation, StalePrefill
    from rlcore.engine.vllm.vllm_pd import admits, decoded_on_prefill_version, prefilled_handle
    from rlcore.engine.vllm.vllm_versions import InFlightRequest

    reqs = [
        InFlightRequest(rid=str(i), version=v, versions=[v], kv_transfer_params={"remote_block_ids": [i]})
        for i, v in enumerate([5, 4])
    ]
    with pytest.raises(StalePrefill, match=r"inside the batch \(versions \[4, 5\]\)"):
        prefilled_handle([[1, 2], [3]], reqs)
    reqs[0].versions = [4]
    handle = prefilled_handle([[1, 2], [3]], reqs)
    admits(handle, 4, updating=False)
    admits(None, 9, updating=True)  # a request of its own (no handle) enters any time
    for version, updating in ((5, False), (3, False), (4, True)):
        with pytest.raises(StalePrefill):
            admits(handle, version, updating)
    ok = [Generation([7, 8], [0.0, 0.0], [4, 5], "length")]  # a later token on newer weights: any request's
    assert decoded_on_prefill_version(ok, handle) is ok
    with pytest.raises(StalePrefill, match=r"prompt\(s\) \[1\] decoded their first token at version 5"):
        decoded_on_prefill_version([*ok, Generation([7], [0.0], [5], "stop")], handle)
