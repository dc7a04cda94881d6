"""Megatron-Core MoE configurations as plans: a hand-written grid of the layouts a team
running Megatron-Core would try (TP, EP, ETP, PP, VPP, DP, recomputation, micro-batch size),
each simulated on the cluster, so a searched plan can be compared with the best of them
(``benchmarks/moe_frontier.py``).

Megatron-Core folds expert parallelism over the data-parallel ranks ("MoE parallel folding",
``--expert-model-parallel-size``): with ``ep`` ranks per expert-parallel group each rank
holds ``experts / ep`` experts, and each expert has ``dp / ep`` copies, one per group,
whose gradients are reduced over the expert-data-parallel group; the distributed optimizer
(``--use-distributed-optimizer``) shards the optimizer states over the data-parallel ranks
(ZeRO-1, ``dp_flavour="zero1"``), the experts' over their expert-data-parallel group. The
nearest the planner has for the latter is each expert sharded over its copies
(``ExpertLayout.sharded_copies``), which shards its weights and gradients too and gathers
the weights before forward and backward: less memory than Megatron-Core holds and one more
gather; without copies (``ep == dp``) nothing changes. Its token dispatcher ``alltoall`` exchanges each
micro-batch's tokens with one all-to-all before the experts and one after (a flat exchange).
Micro-batches of ``micro_batch_size`` samples per rank accumulate gradients, each routed on
its own.

``grid_configs`` lists the configurations; ``grid_plan`` builds one. The planner builds
today the configurations without tensor or pipeline parallelism around HF MoE blocks (EP
folded over DP, ``pp = tp = etp = 1``) directly: the MoE family's dense part with every
layer expert parallel over copy groups (``ExpertPlacement.copied_grid``). One difference
remains: Megatron-Core sends a token only inside its rank's EP group, whereas the planner's
expert-parallel layer splits each expert's tokens among all its copies
(``cost_model.moe``), so the same bytes leave each rank but their destinations (and so
the share crossing nodes) differ. The others need
the planner's search under a fixed mesh (``--mesh pp=.. tp=..``) to return a plan whose MoE
layers have layouts; ``grid_plan`` tries that when asked (``constrained``) and otherwise
says what is missing, so the grid picks them up once the planner makes such plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import ExpertLayout, ExpertPlacement
from search.moe_search import moe_base_plan


@dataclass(frozen=True)
class MegatronMoEConfig:
    """One Megatron-Core MoE configuration: degrees of tensor (``tp``), expert (``ep``),
    expert-tensor (``etp``), pipeline (``pp``, ``vpp`` virtual stages each) and data
    (``dp``) parallelism, recomputation (``"none"``/``"full"``) and samples per micro-batch
    per data-parallel rank."""

    tp: int
    ep: int
    etp: int
    pp: int
    vpp: int
    dp: int
    recompute: str
    micro_batch_size: int

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"EP{self.ep}", f"ETP{self.etp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        parts += [f"DP{self.dp}", f"mbs{self.micro_batch_size}", f"recompute {self.recompute}"]
        return " ".join(parts)


@dataclass(frozen=True)
class GridResult:
    """A configuration and its simulated plan, or why there is none (``missing``)."""

    config: MegatronMoEConfig
    plan: Plan | None
    missing: str = ""


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def grid_configs(graph: OpGraph, cluster: Cluster, *, max_tp: int | None = None, max_pp: int = 16) -> list[MegatronMoEConfig]:
    """The grid for ``graph`` on ``cluster``: TP (and ETP) 1 .. devices per node, PP 1 ..
    ``max_pp`` (VPP 1, or 2 when each stage keeps at least 2 blocks), EP every power of two
    that divides the experts and the data-parallel ranks (at least 8 experts' worth of
    groups where possible, as Megatron-Core's MoE recipes run), recomputation none or full,
    1, 2 or 4 samples per micro-batch; every configuration whose degrees multiply to the
    devices and whose micro-batches split the batch."""
    if not graph.moe_blocks:
        raise PlanningError("the model has no Mixture-of-Experts layer this planner recognises (planner.moe_blocks)")
    world = cluster.world_size
    experts = min(block.experts for block in graph.moe_blocks)
    blocks = sum(graph.blocks.values()) or 1
    node = cluster.devices_per_node if cluster.is_homogeneous else 1
    configs = []
    for tp in _powers_of_two(max_tp or node):
        for pp in _powers_of_two(min(max_pp, blocks)):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            for vpp in (1, 2) if pp > 1 and blocks >= 2 * 2 * pp else (1,):
                for etp in sorted({1, tp}):
                    for ep in _powers_of_two(min(experts, dp * tp // etp)):
                        # Megatron-Core folds EP x ETP over DP x TP: their product divides it.
                        if experts % ep or (dp * tp) % (ep * etp):
                            continue
                        for recompute in ("none", "full"):
                            for size in (1, 2, 4):
                                if graph.batch_size % (dp * size):
                                    continue
                                micro_batches = graph.batch_size // (dp * size)
                                if pp > 1 and micro_batches < pp:
                                    continue  # 1F1B needs a micro-batch per stage in flight
                                if vpp > 1 and micro_batches % pp:
                                    continue  # Megatron's interleaved schedule
                                configs.append(MegatronMoEConfig(tp, ep, etp, pp, vpp, dp, recompute, size))
    return configs


def ep_over_dp_layouts(graph: OpGraph, ep: int, dp: int) -> tuple[ExpertLayout, ...]:
    """Every MoE layer expert parallel as Megatron-Core folds it over ``dp`` ranks: groups of
    ``ep`` ranks each holding ``experts / ep`` experts, each expert copied ``dp / ep`` times
    and sharded over its copies (the distributed optimizer's expert-data-parallel states;
    module docstring), or round-robin when ``ep == dp``; a flat all-to-all."""
    layouts = []
    for block in graph.moe_blocks:
        if ep == dp:
            placement = ExpertPlacement.round_robin(block.experts, dp)
        else:
            placement = ExpertPlacement.copied_grid(block.experts, dp, block.experts // ep)
        layouts.append(ExpertLayout(module=block.module, mode="expert_parallel", experts=block.experts,
                                    top_k=block.top_k, capacity_factor=block.capacity_factor, axis="dp",
                                    placement=placement, sharded_copies=ep < dp))
    return tuple(layouts)


def grid_plan(config: MegatronMoEConfig, graph: OpGraph, cluster: Cluster, spec, model_name: str,
              precision: str = "bf16", constrained: Callable[[MegatronMoEConfig], Plan | None] | None = None) -> GridResult:
    """``config`` as a simulated plan (module docstring). ``constrained`` plans a
    configuration with tensor or pipeline parallelism through the planner's search under
    its mesh (None: such configurations are reported as missing); its plan counts only when
    its MoE layers have layouts and its mesh has the configuration's degrees."""
    if config.tp == config.pp == config.etp == 1:
        try:
            base = moe_base_plan(graph, cluster, spec, model_name, precision=precision)
        except PlanningError as error:
            return GridResult(config, None, str(error))
        steps = graph.batch_size // (config.dp * config.micro_batch_size)
        plan = dataclasses.replace(base, dp_flavour="zero1", recompute=config.recompute, accumulation_steps=steps,
                                   expert_layouts=ep_over_dp_layouts(graph, config.ep, config.dp), label="megatron-moe")
        return GridResult(config, simulated(plan, graph))
    needs = "tensor parallelism beside experts (branch moefold)" if config.tp > 1 or config.etp > 1 else \
        "HF MoE blocks inside pipeline stages (branch moeplan)"
    if constrained is None:
        return GridResult(config, None, f"needs {needs}")
    plan = constrained(config)
    sizes = {"tp": config.tp, "pp": config.pp, "dp": config.dp}
    if plan is None or not plan.expert_layouts or any(
            (plan.mesh.axis_size(axis) if axis in plan.mesh.names else 1) != size for axis, size in sizes.items()):
        return GridResult(config, None, f"needs {needs}: the constrained search gave no such plan")
    return GridResult(config, plan)


def grid_results(graph: OpGraph, cluster: Cluster, spec, model_name: str, precision: str = "bf16",
                 constrained=None, configs: list[MegatronMoEConfig] | None = None) -> Iterator[GridResult]:
    """``grid_plan`` of every configuration of ``grid_configs`` (or of ``configs``)."""
    for config in configs if configs is not None else grid_configs(graph, cluster):
        yield grid_plan(config, graph, cluster, spec, model_name, precision, constrained)


def best_of(results: list[GridResult]) -> GridResult | None:
    """The fastest configuration whose plan fits, or None."""
    fitting = [r for r in results if r.plan is not None and r.plan.estimate.fits]
    return min(fitting, key=lambda r: r.plan.estimate.step_time_s, default=None)
