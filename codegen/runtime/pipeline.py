"""What a pipeline program imports: stage modules, the stage mesh, and one training step
through a ``torch.distributed.pipelining`` schedule.

A pipeline program (``codegen.pipeline_emit``) cuts the model's traced graph into the plan's
stages. Stage ``s`` runs on the ranks whose ``pp`` coordinate is ``s``; inside a stage, every
op runs on DTensors over the stage mesh (the plan's other axes, ``dp`` and/or ``tp``), exactly
as in a graph program (``codegen.runtime.spmd``). Values cross stages as this rank's local
tensors: the sending stage lays a value out as the boundary says and sends its local part
(``send``), the receiving stage wraps it again with the same placements (``receive``); the
gradients travel back the same way. Torch's ``PipelineStage`` moves them (point-to-point over
the ``pp`` group of ranks that share a dp/tp coordinate) and ``ScheduleGPipe`` /
``Schedule1F1B`` order the micro-batches.

The model's own loss is what the schedule back-propagates: the last stage returns it (the
full value on every rank of the stage) and the schedule's ``loss_fn`` returns it unchanged.
Each micro-batch's loss is a mean over its samples, and the summed gradients are divided by
the number of micro-batches once the whole backward is done (each parameter once, even one
that two virtual stages of a rank share), so the step equals one device's step on the whole
batch (equal micro-batches; a mean-reduced loss). Gradients keep the placements backward
gives them (partial sums over ``dp``) through the schedule and are reduced once, after it:
one all-reduce per parameter and step, as Megatron-LM does and the plan prices it.

Parameters read by more than one stage (tied embeddings: the token embedding on the first
stage, the output head on the last) are held by each of those stages; after backward their
gradients are summed over those stages, so every copy takes the same optimizer step.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from codegen.runtime.pipeline_moe import finish_expert_gradients
from codegen.runtime.spmd import Placements, SpmdModule, keep_placements, replicate_partials, same_placements

PP_AXIS = "pp"
_STAGE_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}

__all__ = ["PipelineStageModule", "PipelineRunner", "VirtualStages", "build_stage", "rank_stages", "stage_mesh", "stage_index"]


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh a stage's DTensors live on: ``mesh`` without its ``pp`` axis (the ranks of
    this rank's stage that share its pipeline position). A mesh with ``pp`` alone gets a
    one-rank ``dp`` axis, so stages still run on DTensors (each rank whole). Built once per
    mesh (all ranks call this alike: it may create process groups)."""
    cached = _STAGE_MESHES.get(id(mesh))
    if cached is not None and cached[0] is mesh:
        return cached[1]
    names = tuple(mesh.mesh_dim_names or ())
    if PP_AXIS not in names:
        raise ValueError(f"a pipeline program needs a '{PP_AXIS}' mesh axis; this mesh has {names}")
    others = tuple(name for name in names if name != PP_AXIS)
    if not others:
        size = mesh.size(names.index(PP_AXIS))
        sub = init_device_mesh(mesh.device_type, (size, 1), mesh_dim_names=(PP_AXIS, "dp"))["dp"]
    else:
        sub = mesh[others[0]] if len(others) == 1 else mesh[others]
    _STAGE_MESHES[id(mesh)] = (mesh, sub)
    return sub


def stage_index(mesh: DeviceMesh) -> int:
    """This rank's pipeline stage: its coordinate on ``pp``."""
    return mesh.get_local_rank(PP_AXIS)


def rank_stages(mesh: DeviceMesh, num_stages: int) -> tuple[int, ...]:
    """The stages this rank runs: its pp coordinate, and under the interleaved schedule every
    ``pp``-th stage after it (as ``build_stage`` builds them)."""
    pp = mesh.size(mesh.mesh_dim_names.index(PP_AXIS))
    return tuple(range(stage_index(mesh), num_stages, pp))


