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
the weights before forward and backward: less memory than Megatron-Core holds, one more
gather, and a reduce-scatter after every micro-batch (FSDP2's, where the distributed
optimizer reduces once a step); without copies (``ep == dp``) nothing changes. Its token dispatcher ``alltoall`` exchanges each
micro-batch's tokens with one all-to-all before the experts and one after (a flat exchange).
Micro-batches of ``micro_batch_size`` samples per rank accumulate gradients, each routed on
its own.

``grid_configs`` lists the configurations; ``grid_plan`` builds one, ``grid_results`` all
of them with pruning (``MegatronGrid``). Three builders:

- EP folded over DP (``pp = tp = etp = 1``): the MoE family's dense part with every layer
  expert parallel over copy groups (``ExpertPlacement.copied_grid``). One difference
  remains: Megatron-Core sends a token only inside its rank's EP group, whereas the
  planner's expert-parallel layer splits each expert's tokens among all its copies
  (``cost_model.moe``), so the same bytes leave each rank but their destinations (and so the
  share crossing nodes) differ.
- Pipelines (``pp > 1``, ``tp = etp = 1``): the plan builder of the search's MoE pipeline grid
  (``search.pipeline_search.PipelineGrid``: its stage slicing, Megatron's even split or the
  uneven one Megatron-Core sets with ``--decoder-first/last-pipeline-num-layers``, whichever
  is faster) with the configuration's mesh ``pp x dp``, schedule (1F1B, or interleaved with
  ``vpp`` virtual stages), micro-batches, ZeRO-1 and recomputation, and every MoE layer
  expert parallel over its stage's dp ranks folded as above. Inside a pipeline the planner
  keeps every copy of an expert whole (its states are not sharded over the copies as the
  distributed optimizer shards them): more memory than Megatron-Core holds when EP < DP.
