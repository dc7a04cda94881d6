"""Write ``model_spmd.py`` for a pipeline plan: one stage module per pipeline stage.

A pipeline plan (``plan.pipeline``, a mesh ``pp`` [x ``dp``] [x ``tp``]) gives every op of the
traced graph a stage (``NodeStrategy.stage``) and placements on the other axes. The program
replays the graph as the graph program does (``codegen.spmd_emit``: one line per ATen op,
on DTensors, ``_to`` where the plan redistributes), cut into stages:

- the graph is traced again at the size of one micro-batch (``batch / micro_batches``, over
  all of ``dp``), so the shapes written in the program (views, reshapes) are a micro-batch's;
- each stage becomes a class whose ``forward`` runs that stage's ops on DTensors over the
  stage mesh (the plan's mesh without ``pp``; a one-rank ``dp`` axis when ``pp`` is the only
  axis), and reads only that stage's parameters;
- what a stage sends on is read from the written code (as ``codegen.spmd_recompute`` reads a
  block's outputs): the DTensor values it or an earlier stage assigned that a later stage
  reads, graph inputs included (labels a last stage needs travel through the stages before
  it). They cross as local tensors (``send``: ``_to`` the boundary placements, then
  ``to_local``; ``receive``: ``DTensor.from_local`` with the same placements); values computed
  locally (positions, masks) are computed again where they are read instead of sent;
- the last stage returns the model's loss, which the schedule back-propagates;
- with ``recompute="full"`` each repeated block inside a stage runs under
  ``torch.utils.checkpoint`` (as in graph programs, ``codegen.spmd_recompute``); with
  ``"selective"`` each block's attention core does (``codegen.attention_core``); a stage
  whose plan gives it a mode of its own (``PipelineConfig.stage_recompute``) follows that;
- parameters read by several stages (tied embeddings) are held by each; the runtime sums
  their gradients over those stages.

- stages may hold different numbers of blocks: each op runs on the stage its strategy names;
- under the interleaved schedule there are ``pp x virtual_stages`` stage modules, stage ``s``
  on the ranks at pp coordinate ``s % pp`` (``codegen.pipeline_schedules``).

``codegen.runtime.pipeline`` runs it: ``PipelineStage`` with static shapes from the
STAGE_INPUTS / STAGE_OUTPUTS tables, and ``ScheduleGPipe``, ``Schedule1F1B`` or
``ScheduleInterleaved1F1B``. ``codegen.pipeline_stage_plan`` holds the plan as a stage sees it.

Not compiled (``unsupported`` names why, one line): meshes whose first axis is not ``pp`` or
with axes other than ``dp``/``tp``, virtual stages under a schedule other than interleaved,
stages whose ops do not follow each other in graph order, and models whose traced graph
returns no scalar loss.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Replicate

from codegen import spmd_notes as notes
from codegen.emit import about_plan, autocast_lines, precision_imports
from codegen.source_text import comment, identifier, number, with_comment
from codegen.graph_facts import build_meta_model, clean_path, model_facts, trace_model
from codegen.micro_batch_source import first_samples
from codegen.pipeline_stage_plan import StagePlan, flat_source, micro_strategies
from codegen.pipeline_schedules import schedule_lines, schedule_problem, stage_count, stages_comment
from codegen.spmd_emit import SUPPORTED_AXES, GraphEmitter
from codegen.spmd_sections import SHARDED_STATES_IMPORT, sharded_states_function, shards_optimizer_states
from codegen.spmd_placements import whole
from codegen.attention_core import NO_CORE_COMMENT, attention_cores
from codegen.block_fold import BlockFolder, emit_block_runs, forward_locals, placeholder_table
from codegen.spmd_recompute import assigned_in_order, checkpoint_blocks, core_runs, names_in
from planner import __version__
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.plans import Plan

PP_AXIS = "pp"
_PAD = " " * 8


def unsupported(plan: Plan) -> str | None:
    """Why this path cannot compile ``plan`` (one line), or ``None`` when it can."""
    pipeline = plan.pipeline
    if pipeline is None:
        return "the plan has no pipeline"
    names = plan.mesh.names
    if not names or names[0] != PP_AXIS:
        return f"pipeline programs need '{PP_AXIS}' as the mesh's first axis; this mesh is {plan.mesh}"
    if not set(names[1:]) <= set(SUPPORTED_AXES):
        return f"pipeline programs run stages on axes among {SUPPORTED_AXES} besides pp; this mesh is {plan.mesh}"
    problem = schedule_problem(pipeline)
    if problem:
        return problem
    if plan.recompute not in ("none", "full", "selective"):
        return f"pipeline programs recompute none, full blocks or selectively, not {plan.recompute!r}"
    dp = plan.mesh.axis_size("dp") if "dp" in names else 1
    if plan.batch_size % (pipeline.micro_batches * dp):
        return f"the batch {plan.batch_size} does not split into {pipeline.micro_batches} micro-batches on each of dp={dp} ranks"
    return None


def supports(plan: Plan) -> bool:
    """Whether this emitter compiles ``plan`` (see ``unsupported``)."""
    return unsupported(plan) is None


def render_pipeline_program(plan: Plan) -> str:
    """Source of ``model_spmd.py`` for a pipeline plan (see the module docstring).

    Raises:
        NotImplementedError: the plan is one this path does not compile (named in the message).
        PlanningError: the plan has no model spec, or its strategies do not match the model.
    """
    reason = unsupported(plan)
    if reason:
        raise NotImplementedError(reason)
    if plan.model is None:
        raise PlanningError("this plan has no model spec, so its model cannot be traced to generate the program")
    model, args, kwargs = build_meta_model(plan)
    micro = plan.batch_size // plan.pipeline.micro_batches
    micro_args, micro_kwargs = first_samples(args, kwargs, plan.batch_size, micro)
    graph = trace_model(model, micro_args, micro_kwargs)
    facts = model_facts(model, micro_args, micro_kwargs, graph)
    stage_plan = StagePlan(plan, micro_strategies(plan, graph, micro))

    def write(observed=None, forced=None, warning=""):
        return _PipelineWriter(plan, stage_plan, graph, facts, observed, forced, warning).render()

    from codegen import dry_run

    # As for graph programs: run the stages' ops once on meta tensors (one micro-batch, the
    # stage mesh, a fake process group) and write the program again from what DTensor produced.
    return dry_run.refine(
        stage_plan,
        lambda observed, forced: flat_source(stage_plan, graph, facts, observed, forced, micro),
        write,
        dry_run.traced_shapes(graph.graph_module),
    )


@dataclasses.dataclass
class _Boundary:
    """A value crossing into a stage: its name, micro-batch shape, dtype and placements."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple


