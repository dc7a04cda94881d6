"""Run a generated graph program once at compile time, on meta tensors, to see what DTensor does.

The plan says where each value is split; DTensor's own sharding rules decide what an op
actually produces from the placements it is given, and they sometimes differ (a ``split``
of a split dimension gathers it first; a ``cross_entropy`` with label smoothing gathers the
classes). To say so in the program, and to redistribute explicitly (with a comment) wherever
a value does not arrive as the plan says its consumer reads it, codegen runs the program
once in this process: rank
0 of a fake process group of the plan's world size (collectives do nothing), every tensor on
the meta device (no memory, no arithmetic), and reads each value's placements when
``forward`` returns. Backward runs too. An op that DTensor cannot run forward or backward on
its placements raises here, and is named (anomaly mode ties a backward step to its line).

DTensor can also run an op and be wrong without raising: its convolution, for one, computes
from the input's placements alone and ignores a sharded weight, so the local result is a
slice its placements do not describe. So every op's local result is checked against what its
placements promise: the global shape from the trace, split as the placements say (rank 0's
piece). The first op that breaks that promise is named like an op that raised, and runs on
whole inputs from then on.

Nothing here is needed at run time; when the fake process group is unavailable (a process
group already exists, or torch moved its testing helpers) codegen writes the program from
the plan alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import sys
import traceback
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from planner.model_loss import extract_loss
from planner.plans import Plan

_FILENAME = "<model_spmd dry run>"
# DTensor logs a performance hint when it redistributes over two mesh axes in two collectives;
# a dry run moves no data, so the hint would only scroll past a user's compile.
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
# How a forced op's reason starts when DTensor ran it but its local result broke the promise.
WRONG_LOCAL_SHAPE = "wrong local shape"


@dataclass
class Observation:
    """What one run of ``forward`` showed.

    Attributes:
        placements: Python name -> placements of each DTensor local of ``forward`` when it
            returned (``None`` for a plain tensor).
        failed_at: the Python name assigned on the line where ``forward`` raised, if it did.
        error: the exception's one-line message, if it raised.
    """

    placements: dict[str, Any] = field(default_factory=dict)
    failed_at: str | None = None
    error: str | None = None
    mismatch: str | None = None  # the first op whose local result breaks its placements' promise
    mismatch_note: str = ""  # how (local shape against the promised one)


def available(plan: Plan) -> bool:
    """Whether a dry run can happen in this process."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError:
        return False
    return True


