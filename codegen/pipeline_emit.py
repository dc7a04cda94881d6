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
  their gradients over those stages;
- each repeated block is written once, as a module-level function the stages call per layer
  (``codegen.block_fold``; blocks under selective recomputation stay written out).

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
import re
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Replicate

from codegen.plan_checks import checked_plan
from codegen.source_text import identifier
from codegen.graph_facts import build_meta_model, model_facts, trace_model
from codegen.micro_batch_source import first_samples
from codegen.micro_strategies import micro_strategies
from codegen.pipeline_stage_plan import StagePlan, flat_source
from codegen.pipeline_schedules import schedule_problem, stage_count
from codegen.spmd_emit import SUPPORTED_AXES
from codegen.pipeline_moe_emit import StageMoEEmitter, moe_calls, stage_experts_table
from codegen.spmd_placements import whole
from codegen.attention_core import attention_cores
from codegen.pipeline_sections import Boundary, PipelineSections
from codegen.block_fold import BlockFolder, emit_block_runs, forward_locals, placeholder_table
from codegen.spmd_recompute import assigned_in_order, checkpoint_blocks, core_runs, names_in
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import KEEP_A2A, RECOMPUTE_MODES, WHOLE_BLOCK_RECOMPUTE

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
    if plan.recompute not in RECOMPUTE_MODES:
        return f"pipeline programs recompute none, full blocks or selectively, not {plan.recompute!r}"
    if not plan.expert_layouts and any(plan.recompute_at(s) == KEEP_A2A for s in range(stage_count(pipeline))):
        return f"recompute {KEEP_A2A!r} keeps MoE layers' exchanges, and this pipeline has no MoE layer; plan with recompute full"
    dp = plan.mesh.axis_size("dp") if "dp" in names else 1
    folded = "moe-folding" in plan.sections  # experts over each stage's dp x tp (planner.families.moe_folding)
    if plan.expert_layouts and names != ((PP_AXIS, "dp", "tp") if folded else (PP_AXIS, "dp")):
        return (f"MoE layers run inside pipeline stages over dp alone (a pp x dp mesh), or folded over dp x tp (a pp x "
                f"dp x tp mesh); this mesh is {plan.mesh}")
    if folded and (plan.sections["moe-folding"].sequence_parallel
                   or any(layout.tensor_parallel != 1 for layout in plan.expert_layouts)):
        return ("folded MoE layers inside pipeline stages run whole experts (ETP 1) without sequence parallelism; "
                "re-plan with ETP 1 and sequence_parallel false")
    for layout in plan.expert_layouts:
        if layout.mode not in ("expert_parallel", "data_parallel") or layout.sharded_copies or layout.all_to_all != "flat":
            return (f"MoE layers inside pipeline stages run expert parallel (flat all-to-all, whole copies) or data "
                    f"parallel; layer {layout.module!r} is {layout.mode}, {layout.all_to_all}"
                    f"{', sharded copies' if layout.sharded_copies else ''}")
    if plan.batch_size % (pipeline.micro_batches * dp):
        return f"the batch {plan.batch_size} does not split into {pipeline.micro_batches} micro-batches on each of dp={dp} ranks"
    return None


def supports(plan: Plan) -> bool:
    """Whether this emitter compiles ``plan`` (see ``unsupported``)."""
    return unsupported(plan) is None


def compile_pipeline_plan(plan: Plan) -> str:
    """The emitter part of the ``pipeline`` family (``planner.families``): the plan's names
    checked against its model (``codegen.plan_checks``), then ``render_pipeline_program``."""
    return render_pipeline_program(checked_plan(plan, graph_program=True))


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


class _PipelineWriter(PipelineSections):
    """Writes one pipeline program from an ``GraphEmitter`` over the stage plan."""

    def __init__(self, plan: Plan, stage_plan: StagePlan, graph: OpGraph, facts, observed, forced, warning: str):
        self.plan, self.stage_plan, self.graph, self.facts = plan, stage_plan, graph, facts
        # Every value stays a DTensor: what crosses a stage boundary is read from DTensor values.
        # MoE layers run by their layouts, each written as one call (codegen.pipeline_moe_emit).
        calls = moe_calls(plan, graph) if plan.expert_layouts else {}
        self.emitter = StageMoEEmitter(stage_plan, graph, facts, observed, forced, warning, local_replicated=False,
                                       calls=calls)
        if calls:
            stage_of = {s.node: s.stage for s in stage_plan.strategies}
            for call in calls.values():
                stages = {stage_of[name] for name in call.nodes if name in stage_of}
                if len(stages) != 1:
                    raise NotImplementedError(f"MoE layer {call.path!r} is cut between pipeline stages {sorted(stages)}")
            self.expert_table = stage_experts_table(plan, graph, {path: stage_of[call.at] for path, call in calls.items()})
        self.stages = stage_count(plan.pipeline)  # stage modules: pp x virtual stages (interleaved)
        self.axes, self.sizes = stage_plan.mesh.names, stage_plan.mesh.shape
        # Per stage module: "none", "full" (whole blocks), "full_keep_a2a" (whole blocks, their MoE
        # layers' exchanges kept) or "selective" (attention cores).
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
        """A stage's lines, as runs of one repeated block (or none): the runs of blocks or,
        under selective recomputation, of attention cores; with recomputation each such run
        is indented one more level, to become a nested function where it stays written out."""
        if recompute == "selective" and not self.cores:
            return [(None, self.emitter._emit_nodes(nodes, gm, indent=2))]
        if recompute != "selective":
            return emit_block_runs(self.emitter, nodes, gm, checkpointed=recompute in WHOLE_BLOCK_RECOMPUTE)
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
                bodies.append(checkpoint_blocks(runs, also_read=elsewhere, keep_exchanges=self.recompute[stage] == KEEP_A2A))
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

    def _boundary(self, name: str, value_of) -> Boundary:
        em = self.emitter
        graph_input = next((i for i in self.graph.inputs if i.name == name), None)
        if graph_input is not None:
            return Boundary(name, tuple(graph_input.meta.shape), graph_input.meta.dtype, tuple(em._input_placements(name)))
        fx_name, value = value_of[name]
        if value.kind != "dt":
            raise NotImplementedError(f"pipeline codegen cannot send '{name}' ({value.kind}) between stages")
        node = next(n for n in self.graph.graph_module.graph.nodes if n.name == fx_name)
        meta = node.meta.get("val")
        placements = value.placements if value.placements is not None else tuple(Replicate() for _ in self.axes)
        return Boundary(name, tuple(int(d) for d in meta.shape), meta.dtype, tuple(whole(placements)))

    # ------------------------------------------------------------------------- sections

def _lines_by_name(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        match = re.match(r"\s*(\w+) = ", line)
        if match:
            found[match[1]] = line
    return found
