"""A compiled program folder, loaded: its plan, its ``model_spmd`` module, and helpers to
build the mesh and the model on this rank. This is the Python path for a user's own loop:

    from codegen.runtime import load_program
    program = load_program("out")                     # inside a torchrun process
    mesh = program.build_mesh()                       # initialises torch.distributed if needed
    model, args, kwargs = program.build_model()       # same seed, same weights on every rank
    module = program.parallelize(model, mesh)
    optimizer = program.make_optimizer(module, mesh, torch.optim.AdamW, lr=1e-3)
    local_args, local_kwargs = program.shard_batch(args, kwargs, mesh)
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.errors import LaunchError, PlanningError
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
    it to return a ``ZeroRedundancyOptimizer`` over ``dp`` (states sharded, updated weights
    broadcast). ``Program.make_optimizer`` calls the hook when it is defined and builds the
    plain optimizer otherwise; ``launch.py --check``/``--steps`` build theirs through it.
    """

    folder: Path
    plan: Plan
    module: ModuleType

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
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        key = (dist.group.WORLD, device.type, tuple(self.plan.mesh.shape), tuple(self.plan.mesh.names))
        if key not in _MESHES:
            _MESHES[key] = init_device_mesh(device.type, self.plan.mesh.shape, mesh_dim_names=self.plan.mesh.names)
        return _MESHES[key]

    def build_model(self, seed: int = BUILD_SEED) -> tuple[torch.nn.Module, tuple, dict]:
        """The full model and one global example batch, built from the plan's spec with ``seed``."""
        if self.plan.model is None:
            raise PlanningError("this plan has no model spec; build the model yourself and call parallelize()")
        torch.manual_seed(seed)
        if self.plan.model.source.startswith("hf:"):
            # transformers prints config notices from every rank at the first forward
            # (e.g. about loss_type); they say nothing about the parallel program.
            import transformers

            transformers.logging.set_verbosity_error()
        return self.plan.model.build(self.device())

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
    """Load a folder written by ``planner.compile`` (``plan.json`` + ``model_spmd.py``)."""
    folder = Path(folder)
    source = folder / "model_spmd.py"
    if not source.is_file():
        raise LaunchError(f"'{folder}' has no model_spmd.py; compile a plan into it with `planner compile PLAN -o {folder}`")
    plan = load_plan(folder / "plan.json")
    spec = importlib.util.spec_from_file_location(f"model_spmd_{abs(hash(str(folder.resolve())))}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Program(folder=folder, plan=plan, module=module)


def check_world_size(plan: Plan) -> None:
    """Fail with one line when torchrun's world size differs from the plan's."""
    if "WORLD_SIZE" not in os.environ:
        raise LaunchError(
            f"this program must be started by torchrun: torchrun --nproc_per_node {plan.world_size} launch.py --check"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world != plan.world_size:
        raise LaunchError(
            f"the plan was compiled for {plan.world_size} ranks (mesh {plan.mesh}) but torchrun started {world}; "
            f"run torchrun --nproc_per_node {plan.world_size}, or re-plan for {world} devices"
        )
