"""The placement plan of a run, computed from the config alone (no Ray): what `dry_run=true`
prints, what validation checks against a described cluster, and what the run hands the Ray layer
(`run_plan`: `actors/` places its bundles and reads its pools and shares, deciding none of them).

Bundles are laid on nodes the way Ray's PACK strategy does for our two placement groups: the
trainer group first, filling nodes in order, then the rollout group; a bundle never spans nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlcore.config import RunConfig
from rlcore.engine.registry import memory_share, option_key, sleep_level, tensor_parallel_size
from rlcore.models.moe_family import num_routed_experts
from rlcore.plan.memory import GIB, param_count, trainer_memory
from rlcore.plan.pd import machine_ram_bytes, offload_gib, offload_problems, pd_on, rollout_pools
from rlcore.plan.placement import colocated_shares, placement_problems, resolve
from rlcore.plan.teacher import resolved as teacher_resolved


@dataclass
class Bundle:
    group: str
    index: int
    cpus: float
    gpus: float
    node: int = -1
    role: str = "rollout"
    """Of a rollout bundle: its pool (`rlcore.plan.pd.rollout_pools`: rollout, or decode / prefill)."""


@dataclass
class Plan:
    """What the planner decided, made once: printed by a dry run (`make_plan`, laid on described
    nodes) and handed to the Ray layer (`run_plan`), which places these bundles and reads the
    pools and shares from here instead of deciding them again."""

    nodes: int = 0
    """Nodes the bundles are laid on; 0 in a run's plan (`run_plan`: Ray lays them on the live nodes)."""
    gpus_per_node: int = 0
    """GPUs of each planned node (0 in a run's plan)."""
    cpus_per_node: int = 0
    """CPUs of each planned node (0 in a run's plan)."""
    trainer: list[Bundle] = field(default_factory=list)
    """The trainer group's bundles, one per rank; colocated: the shared bundles (group `colocated`)."""
    rollout: list[Bundle] = field(default_factory=list)
    teacher: list[Bundle] = field(default_factory=list)
    """On-policy distillation's teacher group (placed after the rollout group); empty without one."""
    mesh: dict[str, int] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)
    config: RunConfig | None = None
    """The config with its placement resolved for this plan's GPUs."""
    gpu_bytes: int | None = None
    colocated_share: float = 0.0
    """GPU that trainer rank i and engine i each take of colocated bundle i (`colocated_shares`); 0 when split."""

    @property
    def colocated(self) -> bool:
        """Whether trainer rank i and rollout actor i share bundle i (one 'rlcore-colocated' group)."""
        return bool(self.trainer) and self.trainer[0].group == "colocated"

    @property
    def roles(self) -> list[str]:
        """Each rollout actor's pool, by index (`rlcore.plan.pd.rollout_pools`; colocated: one engine per shared bundle)."""
        return [b.role for b in (self.trainer if self.colocated else self.rollout)]


def arch_value(cfg: RunConfig, key: str) -> int | None:
    """An architecture fact from `model.arch` (for a hub model the recipe restates the facts the
    plan needs, so planning works offline; the loaded checkpoint's config is what runs)."""
    value = cfg.model.arch.get(key)
    return int(value) if value is not None else None