class _PipelineWriter:
    """Writes one pipeline program from an ``GraphEmitter`` over the stage plan."""

    def __init__(self, plan: Plan, stage_plan: StagePlan, graph: OpGraph, facts, observed, forced, warning: str):
        self.plan, self.stage_plan, self.graph, self.facts = plan, stage_plan, graph, facts
        # Every value stays a DTensor: what crosses a stage boundary is read from DTensor values.
        self.emitter = GraphEmitter(stage_plan, graph, facts, observed, forced, warning, local_replicated=False)
        self.stages = stage_count(plan.pipeline)  # stage modules: pp x virtual stages (interleaved)
        self.axes, self.sizes = stage_plan.mesh.names, stage_plan.mesh.shape
        # Per stage module: "none", "full" (whole blocks) or "selective" (attention cores).
        self.recompute = [plan.recompute_at(stage) for stage in range(self.stages)]
        selective = "selective" in self.recompute
        self.cores = attention_cores(graph, plan.summary.tokens_per_sample) if selective else []

    # ------------------------------------------------------------------------- analysis

    def _stage_nodes(self, gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
        """The graph's ops cut by stage; nodes without a strategy (getitem, export's checks)
        go with the op they follow. Stages must come in order."""
        strategies = {s.node: s for s in self.stage_plan.strategies}
        runs: list[list[torch.fx.Node]] = [[] for _ in range(self.stages)]
        current = 0
        for fx_node in gm.graph.nodes:
            if fx_node.op != "call_function":
                continue
            if fx_node.name in strategies:
                stage = strategies[fx_node.name].stage
                if stage < current:
                    raise NotImplementedError(
                        f"op '{fx_node.name}' runs on pipeline stage {stage} after an op of stage {current}; pipeline "
                        f"codegen needs each stage's ops to follow the previous stage's"
                    )
                if stage >= self.stages:
                    raise PlanningError(f"op '{fx_node.name}' is planned on stage {stage} of a {self.stages}-stage pipeline")
                current = stage
            runs[current].append(fx_node)
        return runs

    def _loss_leaf(self, gm: torch.fx.GraphModule) -> torch.fx.Node:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        leaves = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
        for leaf in leaves:
            val = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point():
                return leaf
        raise NotImplementedError(
            "the model returns no scalar loss in its traced graph; pipeline programs back-propagate the model's own loss"
        )

    # ------------------------------------------------------------------------- render

    def render(self) -> str:
        em = self.emitter
        gm = self.graph.graph_module
        for fx_node in gm.graph.nodes:
            em.used_names.add(identifier(fx_node.name, "a traced graph node"))  # every value is named after one
        inputs = [i for i in self.graph.inputs]
        if any(i.meta is None for i in inputs):
            raise NotImplementedError("pipeline codegen needs every model input to be a tensor (the schedule splits them)")
        input_names = [i.name for i in inputs]
        input_lines = _lines_by_name(em._input_lines(gm))
        param_lines = _lines_by_name(em._parameter_lines(gm))
        param_of_line = {name: em.param_of_placeholder.get(name) for name in param_lines}

        runs = self._stage_nodes(gm)
        written: list[list[tuple[Any, list[str]]]] = []
        for stage, nodes in enumerate(runs):
            em.resharded = {}  # each stage redistributes what it reads itself
            em.module = None
            written.append(self._emit_runs(nodes, gm, self.recompute[stage]))
        loss = em.values[self._loss_leaf(gm).name]
        loss_line = _PAD + (f"return self.loss({loss.expr})" if loss.kind == "dt" else f"return {loss.expr}")
        bodies = self._checkpointed(written, loss_line)  # written out; folded below, once stages are known

        value_of = {v.expr: (fx_name, v) for fx_name, v in em.values.items()}
        kind_of = {expr: v.kind for expr, (_, v) in value_of.items()}
        defined: dict[str, int] = {name: -1 for name in input_names}
        order: dict[str, int] = {name: i for i, name in enumerate(input_names)}
        for stage, body in enumerate(bodies):
            for name in assigned_in_order(body):
                defined.setdefault(name, stage)
                order.setdefault(name, len(order))

        # What each stage reads from elsewhere: parameters (its own lines), values computed
        # locally (computed again here), and DTensors or inputs (received).
        extra: list[list[str]] = [[] for _ in range(self.stages)]
        received: list[list[str]] = [[] for _ in range(self.stages)]
        params: list[list[str]] = [[] for _ in range(self.stages)]
        needed_params: list[list[str]] = [[] for _ in range(self.stages)]
        for stage in range(self.stages):
            tail = [loss_line] if stage == self.stages - 1 else []
            while True:
                lines = extra[stage] + bodies[stage] + tail
                needed = (names_in(lines, ast.Load) - names_in(lines, ast.Store)) & (set(defined) | set(param_lines))
                later = sorted(n for n in needed if defined.get(n, -1) > stage)
                if later:
                    raise NotImplementedError(f"stage {stage} reads {later[0]}, which a later stage computes")
                local = [n for n in needed if n in defined and defined[n] >= 0 and kind_of.get(n) != "dt"]
                if not local:
                    break
                extra[stage] = self._recomputed(gm, local, value_of, stage) + extra[stage]
            params[stage] = [n for n in param_lines if n in needed]
            needed_params[stage] = list(params[stage])  # what the stage owns, block functions' reads included
            received[stage] = sorted((n for n in needed if n in defined and n not in param_lines), key=order.get)
            if stage == 0:
                received[stage] = list(input_names)
        # Boundary k -> k+1: every value a later stage receives that exists by stage k.
        boundaries: list[list[str]] = []
        for k in range(self.stages - 1):
            names = {n for s in range(k + 1, self.stages) for n in received[s] if defined[n] <= k}
            boundaries.append(sorted(names, key=order.get))
        info = {name: self._boundary(name, value_of) for b in boundaries for name in b}
        info.update({name: self._boundary(name, value_of) for name in input_names})

        # Each repeated block written once (codegen.block_fold), shared by the stages.
        placeholders, prelude = placeholder_table(em, list(param_lines.values()))
        known = forward_locals([list(input_lines.values()), list(param_lines.values()), *(l for runs in written for _, l in runs)])
        folder = BlockFolder(placeholders, prelude, known | set(input_names), em.used_names)
        loaded = [set().union(*(names_in(lines, ast.Load) for _, lines in runs)) for runs in written]
        elsewhere = [names_in([loss_line], ast.Load).union(*(loaded[i] for i in range(len(written)) if i != s)) for s in range(self.stages)]
        bodies = self._checkpointed(folder.fold(written, elsewhere, self.recompute), loss_line)
        for stage in range(self.stages):
            read = names_in(extra[stage] + bodies[stage], ast.Load)
            params[stage] = [n for n in params[stage] if n not in folder.moved or n in read]

        classes = []
        class_names = []
        stage_params: list[list[str]] = []
        for stage in range(self.stages):
            class_name = self.emitter.class_name(f"Stage{stage}")
            class_names.append(class_name)
            owned = list(dict.fromkeys(param_of_line[n] for n in needed_params[stage] if param_of_line[n] in self.graph.parameters))
            stage_params.append(owned)
            incoming = input_names if stage == 0 else boundaries[stage - 1]
            outgoing = boundaries[stage] if stage < self.stages - 1 else None
            classes.append(
                self._class(
                    stage, class_name, runs[stage], incoming, outgoing, info,
                    [input_lines[n] for n in input_names] if stage == 0 else None,
                    [param_lines[n] for n in params[stage]], extra[stage], bodies[stage], loss_line, owned,
                )
            )
        shared: dict[tuple[int, ...], list[str]] = {}
        for name in dict.fromkeys(n for owned in stage_params for n in owned):
            holders = tuple(s for s, owned in enumerate(stage_params) if name in owned)
            if len(holders) > 1:
                shared.setdefault(holders, []).append(name)
        stage_inputs = [[info[n] for n in (input_names if s == 0 else boundaries[s - 1])] for s in range(self.stages)]
        loss_shape = tuple(self._loss_leaf(gm).meta["val"].shape)
        stage_outputs = [[info[n] for n in boundaries[s]] for s in range(self.stages - 1)]
        io = self._io_tables(stage_inputs, stage_outputs, loss.expr, loss_shape)
        tables = em._tables()
        return "\n".join(
            [
                self._header(stage_params, boundaries, info, shared),
                self._imports(),
                tables,
                io,
                *classes,
                folder.source(),
                self._functions(class_names, stage_params, shared, input_names),
            ]
        )

    def _emit_runs(self, nodes: list[torch.fx.Node], gm: torch.fx.GraphModule, recompute: str) -> list[tuple[Any, list[str]]]:
        """A stage's lines, as runs of one repeated block (or none) when the stage recomputes
        (``recompute``: each block run indented one more level, to become a nested function)."""
        if recompute == "selective" and not self.cores:
            return [(None, self.emitter._emit_nodes(nodes, gm, indent=2))]
        if recompute != "selective":
            return emit_block_runs(self.emitter, nodes, gm, checkpointed=recompute == "full")
        runs = core_runs(self.cores, nodes)
        return [(block, self.emitter._emit_nodes(run, gm, indent=2 + (block is not None))) for block, run in runs]

    def _checkpointed(self, written: list[list[tuple[Any, list[str]]]], loss_line: str) -> list[list[str]]:
        """Each stage's body; with recomputation, every repeated block becomes a nested function
        run under ``checkpoint`` (as ``codegen.spmd_recompute`` writes it for graph programs):
        backward keeps only what the block reads from outside and runs it again, collectives
        included. A block returns what any other part of the program reads."""
        # Names are unique across the whole program, so each stage's blocks are checked and
        # wrapped against everything the other stages and the loss line read too.
        loaded = [set().union(*(names_in(lines, ast.Load) for _, lines in runs)) for runs in written]
        bodies = []
        for stage, runs in enumerate(written):
            elsewhere = names_in([loss_line], ast.Load).union(*(loaded[i] for i in range(len(written)) if i != stage))
            if self.recompute[stage] == "none":
                bodies.append([line for _, lines in runs for line in lines])
            else:
                bodies.append(checkpoint_blocks(runs, also_read=elsewhere))
        return bodies

    def _recomputed(self, gm, names: list[str], value_of, stage: int) -> list[str]:
        """Lines computing again, in stage ``stage``, values an earlier stage computed locally
        (the same on every rank: positions, masks), with what they need."""
        wanted: set[str] = set()
        by_name = {n.name: n for n in gm.graph.nodes}
        stack = [value_of[n][0] for n in names]
        while stack:
            fx_name = stack.pop()
            if fx_name in wanted or by_name[fx_name].op != "call_function":
                continue
            wanted.add(fx_name)
            for arg in by_name[fx_name].all_input_nodes:
                stack.append(arg.name)
        nodes = [n for n in gm.graph.nodes if n.name in wanted]
        self.emitter.module = None
        lines = self.emitter._emit_nodes(nodes, gm, indent=2)
        return [_PAD + f"# computed again on stage {stage} (the same on every rank; cheaper than sending it)", *lines]

    def _boundary(self, name: str, value_of) -> _Boundary:
        em = self.emitter
        graph_input = next((i for i in self.graph.inputs if i.name == name), None)
        if graph_input is not None:
            return _Boundary(name, tuple(graph_input.meta.shape), graph_input.meta.dtype, tuple(em._input_placements(name)))
        fx_name, value = value_of[name]
        if value.kind != "dt":
            raise NotImplementedError(f"pipeline codegen cannot send '{name}' ({value.kind}) between stages")
        node = next(n for n in self.graph.graph_module.graph.nodes if n.name == fx_name)
        meta = node.meta.get("val")
        placements = value.placements if value.placements is not None else tuple(Replicate() for _ in self.axes)
        return _Boundary(name, tuple(int(d) for d in meta.shape), meta.dtype, tuple(whole(placements)))

    # ------------------------------------------------------------------------- sections

    def _header(self, stage_params, boundaries, info, shared) -> str:
        # The docstring is fixed text; what comes from the plan, the spec or the trace (names,
        # module paths) follows it as comments (codegen.source_text).
        lines = [
            '"""Per-rank program of a pipeline plan (which plan, model, stages and schedule: the comments below).',
            "",
            f"Generated by soap-planner {__version__} from plan.json; it is plain PyTorch, review it freely.",
            "The ranks at pp coordinate p run stage p (under the interleaved schedule, every stage s with",
            "s % pp == p). Inside each stage, forward() replays the model's",
            "traced ATen graph, one line per op, on DTensors over the stage mesh (shapes are one",
            "micro-batch's, global over the stage mesh; comments give this rank's part), and",
            "_to(x, placements) redistributes x with the collective named above it. PARAMETERS and",
            "INPUTS give placements, one per axis of the stage mesh (STAGE_AXES):",
            "S(d) = split on dim d, R = whole on every rank, P = partial sums to be added up.",
            "",
            "Use it in your own training loop:",
            "",
            "    from codegen.runtime import load_program",
            '    program = load_program("<this folder>")',
            "    mesh = program.build_mesh()",
            "    stage = program.parallelize(model, mesh)             # this rank's stage; model built alike everywhere",
            "    pipeline = program.module.make_pipeline(stage, mesh) # make_pipeline below: the schedule",
            "    optimizer = program.make_optimizer(stage, mesh, torch.optim.AdamW, lr=1e-3)",
            "    args, kwargs = program.shard_batch(args, kwargs, mesh)",
            "    loss = pipeline.step(args, kwargs)                   # forward + backward; the loss on every rank",
            "    optimizer.step()",
            '"""',
            "",
        ]
        return "\n".join(lines) + "\n" + about_plan(self.plan) + "".join(
            comment(line) + "\n" for line in self._description(stage_params, boundaries, info, shared)
        )

    def _description(self, stage_params, boundaries, info, shared) -> list[str]:
        """The header's account of this pipeline: stages, schedule, what crosses each boundary."""
        pipeline = self.plan.pipeline
        if self.stage_plan.padded:
            stage_mesh = "a one-rank dp axis (pp is the only axis: each rank holds its stage whole)"
        else:
            stage_mesh = " x ".join(f"{n}={size}" for n, size in zip(self.axes, self.sizes))
        lines = [
            *schedule_lines(self.plan),
            f"Stage mesh: {stage_mesh}.",
            *self._recompute_note(),
            "",
        ]
        for stage, owned in enumerate(stage_params):
            lines.append(f"Stage {stage} holds {_modules(owned)} ({len(owned)} parameters).")
        lines.append("")
        for k, names in enumerate(boundaries):
            lines.append(f"Stage {k} -> stage {k + 1} (send/recv over pp, one micro-batch; gradients come back the same way):")
            for name in names:
                b = info[name]
                lines.append(f"    {name}: {notes.value_note(b.shape, b.placements, self.axes, self.sizes)}{_dtype(b.dtype)}")
        lines += [
            "",
            f"Stage {self.stages - 1} returns the model's loss of each micro-batch; the schedule back-propagates it, the runner",
            f"divides each summed gradient by {pipeline.micro_batches} once, so the step equals one device's on the whole batch.",
        ]
        for holders, names in shared.items():
            lines.append(
                f"Held by stages {', '.join(map(str, holders))} (tied): {', '.join(names)}; their gradients are all-reduced "
                f"over those stages after backward."
            )
        if self.emitter.warning:
            lines += ["", f"WARNING: {self.emitter.warning}"]
        if self.emitter.fallbacks:
            lines += ["", f"Run around DTensor's sharding rules: {', '.join(sorted(self.emitter.fallbacks))}."]
        return lines

    def _autocast(self) -> str:
        """Lines of ``parallelize`` running each stage of this rank under bf16 autocast."""
        lines = autocast_lines(self.plan, "stage", "mesh.device_type")
        return "    for stage in module.local_stages:\n" + textwrap.indent(lines, "    ") if lines else ""

    def _recompute_note(self) -> list[str]:
        """The header's lines on activation recomputation (per stage when stages differ)."""
        modes = set(self.recompute)
        if len(modes) > 1:
            # Stages holding more micro-batches in flight (the first ones, under 1F1B) need
            # to recompute where later ones need not: the planner chose each stage's mode.
            words = {
                "full": "every repeated block recomputed in backward (activation checkpointing)",
                "selective": "each block's attention core recomputed in backward (selective recomputation)",
                "none": "no recomputation",
            }
            lines = ["Recomputation differs by stage (the planner chose each stage's to fit its memory):"]
            lines += [f"    stage {stage}: {words[mode]}" for stage, mode in enumerate(self.recompute)]
            if "selective" in modes and not self.cores:
                lines += [line.removeprefix("# ") for line in NO_CORE_COMMENT]
            return lines
        mode = self.recompute[0]
        if mode == "full":
            return ["Every repeated block is recomputed in backward (activation checkpointing)."]
        if mode == "selective" and self.cores:
            return ["Each block's attention core is recomputed in backward (selective recomputation)."]
        if mode == "selective":
            return [line.removeprefix("# ") for line in NO_CORE_COMMENT]
        return []

    def _imports(self) -> str:
        pipeline = self.plan.pipeline
        return "\n".join(
            [
                "from __future__ import annotations",
                "",
                "import torch",
                "from torch.distributed.device_mesh import DeviceMesh",
                "from torch.distributed.tensor import Partial, Replicate, Shard",
                *(["from torch.utils.checkpoint import checkpoint"] if set(self.recompute) != {"none"} else []),
                "",
                "from codegen.runtime.pipeline import PipelineRunner, PipelineStageModule, VirtualStages, build_stage, stage_mesh",
                *precision_imports(self.plan),
                *([SHARDED_STATES_IMPORT] if shards_optimizer_states(self.plan) else []),
                "from codegen.runtime.spmd import shard_inputs",
                "",
                "aten = torch.ops.aten",
                f"MESH_AXES = {tuple(self.plan.mesh.axes)!r}",
                f"STAGE_AXES = {tuple(self.stage_plan.mesh.axes)!r}  # the mesh inside a stage",
                f"GLOBAL_BATCH = {number(self.plan.batch_size, 'batch_size')}",
                f"MICRO_BATCHES = {number(pipeline.micro_batches, 'pipeline.micro_batches')}",
                f"SCHEDULE = {pipeline.schedule!r}",
                "",
            ]
        )

    def _io_tables(self, stage_inputs, stage_outputs, loss_name: str, loss_shape) -> str:
        em = self.emitter

        def entry(b: _Boundary) -> str:
            return f"({b.name!r}, {b.shape!r}, {b.dtype}, {em.constant(b.placements)})"

        lines = [
            "",
            "# What each stage receives and sends for one micro-batch: (name, shape over the stage mesh,",
            "# dtype, placements). Stage 0 receives the model's inputs; the last stage sends the loss.",
            "STAGE_INPUTS = (",
        ]
        for stage, entries in enumerate(stage_inputs):
            lines.append(f"    ({''.join(entry(b) + ', ' for b in entries)}),  # stage {stage}")
        lines += [")", "STAGE_OUTPUTS = ("]
        for stage, entries in enumerate(stage_outputs):
            lines.append(f"    ({''.join(entry(b) + ', ' for b in entries)}),  # stage {stage}")
        lines.append(f"    (({loss_name!r}, {tuple(loss_shape)!r}, torch.float32, None),),  # stage {len(stage_outputs)}: the loss")
        lines += [")", ""]
        return "\n".join(lines)

    def _class(self, stage, class_name, nodes, incoming, outgoing, info, input_lines, param_lines, extra, body, loss_line, owned) -> str:
        em = self.emitter
        signature = ", ".join(["self", *(identifier(name, "a value sent between pipeline stages") for name in incoming)])
        lines = [
            "",
            "",
            comment(f"Stage {stage} of {self.stages}: {_modules(owned)}."),
            f"class {class_name}(PipelineStageModule):",
            f'    """Stage {stage} of the pipeline (its modules: the comment above)."""',
            "",
            f"    def forward({signature}):",
            "        _to, params = self._to, self.params",
        ]
        if input_lines is not None:
            lines.append("        # Inputs: this rank's part of one micro-batch, as DTensors.")
            lines += input_lines
        else:
            lines.append(f"        # From stage {stage - 1}: this rank's local parts, as DTensors again.")
            for name in incoming:
                b = info[name]
                note = notes.value_note(b.shape, b.placements, self.axes, self.sizes)
                name = identifier(name, "a value sent between pipeline stages")
                lines.append(with_comment(f"        {name} = self.receive({name}, {em.constant(b.placements)}, {b.shape!r})", note))
        if param_lines:
            lines.append("        # This stage's parameters (DTensors; qualified names in PARAMETERS).")
            lines += param_lines
        lines += extra
        lines += body
        lines.append("")
        if outgoing is None:
            lines.append(_PAD + "# The model's loss of this micro-batch (the full value on every rank of the stage).")
            lines.append(loss_line)
        else:
            lines.append(_PAD + f"# To stage {stage + 1}: local parts, laid out as STAGE_OUTPUTS[{stage}] says.")
            sends = [f"self.send({name}, {em.constant(info[name].placements)})" for name in outgoing]
            lines.append(_PAD + "return (" + ", ".join(sends) + ("," if len(sends) == 1 else "") + ")")
        return "\n".join(lines)

    def _functions(self, class_names, stage_params, shared, input_names) -> str:
        def names(stage: int, owned: list[str]) -> str:
            if not owned:
                return f"    (),  # stage {stage}"
            return f"    (  # stage {stage}\n" + "\n".join(_packed([repr(name) + "," for name in owned], 110, 8)) + "\n    ),"

        params = "\n".join(names(s, owned) for s, owned in enumerate(stage_params))
        shared_text = "{" + ", ".join(f"{holders!r}: {tuple(names)!r}" for holders, names in shared.items()) + "}"
        return f'''

STAGES = ({", ".join(class_names)}{"," if len(class_names) == 1 else ""})  # {stages_comment(self.plan.pipeline)}
# The parameters each stage holds (qualified names), and those several stages hold (tied).
STAGE_PARAMETERS = (
{params}
)
SHARED_PARAMETERS = {shared_text}
INPUT_NAMES = {tuple(input_names)!r}


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> PipelineStageModule | VirtualStages:
    """This rank's stage (its pp coordinate; several under the interleaved schedule, in
    VirtualStages): the stage's parameters become DTensors over the stage mesh, placed as
    PARAMETERS says (each rank keeps its shard; no communication)."""
    module = build_stage(STAGES, model, mesh, PARAMETERS, STAGE_PARAMETERS, DROPOUT_MODULES)
{self._autocast()}    return module


def shard_batch(args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """This rank's part of one global batch over the stage mesh, as INPUTS says (every rank
    holds the whole batch; no communication). The schedule cuts it into MICRO_BATCHES."""
    return shard_inputs(args, kwargs, stage_mesh(mesh), INPUTS)


def make_pipeline(module: PipelineStageModule | VirtualStages, mesh: DeviceMesh) -> PipelineRunner:
    """The SCHEDULE over this rank's stage: pipeline.step(args, kwargs) runs one step's
    forward and backward over MICRO_BATCHES micro-batches and returns the loss."""
    return PipelineRunner(module, mesh, SCHEDULE, MICRO_BATCHES, STAGE_INPUTS, STAGE_OUTPUTS, INPUT_NAMES, SHARED_PARAMETERS)
''' + sharded_states_function(self.plan)


# ------------------------------------------------------------------------------ helpers


def _packed(items: list[str], width: int, indent: int) -> list[str]:
    """``items`` (source text, each kept whole) packed into lines of at most ``width``
    characters; unlike ``textwrap``, never breaks inside an item (a string literal)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 1 + len(item) <= width:
            lines[-1] += " " + item
        else:
            lines.append(" " * indent + item)
    return lines


def _lines_by_name(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        match = re.match(r"\s*(\w+) = ", line)
        if match:
            found[match[1]] = line
    return found


def _modules(params: list[str]) -> str:
    """The modules that own ``params``, at the depth of a layer: ``tok_emb, blocks.0, ...``."""
    found: list[str] = []
    for name in params:
        parts = clean_path(name).split(".")[:-1]
        cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        path = ".".join(parts[: cut + 1] if cut is not None else parts[:2]) or "(top level)"
        if path not in found:
            found.append(path)
    return ", ".join(found) if found else "no parameters"


def _dtype(dtype: torch.dtype) -> str:
    text = str(dtype).removeprefix("torch.")
    return "" if text == "float32" else f" ({text})"
