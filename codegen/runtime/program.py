"""A compiled program folder, loaded: its plan, its ``model_spmd`` module, and helpers to
build the mesh and the model on this rank. This is the Python path for a user's own loop:

    from codegen.runtime import load_program
    program = load_program("out")                     # inside a torchrun process
    mesh = program.build_mesh()                       # initialises torch.distributed if needed
    model, args, kwargs = program.build_model()       # the whole model, initialised by parameter name
    module = program.parallelize(model, mesh)
    # or, holding only this rank's shards (built on meta, shards materialised after parallelize):
    model, module, args, kwargs = program.build_module(mesh)
    optimizer = program.make_optimizer(module, mesh, torch.optim.AdamW, lr=1e-3)
    local_args, local_kwargs = program.shard_batch(args, kwargs, mesh)
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from codegen.runtime.materialize import init_rules, materialize, name_derived_sources
from planner.errors import LaunchError, PlanningError
from planner.launch_command import first_run_command, torchrun_parts
from planner.model_spec import announce_import, parameters_on_meta
from planner.plan_checks import check_model_matches
from planner.plans import Plan, load_plan

# Every rank builds the model from its spec with this seed, so weights (and the example
# batch) are identical everywhere without a broadcast. It matches planner.api.BUILD_SEED.
BUILD_SEED = 0

# The meshes built in this process, by (default process group, device type, shape, names).
# A DeviceMesh equals another of the same ranks, shape and names whatever its process groups,
# and DTensor caches sharding decisions (which hold their mesh) under that equality: after a
# second mesh of the same shape, the ranks whose cache held a decision of the first ran its
# collectives in the first mesh's groups and the other ranks in the second's, and both waited
# for ever (two programs checked in one process). So each mesh is built once per process.
_MESHES: dict[tuple, DeviceMesh] = {}


@dataclass
class Program:
    """A loaded compiled program (see the module docstring).

    ``model_spmd.py`` must define ``parallelize(model, mesh)`` and ``shard_batch(args,
    kwargs, mesh)``. It may define the optimizer hook

        make_optimizer(module, mesh, optimizer_class, **kwargs) -> torch.optim.Optimizer

    where ``module`` is what ``parallelize`` returned, ``optimizer_class`` a
    ``torch.optim.Optimizer`` subclass (``torch.optim.AdamW``) and ``kwargs`` its
    hyper-parameters (``lr=...``): the optimizer of the step, equivalent, parameter by
    parameter, to ``optimizer_class(module.parameters(), **kwargs)``. ZeRO-1 programs define
    it to return a ``ShardedStatesOptimizer`` over ``dp`` (each rank steps a slice of every
    weight, the updated slices all-gathered). ``Program.make_optimizer`` calls the hook when
    it is defined and builds the plain optimizer otherwise; ``launch.py --check``/``--steps``
    build theirs through it.
    """

    folder: Path
    plan: Plan
    module: ModuleType
    _announced: bool = field(default=False, init=False, repr=False)  # the model file was named (rank 0)

    def device(self) -> torch.device:
        """This rank's device: ``cuda:<local rank>`` when CUDA is available, else CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    def build_mesh(self) -> DeviceMesh:
        """Initialise torch.distributed (NCCL on CUDA, gloo on CPU) and the plan's mesh; a
        mesh of the same shape built earlier in this process is reused (see ``_MESHES``)."""
        check_world_size(self.plan)
        device = self.device()
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
                # Bound to this rank's GPU: NCCL's communicator is made now, and barriers
                # and subgroups need not guess the device.
                dist.init_process_group("nccl", device_id=device)
            else:
                dist.init_process_group("gloo")
        key = (dist.group.WORLD, device.type, tuple(self.plan.mesh.shape), tuple(self.plan.mesh.names))
        if key not in _MESHES:
            _MESHES[key] = init_device_mesh(device.type, self.plan.mesh.shape, mesh_dim_names=self.plan.mesh.names)
        return _MESHES[key]

    def build_model(self, seed: int = BUILD_SEED) -> tuple[torch.nn.Module, tuple, dict]:
        """The full model and one global example batch, built from the plan's spec with
        ``seed``; every parameter initialised from its name (``codegen.runtime.materialize``),
        so it equals the weights any sharded build of any plan starts from.

        Raises:
            PlanFileError: the spec now builds a different model than the one planned.
        """
        model, args, kwargs = self._build(self.device(), seed, meta_parameters=True)
        check_model_matches(self.plan, model, args, kwargs)
        materialize(model, model, self.device(), init_rules(model), seed)
        return model, args, kwargs

    def build_module(self, mesh: DeviceMesh, seed: int = BUILD_SEED) -> tuple[torch.nn.Module, torch.nn.Module, tuple, dict]:
        """This rank's module holding only its share of the weights: the model is built with
        its parameters on meta, ``parallelize``d, and then only the shards this rank holds are
        materialised, with the values :meth:`build_model` gives them (so every plan and world
        size starts from the same weights). Programs whose ``parallelize`` needs real weights
        (DDP and ZeRO-1, which keep whole replicas anyway, also with MoE layers) get the whole
        model first. Returns ``(model, module, args,
        kwargs)``: the model as built (``parallelize`` changed it in place; its parameter names
        are the checkpoint's), this rank's module and the global example batch."""
        if not self.parallelizes_on_meta:
            model, args, kwargs = self.build_model(seed)
            sources = dict(model.named_parameters(remove_duplicate=False))  # see below
            module = self.parallelize(model, mesh)
            name_derived_sources(model, sources)
            return model, module, args, kwargs
        model, args, kwargs = self._build(self.device(), seed, meta_parameters=True)
        check_model_matches(self.plan, model, args, kwargs)
        rules = init_rules(model)
        # The parameters as the spec builds them, held through parallelize: a layer the
        # program replaces (MoE) derives its parameters from these, and they are initialised
        # (and checkpointed) under these names.
        sources = dict(model.named_parameters(remove_duplicate=False))
        module = self.parallelize(model, mesh)
        name_derived_sources(model, sources)
        materialize(module, model, self.device(), rules, seed)
        return model, module, args, kwargs

    @property
    def parallelizes_on_meta(self) -> bool:
        """Whether ``parallelize`` takes a model whose parameters are on meta: FSDP2 flavours,
        graph and pipeline programs (they distribute each weight with ``distribute_tensor``,
        which on meta allocates nothing; SUMMA programs are graph programs whose block layouts
        are DTensor placements; MoE programs under FSDP2, whose runtime layers derive their
        experts from the model's parameters, ``materialize.set_derived_parameter``). DDP and
        ZeRO-1 broadcast real weights."""
        from planner.program_shape import is_data_parallel
        from planner.strategy import ExpertLayout

        if self.plan.expert_layouts or any(isinstance(s.layout, ExpertLayout) for s in self.plan.strategies):
            return self.plan.dp_flavour in ("fsdp", "zero2")
        if is_data_parallel(self.plan):
            return self.plan.dp_flavour in ("fsdp", "zero2")
        return True

    def check_model(self) -> None:
        """Build the model on meta tensors (no memory, milliseconds) and check that the spec
        still builds the planned model; ``launch.py`` calls it before the process group starts.

        Raises:
            SpecError: the model file is gone or fails to build. PlanFileError: it now
                builds a different model than the one planned.
        """
        check_model_matches(self.plan, *self.meta_model())

    def meta_model(self) -> tuple[torch.nn.Module, tuple, dict]:
        """The model and example batch as the spec builds them, on the meta device (no
        memory, milliseconds): what checks of names, shapes and dtypes need."""
        return self._build(torch.device("meta"), BUILD_SEED)

    def _build(self, device: torch.device, seed: int, meta_parameters: bool = False) -> tuple[torch.nn.Module, tuple, dict]:
        if self.plan.model is None:
            raise PlanningError("this plan has no model spec; build the model yourself and call parallelize()")
        if not self._announced and os.environ.get("RANK", "0") == "0":  # said once, by rank 0
            announce_import(self.plan.model, f"model.source of {(self.folder / 'plan.json').resolve()}")
        self._announced = True
        torch.manual_seed(seed)
        if self.plan.model.source.startswith("hf:"):
            # transformers prints config notices from every rank at the first forward
            # (e.g. about loss_type); they say nothing about the parallel program.
            import transformers

            transformers.logging.set_verbosity_error()
        if meta_parameters:
            with parameters_on_meta():
                return self.plan.model.build(device)
        return self.plan.model.build(device)

    def parallelize(self, model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
        """This rank's module (``model_spmd.parallelize``)."""
        return self.module.parallelize(model, mesh)

    def make_optimizer(
        self, module: torch.nn.Module, mesh: DeviceMesh, optimizer_class: type[torch.optim.Optimizer], **kwargs
    ) -> torch.optim.Optimizer:
        """The optimizer of ``module`` (from ``parallelize``): ``model_spmd.make_optimizer``
        when the program defines it, else ``optimizer_class(module.parameters(), **kwargs)``."""
        hook = getattr(self.module, "make_optimizer", None)
        if hook is None:
            return optimizer_class(module.parameters(), **kwargs)
        return hook(module, mesh, optimizer_class, **kwargs)

    def forward_backward(
        self, module: torch.nn.Module, args: tuple, kwargs: dict, mesh: DeviceMesh
    ) -> tuple[torch.Tensor, object]:
        """One step's forward and backward on a GLOBAL batch (every rank passes the same),
        in the plan's ``accumulation_steps`` micro-batches, each sharded by ``shard_batch``
        (``codegen.runtime.accumulation``): this rank's loss, and the module's output when
        the step ran in one piece (``None`` when it accumulated)."""
        from codegen.runtime.accumulation import forward_backward

        hook = getattr(self.module, "forward_backward", None)
        if hook is not None:  # a program that cuts each rank's own rows (uneven shares accumulating)
            return hook(module, args, kwargs, mesh)

        def shard(part_args: tuple, part_kwargs: dict) -> tuple[tuple, dict]:
            return self.shard_batch(part_args, part_kwargs, mesh)

        return forward_backward(module, args, kwargs, self.plan.accumulation_steps, self.plan.batch_size, shard,
                                self.loss_weight(mesh))

    @property
    def batch_shares(self) -> tuple[int, ...] | None:
        """The rows of the global batch each ``dp`` rank takes when they are uneven
        (``model_spmd.BATCH_SHARES``, ``planner.families.uneven_dp``); None for even rows."""
        shares = getattr(self.module, "BATCH_SHARES", None)
        return None if shares is None else tuple(shares)

    def loss_weight(self, mesh: DeviceMesh) -> float:
        """What this rank's loss is multiplied by before backward: ``b_r * dp / B`` under
        uneven shares (the data-parallel reduction averages over the ``dp`` ranks, so the
        reduced gradient is ``sum_r (b_r / B) grad_r``, one device's), else 1."""
        shares = self.batch_shares
        if shares is None:
            return 1.0
        return shares[mesh.get_local_rank("dp")] * len(shares) / self.plan.batch_size

    @property
    def is_pipeline(self) -> bool:
        """Whether this is a pipeline program: ``parallelize`` returns this rank's stage, and
        ``model_spmd.make_pipeline(stage, mesh).step(args, kwargs)`` runs a step's forward and
        backward through the schedule (``codegen.runtime.pipeline``)."""
        return self.plan.pipeline is not None

    def shard_batch(self, args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
        """This rank's slice of a global batch (``model_spmd.shard_batch``)."""
        return self.module.shard_batch(args, kwargs, mesh)


def load_program(folder: str | Path) -> Program:
    """Load a folder written by ``planner.compile`` (``plan.json`` + ``model_spmd.py``).

    Raises:
        LaunchError: the folder lacks its files, ``model_spmd.py`` does not import, or it
            disagrees with ``plan.json``. PlanFileError: ``plan.json`` is invalid.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise LaunchError(f"load_program takes the path of a compiled program folder, got {type(folder).__name__}")
    folder = Path(folder)
    for name in ("model_spmd.py", "plan.json"):
        if not (folder / name).is_file():
            raise LaunchError(f"'{folder}' has no {name}; compile a plan into it with `planner compile PLAN -o {folder}`")
    plan = load_plan(folder / "plan.json")
    source = folder / "model_spmd.py"
    spec = importlib.util.spec_from_file_location(f"model_spmd_{abs(hash(str(folder.resolve())))}", source)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        line = getattr(error, "lineno", None) or _failing_line(error, str(source))
        raise LaunchError(
            f"{source} fails to import{f' (line {line})' if line else ''}: {type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]}; fix it, or compile the plan again with `planner compile`"
        ) from error
    for function in ("parallelize", "shard_batch"):
        if not callable(getattr(module, function, None)):
            raise LaunchError(f"{source} defines no {function}(); compile the plan again with `planner compile`")
    _check_program_matches_plan(module, plan, folder)
    return Program(folder=folder, plan=plan, module=module)


def _check_program_matches_plan(module: ModuleType, plan: Plan, folder: Path) -> None:
    """A generated ``model_spmd.py`` records the mesh and batch it was compiled for; a
    plan.json edited after compiling would otherwise drive it with another mesh or batch."""
    compiled = {"mesh": getattr(module, "MESH_AXES", None), "batch": getattr(module, "GLOBAL_BATCH", None)}
    planned = {"mesh": tuple(plan.mesh.axes), "batch": plan.batch_size}
    differ = [key for key, value in compiled.items() if value is not None and value != planned[key]]
    if differ:
        shown = "; ".join(f"{key}: plan.json {planned[key]!r}, model_spmd.py {compiled[key]!r}" for key in differ)
        raise LaunchError(
            f"plan.json and model_spmd.py in '{folder}' disagree ({shown}): one was edited after compiling; "
            f"compile the plan again with `planner compile PLAN -o {folder}`"
        )


def _failing_line(error: BaseException, filename: str) -> int | None:
    """The line of ``filename`` where ``error`` was raised, if it was raised there."""
    import traceback

    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == filename]
    return frames[-1].lineno if frames else None


def check_world_size(plan: Plan) -> None:
    """Fail with one line when torchrun's world size differs from the plan's."""
    if "WORLD_SIZE" not in os.environ:
        raise LaunchError(f"this program must be started by torchrun: {first_run_command(plan, 'launch.py')}")
    world = int(os.environ["WORLD_SIZE"])
    if world != plan.world_size:
        raise LaunchError(
            f"the plan was compiled for {plan.world_size} ranks (mesh {plan.mesh}) but torchrun started {world}; "
            f"run {' '.join(torchrun_parts(plan, 'launch.py')[:-1])}, or re-plan for {world} devices"
        )