def traced_shapes(graph_module: torch.fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor an op of ``graph_module`` makes, by node name (the Python
    name of its result in a generated forward), in program order."""
    shapes = {}
    for node in graph_module.graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and isinstance(value, torch.Tensor):
            shapes[node.name] = tuple(int(d) for d in value.shape)
    return shapes


def observe(plan: Plan, source: str, expected: Mapping[str, tuple[int, ...]] | None = None) -> Observation:
    """Run ``source`` (a ``model_spmd.py``) forward and backward once as rank 0 of a fake
    group on meta tensors; ``expected`` (``traced_shapes``) are the global shapes each op's
    local result is checked against (``Observation.mismatch``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    module = _load(source)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    with _quiet_logger(_REDISTRIBUTE_LOGGER):
        return _observe_on_fake_group(plan, module, expected)


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Only errors from logger ``name`` while the block runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _observe_on_fake_group(plan: Plan, module: types.ModuleType, expected: Mapping[str, tuple[int, ...]] | None) -> Observation:
    """``observe``'s run, on the fake group it started (destroyed here, whatever happens)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    try:
        mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=plan.mesh.names)
        torch.manual_seed(0)
        if plan.model.is_hf:
            import transformers

            transformers.logging.set_verbosity_error()
        model, args, kwargs = plan.model.build("meta")
        spmd = module.parallelize(model, mesh)
        spmd.device = torch.device("meta")
        local_args, local_kwargs = module.shard_batch(args, kwargs, mesh)
        observation = Observation()
        forward_code = type(spmd).forward.__code__

        def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
            if event == "return" and frame.f_code is forward_code:
                _note_mismatch(observation, frame.f_locals, expected or {}, mesh)
                for name, value in frame.f_locals.items():
                    if isinstance(value, DTensor):
                        observation.placements[name] = tuple(value.placements)
                    elif isinstance(value, torch.Tensor):
                        observation.placements[name] = None
                    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, DTensor) for v in value):
                        observation.placements[name] = tuple(tuple(v.placements) for v in value)

        previous = sys.getprofile()
        sys.setprofile(profile)
        # Anomaly mode records where in forward each backward step comes from, so a backward
        # that DTensor cannot run names its op. (Warnings: DTensor says its random ops lack
        # CPU support; dropout has no data here.)
        try:
            with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True, check_nan=False):
                warnings.simplefilter("ignore")
                output = spmd(*local_args, **local_kwargs)
        except Exception as error:  # noqa: BLE001 - reported to codegen, which decides
            observation.error = _one_line(error)
            observation.failed_at = _failing_name(error, forward_code)
            # An op that came out wrong earlier is the cause more often than the op that raised.
            _note_mismatch(observation, _forward_locals(error, forward_code), expected or {}, mesh)
            return observation
        finally:
            sys.setprofile(previous)
        try:
            with warnings.catch_warnings(record=True) as caught, torch.autograd.set_detect_anomaly(True, check_nan=False):
                warnings.simplefilter("always")
                extract_loss(output).backward()
        except Exception as error:  # noqa: BLE001
            observation.error = f"in backward: {_one_line(error)}"
            observation.failed_at = _forward_name_of(caught, module)
        return observation
    finally:
        dist.destroy_process_group()


def _note_mismatch(observation: Observation, local_values: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], mesh) -> None:
    """Record the first op (in program order) whose local result is not the piece of its
    traced shape that its placements give rank 0."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if observation.mismatch is not None:
        return
    for name, shape in expected.items():
        value = local_values.get(name)
        if not isinstance(value, DTensor):
            continue
        local = tuple(value.to_local().shape)
        promised = tuple(compute_local_shape_and_global_offset(torch.Size(shape), mesh, value.placements)[0])
        if local != promised:
            observation.mismatch = name
            observation.mismatch_note = (
                f"{WRONG_LOCAL_SHAPE}: result on rank 0 is {local} where {_placements_text(value.placements)} "
                f"of the traced {shape} promise {promised}"
            )
            return


def _placements_text(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def _forward_locals(error: BaseException, forward_code: types.CodeType) -> Mapping[str, Any]:
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code is forward_code:
            return frame.f_locals
    return {}


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _forward_name_of(caught: list, module: types.ModuleType) -> str | None:
    """The name assigned on the forward line whose backward failed, from anomaly mode's
    warning ("Traceback of forward call that caused the error")."""
    lines = module.__dict__["__dry_run_lines__"]
    for warning in reversed(caught):
        found = re.findall(rf'File "{re.escape(_FILENAME)}", line (\d+)', str(warning.message))
        if found:
            line = lines[int(found[-1]) - 1] if 0 < int(found[-1]) <= len(lines) else ""
            match = re.match(r"\s*(\w+) = ", line)
            return match[1] if match else None
    return None


def _load(source: str) -> types.ModuleType:
    spec = importlib.util.spec_from_loader("model_spmd_dry_run", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__dict__["__dry_run_lines__"] = source.splitlines()
    exec(compile(source, _FILENAME, "exec"), module.__dict__)  # noqa: S102 - our own generated code
    return module


def _failing_name(error: BaseException, forward_code: types.CodeType) -> str | None:
    """The name assigned on the line of ``forward`` that raised."""
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        if frame.f_code is forward_code:
            line = frame.f_code.co_filename and _line_of(frame, lineno)
            match = re.match(r"\s*(\w+) = ", line or "")
            return match[1] if match else None
    return None


def _line_of(frame, lineno: int) -> str | None:
    source = frame.f_globals.get("__dry_run_lines__")
    if source is None:
        return None
    return source[lineno - 1] if 0 < lineno <= len(source) else None


ROUNDS = 5  # rounds of dry run at most (2-3 in practice)


def refine(
    plan: Plan,
    probe: Callable[[dict[str, Any], dict[str, str]], str],
    write: Callable[[dict[str, Any], dict[str, str], str], str],
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> str:
    """A program written again from what DTensor produced in dry runs of it.

    ``probe(observed, forced)`` gives the source to dry-run (a version whose forward locals
    the dry run can read), ``write(observed, forced, warning)`` the final program, and
    ``expected`` (``traced_shapes``) the global shape of each op's result.
    Redistributing where a value arrives otherwise than its consumer reads it changes what
    later ops produce, so this repeats until nothing changes; an op DTensor fails on, or
    whose local result breaks its placements' promise, is ``forced`` to run on whole inputs
    (each such op buys one more round). A round that fails has the program rewritten first
    from what it saw before failing, since earlier rounds ran other redistributions; only a
    failure that stays is the op's own. Without a fake process group it writes the program
    from the plan's placements alone."""
    observed: dict[str, Any] = {}
    forced: dict[str, str] = {}
    if not available(plan):
        return write(observed, forced, "")
    rounds = 0
    while rounds < ROUNDS + len(forced):
        rounds += 1
        try:
            observation = observe(plan, probe(observed, forced), expected)
        except Exception as error:  # noqa: BLE001 - the dry run only refines comments
            reason = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
            return write(observed, forced, f"the compile-time dry run could not run ({reason}); comments give the plan's placements")
        if observation.mismatch is not None and observation.mismatch not in forced:
            forced[observation.mismatch] = observation.mismatch_note
            continue
        if observation.error:
            # What this run saw before it failed is newer than what earlier rounds saw (they
            # ran other redistributions): a value the program still believes replicated may
            # be split now, and reading it as whole is then the failure. Rewrite from that
            # first; only a failure that stays is the op's own.
            merged = {**observed, **observation.placements}
            if merged != observed:
                observed = merged
                continue
            if observation.failed_at is None or observation.failed_at in forced:
                return write(observed, forced, f"a compile-time dry run of this program failed: {observation.error}")
            forced[observation.failed_at] = observation.error
        elif observation.placements == observed:
            break
        else:
            observed = observation.placements
    return write(observed, forced, "")