- Tensor parallelism (``tp > 1``, ETP 1 or ``tp``): the folded MoE family's builder
  (``search.moe_folding.folded_plan``: Megatron's layout of the dense ops on ``tp``, every MoE
  layer expert parallel over the folded ``dp*tp`` ranks with EP round-robin, ETP inside each
  tensor-parallel group, ``dp*tp / (ep*etp)`` copies of each expert) with ZeRO-1,
  recomputation and the configuration's micro-batches (accumulated without a pipeline; a
  pipeline on Megatron's even split runs them 1F1B). It has no interleaved schedule: those
  configurations (VPP > 1 with TP) are refused in one line. Outside the grid,
  ``tensor_parallel_pipeline_plan`` builds any of them on a split the caller gives (Megatron-
  Core's with the embedding and the loss counted as layers: ``account_split``) through the
  pipeline builder, its stages' experts folded over ``dp x tp``; ``benchmarks/fidelity.py``'s
  MoE rows use it (the grid would need a slicing of its own to try them).

Pruning (as the pipeline search prunes, ``search.pipeline_search``): a pipeline whose memory
lower bound exceeds the device is refused without slicing; the others are visited by their
step-time lower bound, and once that bound reaches the best simulated step that fits, the
rest cannot beat it and are not built (``PRUNED``). A tensor-parallel configuration is
pruned when its weights, gradients and ZeRO-1 states alone overflow the average device
(``MegatronGrid.folded_memory_lower_bound``), and those of the same degrees by dominance:
when the one holding least (full recomputation, the fewest samples per micro-batch) does
not fit, none of them does; when one without recomputation fits, the same with full
recomputation only adds time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from cost_model.parameter_bytes import bytes_per_parameter
from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.families.moe_folding.section import JSON_KEY as FOLDING_KEY, MoeFoldingSection
from planner.graph import OpGraph
from planner.plans import Plan
from planner.routing import RoutingStats
from planner.strategy import DUALPIPE, ExpertLayout, ExpertPlacement, Mesh
from search.moe_search import moe_base_plan
from search.moe_folding import dense_strategies, folded_layouts, folded_plan, with_stage_layouts
from search.pipeline_configs import Configuration, Estimate, PipelineSpace
from search.pipeline_search import PipelineGrid


@dataclass(frozen=True)
class MegatronMoEConfig:
    """One Megatron-Core MoE configuration: degrees of tensor (``tp``), expert (``ep``),
    expert-tensor (``etp``), pipeline (``pp``, ``vpp`` virtual stages each) and data
    (``dp``) parallelism, recomputation (``"none"``/``"full"``) and samples per micro-batch
    per data-parallel rank. ``dualpipe``: the pipeline runs DeepSeek's DualPipe, not 1F1B (no
    Megatron-Core schedule, so never in ``grid_configs``: the frontier benchmark prices
    DeepSeek-V3's published layout with it)."""

    tp: int
    ep: int
    etp: int
    pp: int
    vpp: int
    dp: int
    recompute: str
    micro_batch_size: int
    dualpipe: bool = False

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"EP{self.ep}", f"ETP{self.etp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.dualpipe:
            parts.append("DualPipe")
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



PRUNED = "pruned"  # GridResult.missing's first word for a configuration the bounds ruled out


def _folded_expert_layouts(graph: OpGraph, ep: int, dp: int, shard_copies: bool) -> tuple[ExpertLayout, ...]:
    layouts = []
    placements: dict[int, ExpertPlacement] = {}  # by expert count: one placement for DeepSeek-V3's 58 layers
    for block in graph.moe_blocks:
        if block.experts not in placements:
            placements[block.experts] = (ExpertPlacement.round_robin(block.experts, dp) if ep == dp
                                         else ExpertPlacement.copied_grid(block.experts, dp, block.experts // ep))
        placement = placements[block.experts]
        layouts.append(ExpertLayout(module=block.module, mode="expert_parallel", experts=block.experts,
                                    top_k=block.top_k, capacity_factor=block.capacity_factor, axis="dp",
                                    placement=placement, sharded_copies=shard_copies and ep < dp))
    return tuple(layouts)


def ep_over_dp_layouts(graph: OpGraph, ep: int, dp: int) -> tuple[ExpertLayout, ...]:
    """Every MoE layer expert parallel as Megatron-Core folds it over ``dp`` ranks: groups of
    ``ep`` ranks each holding ``experts / ep`` experts, each expert copied ``dp / ep`` times
    and sharded over its copies (the distributed optimizer's expert-data-parallel states;
    module docstring), or round-robin when ``ep == dp``; a flat all-to-all."""
    return _folded_expert_layouts(graph, ep, dp, shard_copies=True)


def _ep_variant(ep: int) -> str:
    return f"megatron-ep{ep}"


class MegatronGrid:
    """Builds the grid's configurations of one model on one cluster (module docstring),
    sharing the pipeline builder's segment simulations between them."""

    def __init__(self, graph: OpGraph, cluster: Cluster, spec, model_name: str, precision: str = "bf16"):
        self.graph, self.cluster, self.spec, self.model_name, self.precision = graph, cluster, spec, model_name, precision
        self._base: Plan | PlanningError | None = None
        self._pipelines: PipelineGrid | None = None
        # Megatron's layout of the dense ops per folded mesh: the same for every EP, ETP,
        # recomputation and micro-batch size on it (it was half the grid's time, built per plan).
        self._dense: dict[Mesh, tuple | PlanningError] = {}

    # ----------------------------------------------------------- EP over DP

    def flat_plan(self, config: MegatronMoEConfig) -> GridResult:
        """A configuration without TP or PP: the MoE family's dense part, ZeRO-1, EP folded
        over DP, ``micro_batch_size`` samples per accumulated micro-batch; simulated."""
        if self._base is None:
            try:
                self._base = moe_base_plan(self.graph, self.cluster, self.spec, self.model_name,
                                           precision=self.precision)
            except PlanningError as error:
                self._base = error
        if isinstance(self._base, PlanningError):
            return GridResult(config, None, str(self._base))
        steps = self.graph.batch_size // (config.dp * config.micro_batch_size)
        plan = dataclasses.replace(self._base, dp_flavour="zero1", recompute=config.recompute,
                                   accumulation_steps=steps, label="megatron-moe",
                                   expert_layouts=ep_over_dp_layouts(self.graph, config.ep, config.dp))
        return GridResult(config, simulated(plan, self.graph))

    # ------------------------------------------------------------ pipelines

    @property
    def pipelines(self) -> PipelineGrid:
        """The search's pipeline builder, its MoE layers laid out as each configuration's EP
        (``pipeline_configuration``'s variant) and nothing else searched."""
        if self._pipelines is None:
            def layouts(mesh: Mesh, micro_batches: int) -> dict[str, tuple[ExpertLayout, ...]]:
                dp = mesh.axis_size("dp") if "dp" in mesh.names else 1
                return {_ep_variant(ep): _folded_expert_layouts(self.graph, ep, dp, shard_copies=False)
                        for ep in range(1, dp + 1) if dp % ep == 0 and self._divides_experts(ep)}
            space = PipelineSpace(expert_layouts=layouts, searched_layout="off", dualpipe=False)
            self._pipelines = PipelineGrid(self.graph, self.cluster, self.precision, space)
        return self._pipelines

    def _divides_experts(self, ep: int) -> bool:
        return all(block.experts % ep == 0 for block in self.graph.moe_blocks)

    def pipeline_configuration(self, config: MegatronMoEConfig) -> Configuration:
        """``config`` as a point of the pipeline builder's grid: mesh ``pp x dp``, ZeRO-1,
        1F1B or interleaved over ``vpp`` virtual stages, the configuration's EP."""
        micro_batches = self.graph.batch_size // (config.dp * config.micro_batch_size)
        schedule = DUALPIPE if config.dualpipe else "interleaved" if config.vpp > 1 else "1f1b"
        return Configuration(tp=1, pp=config.pp, dp=config.dp, micro_batch=config.micro_batch_size,
                             micro_batches=micro_batches, schedule=schedule, virtual_stages=config.vpp,
                             flavour="zero1" if config.dp > 1 else "ddp", recompute=config.recompute,
                             experts=_ep_variant(config.ep) if config.dp > 1 else "")

    def pipeline_bounds(self, config: MegatronMoEConfig) -> tuple[float, float] | None:
        """The pipeline's (step-time, memory) lower bounds; None when the model does not split
        into its stages."""
        return self.pipelines.lower_bounds(self.pipeline_configuration(config))

    def pipeline_plan(self, config: MegatronMoEConfig) -> GridResult:
        """A pipeline configuration sliced, built and simulated by the pipeline builder, or
        why it is refused."""
        estimate = self.pipelines.estimate(self.pipeline_configuration(config))
        if estimate is None:
            return GridResult(config, None, f"no split of the model into {config.pp * config.vpp} stages fits "
                                            f"a device's {self.cluster.min_device_memory / 2**30:.0f} GiB")
        try:
            plan = self.pipelines.plan(estimate, self.spec, self.model_name)
        except PlanningError as error:  # the slicing's stages cannot be laid out (its one line)
            return GridResult(config, None, str(error))
        return GridResult(config, dataclasses.replace(plan, label="megatron-moe"))

    # ------------------------------------------------------------- one, all

    def build(self, config: MegatronMoEConfig, constrained: Callable[[MegatronMoEConfig], Plan | None] | None = None
              ) -> GridResult:
        """``config`` as a simulated plan, or why it is not built (module docstring)."""
        if config.dualpipe:
            micro_batches = self.graph.batch_size // (config.dp * config.micro_batch_size)
            if config.tp > 1 or config.etp > 1 or config.vpp > 1 or config.pp % 2 or micro_batches % 2 \
                    or micro_batches < 2 * config.pp:
                return GridResult(config, None, "DualPipe is built on an even pipeline without TP, ETP or VPP, "
                                                "over an even number of micro-batches, at least twice the stages")
        if config.tp == config.etp == 1:
            if config.pp == 1:
                return self.flat_plan(config)
            if self.pipeline_bounds(config) is None:
                return GridResult(config, None, f"the model does not split into {config.pp * config.vpp} stages "
                                                "(fewer repeated blocks than stages)")
            return self.pipeline_plan(config)
        if config.vpp == 1:
            return self.folded(config)
        if constrained is None:
            return GridResult(config, None, INTERLEAVED_TP_MISSING)
        plan = constrained(config)
        sizes = {"tp": config.tp, "pp": config.pp, "dp": config.dp}
        if plan is None or not plan.expert_layouts or any(
                (plan.mesh.axis_size(axis) if axis in plan.mesh.names else 1) != size for axis, size in sizes.items()):
            return GridResult(config, None, f"{INTERLEAVED_TP_MISSING}; the constrained search gave no such plan")
        return GridResult(config, plan)

    # ------------------------------------------------------ tensor parallel

    def folded(self, config: MegatronMoEConfig) -> GridResult:
        """A configuration with TP (1F1B or no pipeline) built by the folded MoE builder with
        ZeRO-1, recomputation and accumulated micro-batches; simulated."""
        micro_batches = self.graph.batch_size // (config.dp * config.micro_batch_size)
        # The folded layouts run over the dp axis, kept even at size 1 (EP then folds over tp alone).
        mesh = Mesh(tuple((name, size) for name, size in (("pp", config.pp), ("dp", config.dp), ("tp", config.tp))
                          if size > 1 or name == "dp"))
        if mesh not in self._dense:
            try:
                self._dense[mesh] = dense_strategies(self.graph, mesh, sequence_parallel=False)
            except PlanningError as error:
                self._dense[mesh] = error
        try:
            if isinstance(self._dense[mesh], PlanningError):
                raise self._dense[mesh]
            plan = folded_plan(self.graph, self.cluster, self.spec, self.model_name, mesh, config.ep, config.etp,
                               precision=self.precision, micro_batches=micro_batches if config.pp > 1 else 1,
                               dp_flavour="zero1" if config.dp > 1 else "ddp", recompute=config.recompute,
                               accumulation_steps=1 if config.pp > 1 else micro_batches, dense=self._dense[mesh])
        except (PlanningError, ValueError) as error:  # Megatron's layout or the folding refuses it
            return GridResult(config, None, str(error))
        return GridResult(config, dataclasses.replace(plan, label="megatron-moe"))

    def folded_memory_lower_bound(self, config: MegatronMoEConfig) -> float:
        """Bytes on the average device of a folded configuration, weights, gradients and
        ZeRO-1's states only: the dense parameters split over ``tp x pp`` at best (Megatron's
        layout keeps norms and routers whole), the experts over ``ep x etp x pp``, the states
        sharded over the dp ranks (the experts' over their copies). The fullest device holds
        at least this."""
        weights, grads, states = bytes_per_parameter(self.precision)
        experts = sum(block.expert_parameters for block in self.graph.moe_blocks)
        dense = max(0, self.graph.parameter_count - experts) / (config.tp * config.pp)
        expert_share = experts / (config.ep * config.etp * config.pp)
        copies = max(1, config.dp * config.tp // (config.ep * config.etp))
        return (dense + expert_share) * (weights + grads) + states * (dense / config.dp + expert_share / copies)

    def folded_results(self, configs: list[MegatronMoEConfig]) -> dict[MegatronMoEConfig, GridResult]:
        """``folded`` of every configuration, pruned by dominance (module docstring)."""
        done: dict[MegatronMoEConfig, GridResult] = {}
        groups: dict[tuple, list[MegatronMoEConfig]] = {}
        for config in configs:
            groups.setdefault(dataclasses.replace(config, recompute="", micro_batch_size=0), []).append(config)
        for members in groups.values():
            if self.folded_memory_lower_bound(members[0]) > self.cluster.min_device_memory:
                for config in members:
                    done[config] = GridResult(config, None, f"{PRUNED}: its memory lower bound exceeds a device")
                continue
            leanest = min(members, key=lambda c: (c.micro_batch_size, c.recompute != "full"))
            done[leanest] = self.folded(leanest)
            plan = done[leanest].plan
            if plan is None:  # refused for its degrees, whatever the micro-batches and recomputation
                for config in members:
                    done.setdefault(config, GridResult(config, None, done[leanest].missing))
                continue
            if not plan.estimate.fits:
                for config in members:
                    done.setdefault(config, GridResult(config, None, f"{PRUNED}: the same degrees holding least "
                                                                     "(full recomputation, the fewest samples per "
                                                                     "micro-batch) do not fit"))
                continue
            for config in sorted(members, key=lambda c: (c.micro_batch_size, c.recompute != "none")):
                if config in done:
                    continue
                lighter = dataclasses.replace(config, recompute="none")
                if config.recompute == "full" and lighter in done and done[lighter].plan is not None \
                        and done[lighter].plan.estimate.fits:
                    done[config] = GridResult(config, None, f"{PRUNED}: the same without recomputation fits")
                    continue
                done[config] = self.folded(config)
        return done

    def results(self, configs: list[MegatronMoEConfig], constrained=None) -> list[GridResult]:
        """Every configuration of ``configs`` built, refused or pruned (module docstring), in
        the order given."""
        done: dict[MegatronMoEConfig, GridResult] = {}
        pipelines, folded = [], []
        for config in configs:
            if config.pp > 1 and config.tp == config.etp == 1:
                pipelines.append(config)
            elif config.tp == config.etp == 1 or config.vpp > 1:
                done[config] = self.build(config, constrained)
            else:
                folded.append(config)
        done.update(self.folded_results(folded))
        best = best_of(list(done.values()))
        bounded = []
        for config in pipelines:
            bounds = self.pipeline_bounds(config)
            if bounds is None:
                done[config] = self.build(config)
            elif bounds[1] > self.cluster.min_device_memory:
                done[config] = GridResult(config, None, f"{PRUNED}: its memory lower bound exceeds a device")
            else:
                bounded.append((bounds[0], configs.index(config), config))
        for bound, _, config in sorted(bounded):
            if best is not None and bound >= best.plan.estimate.step_time_s:
                done[config] = GridResult(config, None, f"{PRUNED}: its step-time lower bound cannot beat "
                                                        "the best found")
                continue
            done[config] = self.pipeline_plan(config)
            best = best_of([result for result in (best, done[config]) if result is not None])
        return [done[config] for config in configs]


INTERLEAVED_TP_MISSING = ("needs an interleaved pipeline with TP beside experts: the folded MoE builder "
                          "(search.moe_folding.folded_plan) runs 1F1B only")


def grid_plan(config: MegatronMoEConfig, graph: OpGraph, cluster: Cluster, spec, model_name: str,
              precision: str = "bf16", constrained: Callable[[MegatronMoEConfig], Plan | None] | None = None) -> GridResult:
    """``config`` as a simulated plan, or why there is none (module docstring). ``constrained``
    plans an interleaved configuration with tensor parallelism through the planner's search
    under its mesh (None: such configurations are reported as missing); its plan counts only when its
    MoE layers have layouts and its mesh has the configuration's degrees."""
    return MegatronGrid(graph, cluster, spec, model_name, precision).build(config, constrained)


def grid_results(graph: OpGraph, cluster: Cluster, spec, model_name: str, precision: str = "bf16",
                 constrained=None, configs: list[MegatronMoEConfig] | None = None) -> list[GridResult]:
    """Every configuration of ``grid_configs`` (or of ``configs``) built, refused or pruned
    (``MegatronGrid.results``)."""
    grid = MegatronGrid(graph, cluster, spec, model_name, precision)
    return grid.results(configs if configs is not None else grid_configs(graph, cluster), constrained)


def best_of(results: list[GridResult]) -> GridResult | None:
    """The fastest configuration whose plan fits, or None."""
    fitting = [r for r in results if r.plan is not None and r.plan.estimate.fits]
    return min(fitting, key=lambda r: r.plan.estimate.step_time_s, default=None)


def account_split(blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per (virtual) stage, in model order, as Megatron-Core splits them with
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``
    (megatron/core/transformer/transformer_block.py ``get_num_layers_to_build``): the embedding
    and the loss each take one layer's slot, so ``blocks + 2`` slots split evenly, the first
    stage's one slot being the embedding and the last's the loss.

    Raises:
        PlanningError: ``blocks + 2`` does not split evenly over ``stages`` (Megatron-Core
            refuses such a layout too).
    """
    if stages < 2 or (blocks + 2) % stages:
        raise PlanningError(f"{blocks} layers plus the embedding and the loss do not split evenly over {stages} "
                            "pipeline stages; choose a stage count that divides the layers + 2")
    per_stage = [(blocks + 2) // stages] * stages
    per_stage[0] -= 1
    per_stage[-1] -= 1
    return tuple(per_stage)


def tensor_parallel_pipeline_plan(graph: OpGraph, cluster: Cluster, spec, model_name: str, config: MegatronMoEConfig,
                                  layers_per_stage: tuple[int, ...], *, all_to_all: str = "flat",
                                  precision: str = "bf16") -> Plan:
    """``config`` with tensor parallelism inside a pipeline, 1F1B or interleaved over
    ``config.vpp`` virtual stages (which ``MegatronGrid.build`` refuses), its (virtual) stages
    holding ``layers_per_stage`` blocks each in model order (``account_split`` for
    Megatron-Core's split): built by the search's pipeline builder (``PipelineGrid``) with
    Megatron's layout of the dense ops, sequence parallelism, ZeRO-1, and every MoE layer
    folded over its stage's ``dp x tp`` ranks with EP ``config.ep`` and ETP ``config.etp``
    (``search.moe_folding.folded_layouts``, their all-to-alls ``all_to_all``); simulated.
    The stage slicing is the caller's, not searched, and memory does not refuse it: the
    plan's estimate says whether it fits.

    Raises:
        PlanningError: Megatron's layout does not split the model over ``config.tp``, or the
            counts do not fit the stages (``search.layouts.uneven_stages``).
    """
    if config.tp < 2 or config.pp < 2:
        raise PlanningError("this builder lays out tensor parallelism inside a pipeline (TP and PP of at least 2); "
                            "use MegatronGrid.build for the others")
    micro_batches = graph.batch_size // (config.dp * config.micro_batch_size)
    layouts = tuple(dataclasses.replace(layout, all_to_all=all_to_all)
                    for layout in folded_layouts(graph, RoutingStats(), config.ep, config.etp))
    variant = f"{_ep_variant(config.ep)}-etp{config.etp}"
    space = PipelineSpace(micro_batch_sizes=(config.micro_batch_size,), virtual_stages=(config.vpp,),
                          flavours=("zero1",), per_stage_recompute=False, sequence_parallel=(True,),
                          searched_layout="off", tensor_parallel=(config.tp,), lay_out_experts=with_stage_layouts,
                          expert_layouts=lambda mesh, count: {variant: layouts})
    grid = PipelineGrid(graph, cluster, precision, space)
    schedule = "interleaved" if config.vpp > 1 else "1f1b"
    configuration = Configuration(tp=config.tp, pp=config.pp, dp=config.dp, micro_batch=config.micro_batch_size,
                                  micro_batches=micro_batches, schedule=schedule, virtual_stages=config.vpp,
                                  flavour="zero1" if config.dp > 1 else "ddp", recompute=config.recompute,
                                  sequence_parallel=True, experts=variant)
    # Only the slicing and the configuration of an estimate build the plan; it is simulated next.
    plan = grid.unsimulated(Estimate(0.0, configuration, tuple(layers_per_stage), 0.0), spec, model_name)
    # The stages' folding is sequence parallel as their dense ops are (Megatron-Core requires
    # --sequence-parallel for MoE layers beside TP): each tp rank routes its own tokens.
    sections = {**plan.sections, FOLDING_KEY: MoeFoldingSection(True)}
    return simulated(dataclasses.replace(plan, label="megatron-moe", sections=sections), graph)