class PipelineStageModule(SpmdModule):
    """One pipeline stage of a graph program on this rank: the weights this stage reads, as
    DTensors over the stage mesh, and the helpers its generated ``forward`` calls.

    Unlike ``SpmdModule`` it registers only its own stage's parameters (so ``parameters()``
    and the optimizer cover them alone); the model is kept, unregistered, for buffers and
    dropout probabilities, with the other stages' weights freed (meta tensors).

    Args:
        model: the whole model, built identically on every rank.
        mesh: the stage mesh (``stage_mesh``).
        parameters: qualified name -> planned placements over the stage mesh.
        owned: the qualified names of the parameters this stage reads.
        dropout_modules: dropout op -> its ``nn.Dropout`` path, or ``(module path, attribute)``.
        index, num_stages: this stage's position in the pipeline.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        parameters: Mapping[str, Placements],
        owned: Sequence[str],
        dropout_modules: Mapping[str, str | tuple[str, str]] | None = None,
        index: int = 0,
        num_stages: int = 1,
        distributed: Mapping[str, nn.Parameter] | None = None,
    ) -> None:
        nn.Module.__init__(self)
        object.__setattr__(self, "model", model)  # not a submodule: only this stage's weights are
        self.mesh = mesh
        self.index, self.num_stages = index, num_stages
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)
        self._dropout_modules = dict(dropout_modules or {})
        self.owned = tuple(owned)
        if distributed is None:
            self.params = _distribute_owned(model, mesh, parameters, self.owned)
        else:  # one of several stages of this rank (interleaved): its weights were placed once for all
            self.params = {name: distributed[name] for name in self.owned}
        for name, param in self.params.items():
            self.register_parameter(name.replace(".", "__"), param)
        self.train(model.training)

    def named_model_parameters(self):
        """(qualified name in the model, DTensor parameter) for each parameter of this stage."""
        return list(self.params.items())

    @property
    def local_stages(self) -> tuple["PipelineStageModule", ...]:
        """The stages this rank runs: itself (``VirtualStages`` holds several)."""
        return (self,)

    # ------------------------------------------------------------------ generated-code API

    def send(self, value: Any, placements: Placements) -> Any:
        """A value leaving this stage: laid out as the boundary says (a collective if it is
        not already), then this rank's local part. Its gradient comes back as a local tensor
        with the same placements."""
        if not isinstance(value, torch.Tensor):
            return value
        value = self._to(value, placements)
        if isinstance(value, DTensor):
            value = value.to_local()
        if value.dtype in (torch.bfloat16, torch.float16):
            # Made under mixed-precision autocast: it crosses as the fp32 the stage tables
            # declare (lossless; the next op casts it back as autocast says).
            value = value.float()
        return value

    def receive(self, value: Any, placements: Placements, traced_shape: Sequence[int] | None = None) -> Any:
        """A value arriving from the previous stage (this rank's local part), as a DTensor with
        the boundary's placements; the same as ``input``."""
        return self.input(value, placements, traced_shape)

    def moe_layer(self, router: DTensor, x: DTensor) -> tuple[DTensor, DTensor]:
        """One MoE layer of this stage, found by its router (this stage's parameter), run by
        its layout over the stage's dp ranks (``codegen.runtime.pipeline_moe``): its output
        and balance loss."""
        return self.experts_by_router[id(router)](router, x)

    def moe_experts(self, router: DTensor, tokens: DTensor, index: DTensor, weights: DTensor) -> DTensor:
        """A HuggingFace MoE block's stacked experts in this stage, found by the block's router,
        run by its layout over the stage's ranks
        (``codegen.runtime.pipeline_stacked_experts``): each token's weighted expert sum."""
        return self.experts_by_router[id(router)](router, tokens, index, weights)


def _distribute_owned(
    model: nn.Module, mesh: DeviceMesh, parameters: Mapping[str, Placements], owned: Sequence[str]
) -> dict[str, nn.Parameter]:
    """Replace the parameters named in ``owned`` by DTensor parameters placed as
    ``parameters`` says (each rank keeps its shard of the weight it built; no communication),
    keeping tied weights tied; the others (other stages' weights) become meta tensors, so a
    rank holds only its stage's weights. Returns qualified name -> parameter."""
    replicate = tuple(Replicate() for _ in range(mesh.ndim))
    wanted = {id(model.get_parameter(name)): replicate_partials(parameters.get(name, replicate)) for name in owned}
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or id(param) not in wanted:
                continue
            if id(param) not in replaced:
                shard = distribute_tensor(param.detach(), mesh, wanted[id(param)], src_data_rank=None)
                new = nn.Parameter(shard, requires_grad=param.requires_grad)
                if new.requires_grad:
                    new.register_hook(_placed_after_the_schedule(new))
                replaced[id(param)] = new
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in replaced:
                module._parameters[key] = replaced[id(param)]
            elif not isinstance(param, DTensor):
                # Another stage's weight: this rank never reads it, so it keeps only its
                # shape (on the meta device) and frees the memory.
                module._parameters[key] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
    return {name: model.get_parameter(name) for name in owned}


class VirtualStages(nn.Module):
    """The stages one rank runs in an interleaved pipeline (virtual stage ``v`` runs on the
    ranks at pp coordinate ``v % pp``): its stage modules, in order, as one module whose
    ``parameters()`` are theirs (a weight two of them read is one parameter)."""

    def __init__(self, stages: Sequence[PipelineStageModule], index: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.index = index  # the rank's pp coordinate (its first virtual stage)
        self.num_stages = stages[0].num_stages
        self.device, self.mesh = stages[0].device, stages[0].mesh

    @property
    def local_stages(self) -> tuple[PipelineStageModule, ...]:
        return tuple(self.stages)

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return {name: param for stage in self.stages for name, param in stage.params.items()}

    def named_model_parameters(self):
        """(qualified name in the model, DTensor parameter) for each parameter of this rank's stages."""
        return list(self.params.items())


def build_stage(
    stages: Sequence[type],
    model: nn.Module,
    mesh: DeviceMesh,
    parameters: Mapping[str, Placements],
    stage_parameters: Sequence[Sequence[str]],
    dropout_modules: Mapping[str, str | tuple[str, str]] | None = None,
) -> PipelineStageModule | VirtualStages:
    """This rank's stage module over the stage mesh: the class of its ``pp`` coordinate, or,
    when there are more stage classes than ranks on ``pp`` (interleaved: ``len(stages) = pp x
    virtual stages``), every class ``v`` with ``v % pp`` equal to it, in ``VirtualStages``."""
    index = stage_index(mesh)
    pp = mesh.size(mesh.mesh_dim_names.index(PP_AXIS))
    if len(stages) == pp:
        cls = stages[index]
        return cls(model, stage_mesh(mesh), parameters, stage_parameters[index], dropout_modules, index, len(stages))
    if len(stages) % pp:
        raise ValueError(f"{len(stages)} pipeline stages do not spread evenly over pp={pp} ranks")
    mine = range(index, len(stages), pp)
    owned = tuple(dict.fromkeys(name for v in mine for name in stage_parameters[v]))
    sub = stage_mesh(mesh)
    distributed = _distribute_owned(model, sub, parameters, owned)  # once: the stages share the model
    modules = [
        stages[v](model, sub, parameters, stage_parameters[v], dropout_modules, v, len(stages), distributed) for v in mine
    ]
    return VirtualStages(modules, index)


# ------------------------------------------------------------------------------ the step


class _ScheduleRunning:
    """Whether a pipeline schedule's backward is running on this process (``PipelineRunner.step``):
    parameters' gradients are then left in the placements backward gives them (partial sums
    over ``dp``, say) and accumulate so over the micro-batches; ``step`` lays each out as its
    parameter once the schedule is done. So a data-parallel gradient is all-reduced once per
    step, as Megatron-LM and the simulator do, not once per micro-batch."""

    active = False


def _placed_after_the_schedule(param: DTensor):
    """``param``'s gradient hook: its placements outside a schedule (``spmd.keep_placements``);
    unchanged while a schedule runs (``_ScheduleRunning``)."""
    keep = keep_placements(param)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad if _ScheduleRunning.active else keep(grad)

    return hook


class PipelineRunner:
    """Runs one training step of a pipeline program through a ``torch.distributed.pipelining``
    schedule, on every rank alike.

    Args:
        module: this rank's stage module (``parallelize``).
        mesh: the plan's whole mesh (with ``pp``).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        micro_batches: micro-batches per step (of this rank's slice of the batch).
        stage_inputs, stage_outputs: per stage, ``(name, traced shape of one micro-batch,
            dtype, placements)`` of each value it receives / sends (placements over the stage
            mesh; ``None``: a plain tensor, e.g. the loss). They give ``PipelineStage`` its
            static metadata, so it never runs a stage on made-up inputs to infer shapes.
        input_names: the model's inputs in the order of stage 0's ``forward``.
        shared: groups of stages that hold the same parameters, with those parameters' names.
    """

    def __init__(
        self,
        module: PipelineStageModule | VirtualStages,
        mesh: DeviceMesh,
        schedule: str,
        micro_batches: int,
        stage_inputs: Sequence[Sequence[tuple]],
        stage_outputs: Sequence[Sequence[tuple]],
        input_names: Sequence[str],
        shared: Mapping[tuple[int, ...], Sequence[str]] | None = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.module, self.mesh = module, mesh
        self.micro_batches = micro_batches
        self.input_names = tuple(input_names)
        self.num_stages = module.num_stages
        self.pp_group = mesh[PP_AXIS].get_group() if mesh.ndim > 1 else mesh.get_group()
        pp = dist.get_world_size(self.pp_group)
        # This rank runs virtual stages index, index + pp, ...: the first stage on pp rank 0,
        # the last (the loss) on pp rank pp - 1.
        self.first, self.last = module.index == 0, module.index == pp - 1
        self.last_rank = pp - 1
        self.stages = []
        for local in module.local_stages:
            inputs = tuple(_example(local.mesh, e, local.device, grad=local.index != 0) for e in stage_inputs[local.index])
            outputs = tuple(_example(local.mesh, e, local.device, grad=True) for e in stage_outputs[local.index])
            self.stages.append(
                PipelineStage(
                    local, local.index, self.num_stages, local.device, input_args=inputs, output_args=outputs, group=self.pp_group
                )
            )
        kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        # The last stage returns the model's loss of one micro-batch: the loss to back-propagate.
        # scale_grads=False: torch divides each stage's parameters' gradients by the number of
        # micro-batches when that stage's last backward ends, so a weight two virtual stages of
        # this rank share (tied) would be divided twice, once before the other stage has added
        # its part; ``step`` divides every parameter once, after the whole backward.
        if schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(self.stages, micro_batches, loss_fn=_the_loss, scale_grads=False)
        elif schedule in kinds and len(self.stages) == 1:
            if schedule == "1f1b" and micro_batches < pp:
                # Fewer micro-batches than stages: 1F1B's warm-up runs every forward before the
                # first backward, which is GPipe's order (torch's Schedule1F1B refuses m < pp).
                schedule = "gpipe"
            self.schedule = kinds[schedule](self.stages[0], micro_batches, loss_fn=_the_loss, scale_grads=False)
        else:
            raise ValueError(f"pipeline schedule '{schedule}' with {len(self.stages)} stages per rank is not compiled")
        self.stage = self.stages[0]
        self._shared = _shared_groups(mesh, shared or {}, module.index)

    def step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """Forward and backward of one step on this rank's slice of the batch (from
        ``shard_batch``); gradients are left in the stages' parameters (averaged over the
        micro-batches; tied weights summed over the stages that hold them). Returns the step's
        loss (the mean of the micro-batches' losses) on every rank."""
        losses: list[torch.Tensor] = []
        device = self.module.device
        target = torch.zeros(self.micro_batches, device=device) if self.last else None
        _ScheduleRunning.active = True
        try:
            if self.first:
                positional = _positional(args, kwargs, self.input_names)
                self.schedule.step(*positional, target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.step(target=target, losses=losses, return_outputs=False)
        finally:
            _ScheduleRunning.active = False
        self._place_gradients()
        self._average_over_micro_batches()
        finish_expert_gradients(self.module, self.micro_batches)
        self._sum_shared_gradients()
        loss = torch.stack([value.detach().reshape(()) for value in losses]).mean() if self.last else torch.zeros((), device=device)
        # The last stage's loss to every rank of this pipeline (the other stages have none).
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_rank)
        return loss

    def gradient_holders(self, param: torch.nn.Parameter) -> int:
        """How many ranks of ``pp_group`` hold ``param``'s whole gradient (gradient clipping
        counts it once): those of the stages it is tied over, else this rank alone."""
        return tied_holders(self._shared, self.module.params, param) or 1

    def _place_gradients(self) -> None:
        """Each gradient, summed over the micro-batches in the placements backward gave it,
        laid out as its parameter: one reduction per parameter and step (``_ScheduleRunning``)."""
        unique = {id(param): param for param in self.module.params.values()}
        for param in unique.values():
            grad = param.grad
            if isinstance(grad, DTensor) and not same_placements(grad.placements, param.placements):
                param.grad = grad.redistribute(param.device_mesh, param.placements)

    def _average_over_micro_batches(self) -> None:
        """Each micro-batch's loss is a mean over its samples, so the summed gradients divided
        by the number of micro-batches are the whole batch's; each parameter once, however
        many of this rank's stages read it (``params`` holds a shared one once)."""
        if self.micro_batches == 1:
            return
        unique = {id(param): param for param in self.module.params.values()}
        for param in unique.values():
            if param.grad is not None:
                param.grad.div_(self.micro_batches)

    def _sum_shared_gradients(self) -> None:
        for group, names in self._shared:
            for name in names:
                param = self.module.params[name]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=group)


def tied_holders(shared: Sequence[tuple[Any, Sequence[str]]], params: Mapping[str, torch.nn.Parameter],
                 param: torch.nn.Parameter) -> int | None:
    """How many ranks hold ``param``'s gradient when it is tied over stages: the size of the
    group (of ``shared``'s ``(group, names)``) whose names include it; None when it is not tied."""
    for group, names in shared:
        if any(params[name] is param for name in names):
            return dist.get_world_size(group)
    return None


def _the_loss(output: torch.Tensor, target: Any) -> torch.Tensor:  # noqa: ARG001 - the schedule's loss_fn signature
    """The schedule's loss: the last stage's output is the model's own loss already."""
    return output


def _example(mesh: DeviceMesh, entry: tuple, device: torch.device, grad: bool) -> torch.Tensor:
    """An empty tensor with the local shape and dtype of one boundary value (static metadata)."""
    _, shape, dtype, placements = entry
    shape = torch.Size(shape)
    if placements is not None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, _ = compute_local_shape_and_global_offset(shape, mesh, replicate_partials(placements))
    value = torch.empty(tuple(shape), dtype=dtype, device=device)
    return value.requires_grad_(grad and dtype.is_floating_point)


def _positional(args: tuple, kwargs: dict, names: Sequence[str]) -> tuple:
    """The model's inputs in the order of stage 0's forward: positional ones first, then
    keyword ones by name."""
    values = list(args) + [kwargs[name] for name in names[len(args) :] if name in kwargs]
    if len(values) != len(names):
        missing = [name for name in names[len(args) :] if name not in kwargs]
        raise ValueError(f"the pipeline's first stage needs the inputs {list(names)}; missing {missing}")
    return tuple(values)


def _shared_groups(mesh: DeviceMesh, shared: Mapping[tuple[int, ...], Sequence[str]], index: int) -> list:
    """For each group of stages that hold the same parameters: the process group of the ranks
    that run those stages (pp coordinate ``stage % pp``) and share this rank's dp/tp
    coordinate, when it spans more than one rank (created on every rank alike). Stages of one
    rank share one parameter, whose gradient sums theirs already."""
    groups = []
    if not shared:
        return groups
    ranks = mesh.mesh.reshape(mesh.size(0), -1) if mesh.ndim > 1 else mesh.mesh.reshape(-1, 1)
    pp = ranks.shape[0]
    me = dist.get_rank()
    for stages, names in sorted(shared.items()):
        holders = tuple(sorted({s % pp for s in stages}))
        if len(holders) < 2:
            continue
        for column in range(ranks.shape[1]):
            members = [int(ranks[p, column]) for p in holders]
            group = dist.new_group(members)
            if me in members and index in holders:
                groups.append((group, tuple(names)))
    return groups
