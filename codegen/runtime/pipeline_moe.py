"""MoE layers inside pipeline stages: each runs by its layout over its stage's ``dp`` ranks.

A pipeline program (``codegen.pipeline_emit``) of an MoE model writes each MoE layer of a
stage as one call, ``self.moe_layer(router, x)``, in place of the layer's traced ops. The
call runs the MoE runtime's layer (``codegen.runtime.moe.ExpertParallelMoE``: experts split
over the stage's dp ranks by the plan's placement, tokens moved by two all-to-alls; or
``codegen.runtime.moe_modes.DataParallelMoE``: every expert on every rank) on this rank's
tokens of the micro-batch, so every micro-batch is routed on its own, over the group's tokens
of that micro-batch (its capacity, drops and balance loss are one device's on that
micro-batch; ``launch.py --check`` runs the same micro-batches on one device).

How the layer meets the stage's DTensors (the stage mesh is the ``dp`` axis, or ``dp x tp``
for a folded plan, whose tp ranks each route 1/tp of their dp rank's tokens:
``codegen.runtime.moe_folding.TokensOverTensorParallel``):

- the tokens enter as this rank's rows (``Shard(0)`` over dp) and the output leaves so;
- the router is the stage's own DTensor parameter (replicated), read as its local tensor
  whose gradient is a partial sum over dp (this rank's tokens only): the pipeline reduces it
  once per step with every other data-parallel gradient (``codegen.runtime.pipeline``);
- the balance loss is the group's (its sums are all-reduced with autograd, whose backward
  all-reduces the gradient too, for data-parallel programs whose ranks each back-propagate
  their own loss). Here every rank back-propagates the same loss, so its gradient is divided
  by the group size first;
- expert weights are the layer's own (plain tensors: this rank's experts, or all of them):
  an expert-parallel expert's gradient arrives whole through the all-to-all's backward, a
  copied expert's copies are summed after the schedule, and a data-parallel expert's partial
  gradients are all-reduced over the group then; all of them are divided by the number of
  micro-batches, as the pipeline divides the stage's DTensor gradients.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from codegen.runtime.moe import ExpertParallelMoE, RoutedMoE, scaled_gradient, sum_copied_expert_gradients
from codegen.runtime.moe_folding import TokensOverTensorParallel
from codegen.runtime.moe_modes import DataParallelMoE
from codegen.runtime.pipeline_stacked_experts import StageStackedExperts
from planner.moe_blocks import HF_STACKED_EXPERTS

__all__ = ["StageMoE", "build_stage_experts", "attach_stage_experts", "finish_expert_gradients", "optimizer_with_experts",
           "stage_moe_layers"]

_ROWS = (Shard(0),)  # a batch-first activation split by samples over dp
_WHOLE = (Replicate(),)


class StageMoE(nn.Module):
    """One MoE layer of a pipeline stage (see the module docstring).

    Args:
        layer: the MoE runtime's layer over the stage's dp group, built from the model's weights.
        mesh: the stage mesh (the ``dp`` axis).
        path: the layer's module path in the model.
    """

    def __init__(self, layer: RoutedMoE, mesh: DeviceMesh, path: str) -> None:
        super().__init__()
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim != 1 and names != ("dp", "tp"):
            raise ValueError(f"MoE layers in pipeline stages run over a stage mesh of dp, or dp x tp, not {names}")
        # Folded over dp x tp (codegen.runtime.moe_folding): each tp rank routes 1/tp of the tokens.
        self.tokens_over_tp = TokensOverTensorParallel(mesh["tp"].get_group()) if mesh.ndim == 2 else None
        # The router is the stage's DTensor parameter, passed in each call; the layer keeps
        # a plain copy of its value for its own bookkeeping.
        router = layer.router
        del layer.router
        _set_router(layer, router.detach())
        self.layer, self.mesh, self.path = layer, mesh, path
        self.router_name = layer.names[0]

    def forward(self, router: DTensor, x: DTensor) -> tuple[DTensor, DTensor]:
        """The layer's output (rows split over dp, as ``x``) and its balance loss (the whole
        micro-batch's, the same on every rank)."""
        rows, whole = _ROWS + _WHOLE * (self.mesh.ndim - 1), _WHOLE * self.mesh.ndim
        tokens = x.redistribute(self.mesh, rows).to_local()
        # This rank's tokens only reach the router: a partial sum over every axis of the stage.
        _set_router(self.layer, router.to_local(grad_placements=(Partial(),) * self.mesh.ndim))
        try:
            if self.tokens_over_tp is None:
                output, balance = self.layer(tokens)
            else:
                output, balance = self.tokens_over_tp(self.layer, tokens)
        finally:
            _set_router(self.layer, self.layer.router.detach())
        balance = scaled_gradient(balance, 1.0 / self.mesh.size())
        return (DTensor.from_local(output, self.mesh, rows, run_check=False),
                DTensor.from_local(balance, self.mesh, whole, run_check=False))

    def finish_gradients(self, micro_batches: int) -> None:
        """After the schedule: copies summed, replicated experts' partial gradients
        all-reduced over the group, every expert gradient divided by the micro-batches."""
        layer = self.layer
        if isinstance(layer, ExpertParallelMoE):
            if any(len(copies) > 1 for copies in layer.replicas):
                sum_copied_expert_gradients(layer)
        else:
            for param in layer.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=layer.group)
        for param in layer.parameters():
            if param.grad is not None and micro_batches > 1:
                param.grad.div_(micro_batches)

    def full_experts(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Each expert weight whole, by its qualified name in the model: (value, gradient or
        None). Collective over the group (``launch.py --check``)."""
        router_name = self.layer.names[0]
        return {f"{self.path}.{name}": entry for name, entry in self.layer.full_parameters().items()
                if name != router_name}


def _set_router(layer: RoutedMoE, value: torch.Tensor) -> None:
    # A plain attribute, not a parameter: the local view of the stage's DTensor parameter is
    # not a leaf, which nn.Module would refuse to register.
    object.__setattr__(layer, "router", value)


def build_stage_experts(
    model: nn.Module, stage_mesh: DeviceMesh, layouts: Mapping[str, tuple], stages_here: tuple[int, ...],
) -> dict[str, StageMoE | StageStackedExperts]:
    """The MoE layers of the stages this rank runs (``stages_here``), by module path, from
    ``layouts``: path -> (stage, mode, placement or None, top_k, capacity_factor, parameter
    names relative to the layer: router, expert in, expert out, runtime:
    ``planner.moe_blocks.ROUTED_GELU`` or ``HF_STACKED_EXPERTS``, a HuggingFace block whose
    stacked experts alone are replaced: ``StageStackedExperts``). Built before the stage
    modules free the weights of other stages (``codegen.runtime.pipeline``); every rank of a
    stage builds the same layers in the same order."""
    # The stage's ranks, dp x tp in mesh order when it has tp (a folded plan's experts span them).
    group = stage_mesh.get_group() if stage_mesh.ndim == 1 else stage_mesh._flatten().get_group()
    built = {}
    for path, (stage, mode, placement, top_k, capacity_factor, names, runtime) in sorted(layouts.items()):
        if stage not in stages_here:
            continue
        module = model.get_submodule(path)
        if runtime == HF_STACKED_EXPERTS and mode == "expert_parallel":
            built[path] = StageStackedExperts(module.get_submodule("experts"), placement, top_k, group, stage_mesh, path,
                                              names)
            continue
        router, w_in, w_out = (module.get_parameter(name) for name in names)
        if mode == "expert_parallel":
            layer = ExpertParallelMoE(router, w_in, w_out, placement, top_k, capacity_factor, group, names=tuple(names))
        elif mode == "data_parallel":
            layer = DataParallelMoE(router, w_in, w_out, top_k, capacity_factor, group, names=tuple(names))
        else:
            raise ValueError(f"MoE layer {path!r}: mode {mode!r} does not run inside pipeline stages")
        built[path] = StageMoE(layer, stage_mesh, path)
    return built


def attach_stage_experts(module: nn.Module, layers: Mapping[str, StageMoE | StageStackedExperts],
                         stage_of: Mapping[str, int], model: nn.Module | None = None) -> None:
    """Give each stage module of this rank (``module.local_stages``) its MoE layers: they
    become its submodules (so its ``parameters()``, and the optimizer, cover their experts),
    found by the router DTensor each call passes (``moe_layer``). With ``model`` (after
    ``build_stage``, which frees the weights no stage op reads), each layer also becomes the
    ``stage_experts`` submodule of its MoE block in the model, so the model names its expert
    parts by the parameters they derive from (``materialize.name_derived_sources``), as
    ``--clip-grad-norm`` and checkpoints read them."""
    for stage in module.local_stages:
        mine = {path: layer for path, layer in layers.items() if stage_of[path] == stage.index}
        stage.stage_experts = nn.ModuleDict({path.replace(".", "__"): layer for path, layer in mine.items()})
        stage.experts_by_router = {
            id(stage.params[f"{path}.{layer.router_name}"]): layer for path, layer in mine.items()
        }
    if model is not None:
        for path, layer in layers.items():
            model.get_submodule(path).add_module("stage_experts", layer)


def finish_expert_gradients(module: nn.Module, micro_batches: int) -> None:
    """``StageMoE.finish_gradients`` for every MoE layer of this rank's stages."""
    for stage in module.local_stages:
        for layer in getattr(stage, "stage_experts", {}).values():
            layer.finish_gradients(micro_batches)


def stage_moe_layers(module: nn.Module) -> list[StageMoE | StageStackedExperts]:
    """The MoE layers of this rank's stages, in path order (each rank of a stage alike)."""
    layers = [layer for stage in module.local_stages for layer in getattr(stage, "stage_experts", {}).values()]
    return sorted(layers, key=lambda layer: layer.path)


def optimizer_with_experts(module: nn.Module, optimizer_class: type, **kwargs) -> torch.optim.Optimizer:
    """``optimizer_class`` over ``module``'s parameters, the MoE layers' expert weights (plain
    tensors) in a parameter group of their own: an optimizer's fused and foreach paths run
    each group's tensors together, and DTensors do not mix with plain tensors there."""
    experts = [param for layer in stage_moe_layers(module) for param in layer.parameters()]
    held = {id(param) for param in experts}
    dense = [param for param in module.parameters() if id(param) not in held]
    groups = [group for group in ({"params": dense}, {"params": experts}) if group["params"]]
    return optimizer_class(groups, **kwargs)