def mesh_of(cfg: RunConfig) -> dict[str, int]:
    t = cfg.trainer
    cp = t.cp
    dp = t.dp if t.dp is not None else max(t.world_size // max(cp, 1), 1)
    return {"world": t.world_size, "dp": dp, "cp": cp, "ep": t.ep}


def make_plan(cfg: RunConfig) -> Plan:
    c = cfg.cluster
    gpu_bytes = int(c.gpu_memory_gib * 2**30) if c.gpu_memory_gib else None
    if c.nodes is None:  # this machine, as a local Ray would see it
        import os

        import torch

        gpus = c.num_gpus if c.num_gpus is not None else torch.cuda.device_count()
        plan = Plan(nodes=1, gpus_per_node=gpus, cpus_per_node=c.num_cpus or os.cpu_count() or 1)
        if gpu_bytes is None and gpus and torch.cuda.is_available():
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        plan = Plan(nodes=c.nodes, gpus_per_node=c.gpus_per_node, cpus_per_node=c.cpus_per_node)
    plan.gpu_bytes = gpu_bytes
    cfg = with_groups(plan, resolve(cfg, plan.nodes * plan.gpus_per_node, gpu_bytes))
    free = [[float(plan.cpus_per_node), float(plan.gpus_per_node)] for _ in range(plan.nodes)]
    for b in plan.trainer + plan.rollout + plan.teacher:
        for n, (cpu, gpu) in enumerate(free):
            if b.cpus <= cpu + 1e-9 and b.gpus <= gpu + 1e-9:  # shares like 0.8 + 0.2 must fill a GPU
                b.node = n
                free[n][0] -= b.cpus
                free[n][1] -= b.gpus
                break
    plan.problems = plan_problems(cfg, plan) + placement_problems(
        cfg, plan.nodes * plan.gpus_per_node, gpu_bytes, f"the plan's {plan.nodes} node(s)"
    )
    ram = (
        machine_ram_bytes()
        if c.nodes is None
        else (int(c.memory_per_node_gib * 2**30) if c.memory_per_node_gib else None)
    )
    engines: dict[int, int] = {}
    for b in plan.rollout:
        engines[b.node] = engines.get(b.node, 0) + 1
    plan.problems += offload_problems(cfg, engines, ram)
    return plan


def run_plan(cfg: RunConfig) -> Plan:
    """The plan a run hands the Ray layer (`rlcore.run`), of `cfg` with its placement resolved for
    the cluster it runs on: the groups' bundles, pools, colocated shares and mesh; no node layout
    nor problems (Ray lays the bundles on the live nodes, which validation checked already). Its
    config has a local `teacher.path` made absolute (actors need not share the driver's cwd)."""
    plan = Plan()
    with_groups(plan, teacher_resolved(cfg))
    return plan


def with_groups(plan: Plan, cfg: RunConfig) -> RunConfig:
    """Fill `plan` with the groups, shares and mesh of `cfg` (placement resolved); returns `cfg`."""
    plan.config = cfg
    plan.trainer, plan.rollout, plan.teacher = group_bundles(cfg)
    plan.colocated_share = colocated_shares(cfg)[1] if cfg.current_placement() == "colocated" else 0.0
    plan.mesh = mesh_of(cfg)
    return cfg


def group_bundles(cfg: RunConfig) -> tuple[list[Bundle], list[Bundle], list[Bundle]]:
    """The bundles of the trainer (or colocated), rollout and teacher groups of a config whose
    placement is resolved, in the order Ray is asked for them; nodes unassigned."""
    t, r, tc = cfg.trainer, cfg.rollout, cfg.teacher
    if cfg.current_placement() == "colocated":  # one bundle per GPU, shared by trainer rank i and engine i
        trainer = [
            Bundle("colocated", i, t.cpus_per_rank + r.cpus_per_actor, colocated_shares(cfg)[0])
            for i in range(t.world_size)
        ]
        rollout = []
    else:
        trainer = [Bundle("trainer", i, t.cpus_per_rank, t.gpus_per_rank) for i in range(t.world_size)]
        pools = [(role, cpus, gpus) for role, n, cpus, gpus in rollout_pools(cfg) for _ in range(n)]
        rollout = [Bundle("rollout", i, cpus, gpus, role=role) for i, (role, cpus, gpus) in enumerate(pools)]
    teacher = (
        [Bundle("teacher", i, tc.cpus_per_actor, tc.gpus_per_actor) for i in range(tc.num_actors)]
        if tc.enabled and cfg.mode == "rl"
        else []
    )
    return trainer, rollout, teacher


def plan_problems(cfg: RunConfig, plan: Plan) -> list[tuple[str, str]]:
    t, r = cfg.trainer, cfg.rollout
    out: list[tuple[str, str]] = []
    for b in plan.trainer + plan.rollout + plan.teacher:
        if b.gpus > plan.gpus_per_node:
            key = {
                "trainer": "trainer.gpus_per_rank",
                "colocated": "trainer.gpus_per_rank",
                "rollout": "rollout.pd.prefill_gpus_per_actor" if b.role == "prefill" else "rollout.gpus_per_actor",
            }.get(b.group, "teacher.gpus_per_actor")
            out.append((key, f"a {b.group} bundle asks {b.gpus:g} GPUs; a node has {plan.gpus_per_node}"))
            return out
    need = sum(b.gpus for b in plan.trainer + plan.rollout + plan.teacher)
    have = plan.nodes * plan.gpus_per_node
    if need > have + 1e-9:
        out.append(
            (
                "cluster.nodes",
                f"trainer + rollout{' + teacher' if plan.teacher else ''} need {need:g} GPUs; "
                f"{plan.nodes} node(s) x {plan.gpus_per_node} have {have}",
            )
        )
    elif any(b.node < 0 for b in plan.trainer + plan.rollout + plan.teacher):
        out.append(("cluster.nodes", "the bundles do not fit on the nodes without splitting one across nodes"))
    experts = num_routed_experts(cfg.model.arch) or None
    if t.ep > 1:
        if experts is None:
            out.append(
                (
                    "trainer.ep",
                    "expert parallelism needs an MoE model (model.arch gives no routed-expert count: "
                    "num_experts / n_routed_experts / num_local_experts)",
                )
            )
        elif experts % t.ep:
            out.append(("trainer.ep", f"ep={t.ep} does not divide the model's {experts} experts"))
    heads = arch_value(cfg, "num_attention_heads")
    if heads is not None and t.cp > 1 and heads % t.cp:
        out.append(("trainer.cp", f"cp={t.cp} does not divide the model's {heads} attention heads"))
    kv_heads = arch_value(cfg, "num_key_value_heads")
    tp = tensor_parallel_size(r)  # 1 for engines without tensor parallelism
    if kv_heads is not None and tp > 1 and kv_heads % tp and tp % kv_heads:
        out.append(
            (
                option_key(r, "tensor_parallel_size"),
                f"TP={tp} and the model's {kv_heads} KV heads do not divide each other",
            )
        )
    return out


def _size(cfg: RunConfig) -> str:
    """`` (30.5B parameters, 3.3B active)`` as `model.arch` describes the model ('' when it does
    not; a dense model's active count is its total)."""
    total, active = param_count(cfg), param_count(cfg, active=True)
    if not total or total < 10**8:
        return ""
    return f" ({total / 1e9:.1f}B parameters" + (f", {active / 1e9:.1f}B active)" if active != total else ")")


def format_plan(cfg: RunConfig, plan: Plan) -> str:
    cfg = plan.config or cfg  # placement resolved
    t, r = cfg.trainer, cfg.rollout
    m = plan.mesh
    lines = [
        f"rlcore placement plan ({cfg.recipe or 'default'}): {plan.nodes} node(s) x {plan.gpus_per_node} GPUs, "
        f"{plan.cpus_per_node} CPUs",
        f"model: {cfg.model.path or 'random-weight ' + str(cfg.model.arch.get('model_type'))}{_size(cfg)}",
        *(
            _colocated_lines(cfg, plan)
            if cfg.current_placement() == "colocated"
            else [
                f"placement group 'rlcore-trainer' (PACK): {len(plan.trainer)} bundles of "
                f"{{CPU: {t.cpus_per_rank:g}, GPU: {t.gpus_per_rank:g}}}",
                f"  nodes: {_by_node(plan.trainer)}",
            ]
        ),
        f"  device mesh {m['world']} ranks: dp={m['dp']} x cp={m['cp']} (FSDP2 shards over dp*cp); "
        f"ep={m['ep']} expert groups carved from the dp*cp ranks"
        + (
            f"; {num_routed_experts(cfg.model.arch) // max(m['ep'], 1)} experts per rank"
            if num_routed_experts(cfg.model.arch)
            else ""
        ),
        *(engine_lines(cfg) if cfg.current_placement() == "colocated" else rollout_lines(cfg, plan)),
        (
            "weight sync: CUDA IPC, trainer rank i -> engine i on the same GPU (no NCCL between them)"
            if cfg.current_placement() == "colocated"
            else f"weight sync: trainer rank 0 -> {len(plan.rollout)} engine(s), buckets of {r.sync_bucket_mb:g} MiB"
            + (" (both pools in one group)" if pd_on(cfg) else "")
        ),
        *teacher_lines(cfg, plan),
        f"async: max_off_policy_steps={cfg.algo.max_off_policy_steps}, batch {cfg.algo.batch_groups} groups x "
        f"{cfg.algo.group_size} samples, max_new_tokens={r.sampling.max_new_tokens}",
    ]
    if plan.problems:
        lines += [f"PROBLEM {k}: {v}" for k, v in plan.problems]
    return "\n".join(lines)


def rollout_lines(cfg: RunConfig, plan: Plan) -> list[str]:
    """The rollout placement group: its bundles by pool, their nodes, the engines."""
    pools = rollout_pools(cfg)
    sizes = ", ".join(
        f"{n} {'' if role == 'rollout' else role + ' '}of {{CPU: {c:g}, GPU: {g:g}}}" for role, n, c, g in pools
    )
    lines = [f"placement group 'rlcore-rollout' (PACK): {len(plan.rollout)} bundles: {sizes}"]
    for role, _, _, _ in pools:
        lines.append(
            f"  {'' if role == 'rollout' else role + ' '}nodes: {_by_node([b for b in plan.rollout if b.role == role])}"
        )
    return lines + engine_lines(cfg)


def engine_lines(cfg: RunConfig) -> list[str]:
    """The engines the rollout group runs (both pools with disaggregation) and their KV offload."""
    r, lines = cfg.rollout, []
    if pd_on(cfg):
        p = cfg.rollout.pd
        lines.append(
            f"  engines: {r.num_actors} decode x {r.engine} (tensor_parallel_size={tensor_parallel_size(r)}) "
            f"running the episodes + {p.prefill_actors} prefill x {r.engine} (tensor_parallel_size="
            f"{p.prefill_tensor_parallel_size}); router: each generate call prefills on the least-loaded "
            f"prefill engine, the cache goes to its decode engine over {p.connector}"
        )
    else:
        lines.append(
            f"  engines: {r.num_actors} x {r.engine} (tensor_parallel_size={tensor_parallel_size(r)}), "
            f"{r.num_actors} data-parallel replicas"
        )
    if offload_gib(cfg) > 0:
        lines.append(f"  KV offload: {offload_gib(cfg):g} GiB of host memory per engine (vLLM's native CPU backend)")
    return lines


def teacher_lines(cfg: RunConfig, plan: Plan) -> list[str]:
    tc = cfg.teacher
    if not plan.teacher:
        return []
    return [
        f"placement group 'rlcore-teacher' (PACK): {len(plan.teacher)} bundles of "
        f"{{CPU: {tc.cpus_per_actor:g}, GPU: {tc.gpus_per_actor:g}}}",
        f"  nodes: {_by_node(plan.teacher)}",
        f"  teacher: {tc.num_actors} x {tc.engine} (tensor_parallel_size={tensor_parallel_size(tc)}) serving "
        f"{tc.path or 'a random-weight model'}; no weight sync; advantage = {tc.reward_coef:g} x reward "
        f"advantage + {tc.kl_coef:g} x (teacher - student logprob{' - batch mean' if tc.kl_baseline else ''})"
        + (f", 0 where |teacher - student| <= {tc.kl_deadband:g}" if tc.kl_deadband else "")
        + ("; the teacher reads the student's text in its own tokens (span-aligned)" if tc.cross_tokenizer else ""),
    ]


def _colocated_lines(cfg: RunConfig, plan: Plan) -> list[str]:
    """The colocated group: bundles, who shares them, and the planned GPU memory."""
    t, r = cfg.trainer, cfg.rollout
    bundle_gpu, share = colocated_shares(cfg)
    lines = [
        "placement: colocated (one trainer rank + one engine per GPU"
        + (", a teacher beside them)" if plan.teacher and plan.teacher[0].gpus else ")"),
        f"placement group 'rlcore-colocated' (PACK): {len(plan.trainer)} bundles of "
        f"{{CPU: {t.cpus_per_rank + r.cpus_per_actor:g}, GPU: {bundle_gpu:g}}}; trainer rank i and rollout "
        f"actor i take GPU {share:g} each of bundle i",
        f"  nodes: {_by_node(plan.trainer)}",
    ]
    mem = trainer_memory(cfg)
    if mem is not None:
        share = memory_share(r)
        gpu = f" of {plan.gpu_bytes / GIB:.1f} GiB" if plan.gpu_bytes else ""
        lines.append(
            f"  memory per GPU{gpu}: trainer peak {mem.peak / GIB:.1f} GiB (resident {mem.resident / GIB:.1f})"
            f", engine gpu_memory_utilization={share if share is not None else 'unset'}, "
            f"sleep_level={sleep_level(r)}"
            + (
                f", teacher gpu_memory_utilization={memory_share(cfg.teacher)}"
                if plan.teacher and plan.teacher[0].gpus
                else ""
            )
        )
    return lines


def _by_node(bundles: list[Bundle]) -> str:
    nodes: dict[int, int] = {}
    for b in bundles:
        nodes[b.node] = nodes.get(b.node, 0) + 1
    return ", ".join(f"node {n}: {k} bundle(s)" if n >= 0 else f"unplaced: {k}" for n, k in sorted(nodes.items()))
