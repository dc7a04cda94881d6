"""Write ``model_spmd.py`` for any plan on a ``dp``/``tp`` mesh, from the traced graph.

The program replays the model's exported ATen graph, one line per op, on DTensors
(``torch.distributed.tensor``): parameters are placed as the plan says, inputs become
DTensors holding this rank's slice of the batch, and wherever the plan says an op reads a
value differently from how its producer left it, ``_to`` redistributes it with the
collective named in a comment (all-gather, all-reduce, reduce-scatter, all-to-all). DTensor's
own sharding rules run each op, so the result equals one device whatever the placements;
the plan decides where the communication happens. ``codegen.runtime.spmd`` holds the
helpers the program calls. Each repeated block is written once, as a function called per
layer (``codegen.block_fold``); the compile-time dry run reads a version written out.

Details of the exported graph handled here:

- names come from the graph (``linear_2``, ``p_blocks_0_mlp_c_fc_weight``), which export takes
  from the model's modules; each module's ops sit under a comment naming it;
- values DTensor never touches (positions and masks built from ``arange``) stay plain tensors,
  the same on every rank, and become replicated DTensors where they meet DTensors;
- factory ops traced on the meta device run on this rank's device; export's
  ``_assert_tensor_metadata`` checks (which name the meta device) are dropped;
- higher-order ops (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``, e.g. rotary
  embeddings) are inlined under the grad/autocast mode they record;
- dropout reads its module's ``p`` at run time, so ``module.p = 0`` switches it off as in the model;
- an op DTensor has no sharding rule for runs as its ATen decomposition, or on replicated
  inputs, with a comment saying so; attention runs the math kernel on CPU (DTensor has no
  rule for the CPU flash kernel), or the local shards when only batch and heads are split;
- a node with a SUMMA layout (a linear or a block-layout layer norm) is one call into
  ``codegen.runtime.summa_layouts``, written by ``codegen.summa_emit``.
"""

from __future__ import annotations

import dataclasses
import keyword
import operator
from typing import Any, Sequence

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard

from codegen import spmd_notes as notes
from codegen.micro_batch_source import first_micro_batch_only, first_samples
from codegen.micro_strategies import micro_strategies
from codegen.source_text import comment, identifier, with_comment
from codegen.spmd_literals import Code, callee_source, literal_argument
from codegen.spmd_placements import (
    Value,
    all_replicate,
    dropout_without_partials,
    held_over_dp,
    planned_input,
    same,
    splits_rows,
    whole,
)
from codegen.attention_core import attention_cores
from codegen.block_fold import folded_body
from codegen.causal_attention import CAUSAL_KERNEL_COMMENT, causal_arguments, runs_causal_kernel
from codegen import summa_emit
from codegen.spmd_recompute import checkpointed_body, selective_body
from codegen.spmd_sections import ProgramSections
from codegen.spmd_structure import DROPPED_CHECKS, GraphStructure
from codegen.dry_run import WRONG_LOCAL_SHAPE
from codegen.plan_checks import checked_plan
from codegen.graph_facts import (
    ATTENTION,
    DROPOUTS,
    ModelFacts,
    attention_dropout,
    build_meta_model,
    drop_path_keep,
    dtensor_support,
    model_facts,
    trace_model,
)
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import NodeStrategy, Placements, placements_str

SUPPORTED_AXES = ("dp", "tp")

_RESERVED = {"self", "aten", "torch", "_to", "params", "operator", "DTensor", "Replicate", "Shard", "Partial"}


def supports(plan: Plan) -> bool:
    """Whether this emitter compiles ``plan``: a ``dp``/``tp`` mesh, or a SUMMA plan's
    ``dp``/``row``/``col``/``dep`` mesh (``codegen.summa_emit``), no pipeline."""
    axes = SUPPORTED_AXES + (summa_emit.SUMMA_AXES if summa_emit.uses_summa(plan) else ())
    return plan.pipeline is None and set(plan.mesh.names) <= set(axes)


def compile_graph_plan(plan: Plan) -> str:
    """The emitter part of the ``tp`` and ``summa`` families (``planner.families``), and of
    any plan replayed op by op: the plan's names checked against its model
    (``codegen.plan_checks``), then ``render_graph_program``."""
    plan = checked_plan(plan, graph_program=True)
    if not supports(plan):
        raise NotImplementedError(
            f"codegen for mesh {plan.mesh} is not written yet; meshes with axes among dp and tp (no pipeline) "
            f"and SUMMA meshes are"
        )
    return render_graph_program(plan)


def render_graph_program(plan: Plan) -> str:
    """Source of ``model_spmd.py`` for ``plan`` (see the module docstring).

    Raises:
        NotImplementedError: the mesh has axes other than ``dp``/``tp``, a pipeline, or the
            graph holds something this emitter cannot write (named in the message).
        PlanningError: the plan has no model spec, or its strategies do not match the model.
    """
    if not supports(plan):
        raise NotImplementedError(
            f"graph codegen handles meshes with axes among {SUPPORTED_AXES} and no pipeline; this plan has mesh {plan.mesh}"
            f"{' and a pipeline' if plan.pipeline else ''}"
        )
    if plan.model is None:
        raise PlanningError("this plan has no model spec, so its model cannot be traced to generate the program")
    model, args, kwargs = build_meta_model(plan)
    steps = plan.accumulation_steps
    if steps > 1:
        # Gradient accumulation: the program runs one micro-batch at a time, so it is written
        # from the graph traced at one (the shapes its views and reshapes name).
        micro = plan.batch_size // steps
        args, kwargs = first_samples(args, kwargs, plan.batch_size, micro)
        graph = trace_model(model, args, kwargs)
        plan = dataclasses.replace(plan, strategies=micro_strategies(plan, graph, micro), graph=graph)
    else:
        graph = plan.graph if plan.graph is not None and plan.graph.graph_module is not None else trace_model(model, args, kwargs)
    summa_emit.check_plan(plan, graph)
    facts = model_facts(model, args, kwargs, graph)

    def write(
        observed: dict[str, Any] | None = None, forced: dict[str, str] | None = None, warning: str = "", final: bool = True
    ) -> str:
        # The dry run reads the forward's own locals, so it runs a version without the block
        # functions and the recomputed blocks' nested functions (each block written out);
        # checkpointing changes no placement. It runs
        # one micro-batch of the example batch when the plan accumulates gradients.
        if final:
            summa_emit.refuse_forced(plan, forced or {})  # a SUMMA op the dry run could not run
        source = GraphEmitter(
            plan, graph, facts, observed, forced, warning, recompute=plan.recompute if final else "none", fold=final
        ).render()
        return source if final or steps == 1 else source + first_micro_batch_only(micro)

    from codegen import dry_run

    # Run the program once on meta tensors (a fake process group), then write it again from
    # what DTensor actually produced, so redistributions and comments say what happens.
    return dry_run.refine(
        plan, lambda observed, forced: write(observed, forced, final=False), write, dry_run.traced_shapes(graph.graph_module)
    )


# ------------------------------------------------------------------------------ emitter


class GraphEmitter(GraphStructure, ProgramSections):
    """Writes one program. ``observed`` (Python name -> placements, from a dry run of an
    earlier version of the program) replaces the plan's output placements where DTensor
    produced others; ``forced`` names ops to run on whole inputs (DTensor failed on them)."""

    def __init__(
        self,
        plan: Plan,
        graph: OpGraph,
        facts: ModelFacts,
        observed: dict[str, Any] | None = None,
        forced: dict[str, str] | None = None,
        warning: str = "",
        recompute: str = "none",
        local_replicated: bool = True,
        fold: bool = False,
    ):
        self.plan, self.graph, self.facts = plan, graph, facts
        self.recompute = recompute
        self.fold = fold  # each repeated block written once (codegen.block_fold)
        self.local_replicated = local_replicated
        self.localized: dict[str, str] = {}  # DTensor value -> name of its local tensor
        self.params_read_locally: set[str] = set()
        self.params_read_as_dtensors: set[str] = set()
        self.warning = warning
        self.observed = observed or {}
        self.forced = dict(forced or {})
        self.axes, self.sizes = plan.mesh.names, plan.mesh.shape
        self.strategies = {s.node: s for s in plan.strategies}
        self._check_strategies()
        self.constants: dict[Placements, str] = {}
        self.values: dict[str, Value] = {}
        self.used_names: set[str] = set(_RESERVED)
        self.param_of_placeholder: dict[str, str] = {}
        for node in graph.nodes:
            self.param_of_placeholder.update(zip(node.param_inputs, node.params))
        self.param_placements = self._parameter_placements()
        self.fallbacks: set[str] = set()  # "op (how)" for ops run around DTensor's rules, for the header
        self.module = None
        self._renames: dict[str, str] = {}  # inner names of an inlined subgraph -> unique names
        self.resharded: dict[tuple[str, Placements], str] = {}  # (value, placements) -> name of its redistributed copy
        self._operand_placements: list[tuple[str, Any]] = []

    # ---------------------------------------------------------------- checks and tables

    def _check_strategies(self) -> None:
        missing = [node.name for node in self.graph.nodes if node.name not in self.strategies]
        if missing:
            raise PlanningError(
                f"the plan has no strategy for {len(missing)} op(s) of the traced model (first: '{missing[0]}'); "
                f"the plan was made for another version of the model or of the tracer: plan it again"
            )
        ndim = len(self.axes)
        for strategy in self.plan.strategies:
            for placements in (*strategy.inputs, *strategy.outputs, *strategy.params.values()):
                if len(placements) != ndim:
                    raise PlanningError(
                        f"node '{strategy.node}' has placements {placements_str(placements)} but the mesh {self.plan.mesh} "
                        f"has {ndim} axes; each tensor needs one placement per mesh axis"
                    )

    def _parameter_placements(self) -> dict[str, Placements]:
        """Qualified parameter name -> how each rank holds it: the placements of its first
        reader (a later reader that wants another layout redistributes it)."""
        placements: dict[str, Placements] = {}
        for node in self.graph.nodes:
            strategy = self.strategies[node.name]
            for name in node.params:
                if name in self.graph.parameters and name in strategy.params:
                    placements.setdefault(name, whole(strategy.params[name]))
        replicate = tuple(Replicate() for _ in self.axes)
        for name in self.graph.parameters:
            placements.setdefault(name, replicate)
        # ZeRO-2/FSDP: held split over dp between uses; each reader gathers it (held_over_dp).
        flavour = self.plan.dp_flavour
        return {
            name: held_over_dp(held, self.graph.parameters[name].shape, self.axes, self.sizes, flavour)
            for name, held in placements.items()
        }

    def constant(self, placements: Placements) -> str:
        placements = tuple(placements)
        if placements not in self.constants:
            self.constants[placements] = identifier(notes.constant_name(placements, self.axes), "a placements constant")
        return self.constants[placements]

    def fresh(self, name: str) -> str:
        base = name if name.isidentifier() and name not in self.used_names else f"{name}_"
        candidate, index = base, 1
        while candidate in self.used_names or not candidate.isidentifier() or keyword.iskeyword(candidate):
            candidate, index = f"{base}{index}", index + 1
        self.used_names.add(candidate)
        return candidate

    # ------------------------------------------------------------------------- render

    def render(self) -> str:
        gm = self.graph.graph_module
        for fx_node in gm.graph.nodes:
            self.used_names.add(identifier(fx_node.name, "a traced graph node"))  # every value is named after one
        inputs = [i for i in self.graph.inputs]
        input_lines = self._input_lines(gm)
        param_lines = self._parameter_lines(gm)
        blocks = ""
        if self.recompute == "selective":  # each block's attention core (codegen.attention_core)
            body = selective_body(self, gm, attention_cores(self.graph, self.plan.summary.tokens_per_sample))
        elif not self.fold:
            body = checkpointed_body(self, gm) if self.recompute == "full" else self._emit_nodes(list(gm.graph.nodes), gm, indent=2)
        else:
            body, param_lines, blocks = folded_body(self, gm, [i.name for i in inputs], input_lines, param_lines)
        return "\n".join(
            [
                self._header(),
                self._imports(),
                self._tables(),
                self._class(inputs, input_lines, param_lines, body) + blocks,
                self._functions(),
            ]
        )





    def _emit_nodes(self, fx_nodes: Sequence[torch.fx.Node], gm: torch.fx.GraphModule, indent: int, inner: bool = False) -> list[str]:
        lines: list[str] = []
        for fx_node in fx_nodes:
            if fx_node.op in ("placeholder", "get_attr"):
                continue
            if fx_node.op == "output":
                if not inner:
                    lines += self._return(fx_node, indent)
                continue
            if fx_node.op != "call_function":
                raise NotImplementedError(f"graph codegen cannot write fx node '{fx_node.name}' ({fx_node.op})")
            if not inner:
                lines += self._module_header(fx_node, indent)
            target = fx_node.target
            if target is operator.getitem:
                lines += self._getitem(fx_node, indent)
            elif isinstance(target, torch._ops.HigherOrderOperator):
                lines += self._higher_order(fx_node, gm, indent)
            elif isinstance(target, torch._ops.OpOverload):
                if str(target).startswith(DROPPED_CHECKS):
                    continue  # export's checks that a tensor is on the meta device
                lines += self._op(fx_node, indent, inner)
            else:
                raise NotImplementedError(
                    f"graph codegen cannot write '{fx_node.name}' ({getattr(target, '__name__', target)}): not an ATen op"
                )
        return lines

    def _op(self, fx_node: torch.fx.Node, indent: int, inner: bool) -> list[str]:
        pad = " " * (4 * indent)
        op = str(fx_node.target)
        strategy = None if inner else self.strategies.get(fx_node.name)
        opnode = None if inner else self.graph.node(fx_node.name)
        name = self._renames.get(fx_node.name, fx_node.name)
        arg_nodes: list[torch.fx.Node] = []
        torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), arg_nodes.append)
        on_dtensors = any(self.values[a.name].kind in ("dt", "seq_dt") for a in arg_nodes)
        local = on_dtensors and self._runs_locally(name, arg_nodes, strategy, opnode)
        on_dtensors = on_dtensors and not local

        comments: list[str] = []
        args, kwargs = self._op_arguments(fx_node, op)
        if op.startswith(ATTENTION) and runs_causal_kernel(op, opnode, strategy):
            args, kwargs = causal_arguments(op, args, kwargs)
            comments.append(CAUSAL_KERNEL_COMMENT)
        if on_dtensors and op.startswith(DROPOUTS) and strategy is not None and strategy.inputs:
            strategy = dropout_without_partials(strategy, self._read_as(fx_node), comments)

        def render(value: Any) -> str:
            if isinstance(value, torch.fx.Node):
                if local and self.values[value.name].kind == "dt":
                    return self._local(self.values[value.name], comments)
                return self._operand(value, on_dtensors, strategy, opnode, fx_node, comments)
            if isinstance(value, Code):
                return value.text
            if isinstance(value, list):
                return "[" + ", ".join(render(v) for v in value) + "]"
            if isinstance(value, tuple):
                return "(" + ", ".join(render(v) for v in value) + ("," if len(value) == 1 else "") + ")"
            return literal_argument(value)

        self._operand_placements: list[tuple[str, Any]] = []
        rendered = [render(a) for a in args] + [f"{key}={render(v)}" for key, v in kwargs.items()]
        callee = callee_source(fx_node.target)
        support = dtensor_support(fx_node.target) if on_dtensors else "plain"
        if on_dtensors and name in self.forced:
            error = self.forced[name]
            where = "its backward" if error.startswith("in backward") else "it"
            kind = error.removeprefix("in backward: ").split(":", 1)[0]
            if error.startswith(WRONG_LOCAL_SHAPE):
                comments.append(
                    comment(
                        f"DTensor runs {notes.short_op(op)} on these placements but gets it wrong: in the compile-time "
                        f"dry run its {error.removeprefix(WRONG_LOCAL_SHAPE + ': ')}; run it on inputs gathered whole"
                    )
                )
            else:
                comments.append(
                    comment(
                        f"DTensor cannot run {notes.short_op(op)} on these placements ({where} failed in the compile-time "
                        f"dry run with {kind}): run it on inputs gathered whole"
                    )
                )
            self.fallbacks.add(f"{notes.short_op(op)} (on whole inputs)")
            call = f"self._replicated({callee}, {', '.join(rendered)})"
        elif on_dtensors and op.startswith(ATTENTION):
            comments.append(
                "# self.attention: fused on CUDA; on CPU the local shards when split only on batch and heads, "
                "else the math kernel (DTensor has no rule for CPU flash attention)"
            )
            call = f"self.attention({callee}, {', '.join(rendered)})"
        elif on_dtensors and op == "aten.cross_entropy_loss.default" and classes_split(strategy):
            comments.append(
                "# vocabulary-parallel cross entropy (loss_parallel): each row's max, sum of exponentials and target "
                "logit are all-reduced over the ranks holding its classes; the logits are never gathered"
            )
            call = f"self.vocabulary_parallel_cross_entropy({callee}, {', '.join(rendered)})"
        elif on_dtensors and op == "aten.cross_entropy_loss.default" and _targets_split(strategy):
            comments.append(
                "# a mean over the targets of every rank: the sum of the losses and the count of targets that are not "
                "ignore_index, each summed over ranks (ranks may hold different counts of ignored targets)"
            )
            call = f"self.token_mean_cross_entropy({callee}, {', '.join(rendered)})"
        elif on_dtensors and summa_emit.runs_summa(strategy):  # a SUMMA matmul or block-layout norm
            call = summa_emit.node_call(strategy, fx_node, rendered, comments, self.axes, self.sizes)
        elif support in ("decomposition", "none"):
            helper = "self._decomposed" if support == "decomposition" else "self._replicated"
            how = "its ATen decomposition on the shards" if support == "decomposition" else "on inputs gathered whole (Replicate)"
            comments.append(comment(f"DTensor has no sharding rule for {notes.short_op(op)}: run {how}"))
            self.fallbacks.add(f"{notes.short_op(op)} ({'its decomposition' if support == 'decomposition' else 'on whole inputs'})")
            call = f"{helper}({callee}, {', '.join(rendered)})"
        else:
            call = f"{callee}({', '.join(rendered)})"
        if on_dtensors and op.startswith("aten.embedding.") and splits_rows(strategy):
            comments.append("# vocabulary-parallel lookup: tokens outside this rank's rows give zeros, so the result is partial sums")
            call = f"self.unmasked({call})"

        val = fx_node.meta.get("val")
        multi = isinstance(val, (list, tuple))
        kind = ("seq_dt" if multi else "dt") if on_dtensors else ("seq_plain" if multi else "plain")
        if val is None or (not isinstance(val, torch.Tensor) and not multi):
            kind = "other"
        # The op's own result: ``produced`` when the plan reshards it into ``outputs`` (its
        # consumers then redistribute it as they read it, e.g. a reduce-scatter).
        planned = self._planned_output(strategy, multi, produced=True) if on_dtensors else None
        placements = planned
        actual = self.observed.get(name) if on_dtensors else None
        if actual is not None and kind in ("dt", "seq_dt"):
            placements = list(actual) if multi else actual
            reference = planned[0] if (multi and planned) else planned
            seen = actual[0] if multi else actual
            if reference is not None and seen is not None and not same(seen, reference) and name not in self.forced:
                comments.append(self._divergence(op, seen, reference))
        note = self._note(fx_node, placements if on_dtensors else None) if kind in ("dt", "plain") else ""
        if multi and on_dtensors and placements and placements[0] is not None:
            note = f"{len(val)} pieces, each {notes.describe(placements[0], self.axes)}"

        lines = [pad + text for text in comments]
        statement = with_comment(f"{name} = {call}", note)
        lines.append(pad + statement)
        self.values[fx_node.name] = Value(name, kind, placements)
        return lines

    def _runs_locally(self, name: str, arg_nodes: list[torch.fx.Node], strategy, opnode) -> bool:
        """Whether an op on DTensors runs on this rank's local tensors instead: everything it
        reads, as held and as the plan reads it, and everything it makes is whole on every
        mesh axis, so each rank computes the same full result; plain PyTorch does that without
        DTensor's per-op dispatch (and with the fast kernels DTensor has no rule for, e.g.
        CPU flash attention)."""
        if not self.local_replicated or strategy is None or name in self.forced:
            return False
        for arg in arg_nodes:
            value = self.values[arg.name]
            if value.kind == "seq_dt":
                return False
            if value.kind != "dt":
                continue
            # Placements the plan gives an op's result are what DTensor makes only once a dry
            # run has seen it do so.
            known = value.exact or value.param is not None or value.expr in self.observed
            wanted = planned_input(strategy, opnode, arg.name)
            if not known or not all_replicate(value.placements) or (wanted is not None and not all_replicate(wanted)):
                return False
        outputs = strategy.produced or strategy.outputs
        return bool(outputs) and all(all_replicate(p) for p in outputs)

    def _local(self, value: Value, comments: list[str]) -> str:
        """The local tensor of a replicated DTensor (the whole value; no communication). Its
        gradient comes back as a replicated DTensor's, reduced first if it is partial."""
        if value.expr not in self.localized:
            name = self.fresh(f"{value.expr}_local")
            if value.param:
                # A weight read only by such ops stays a plain tensor (LOCAL_PARAMETERS).
                self.params_read_locally.add(value.param)
                comments.append(f"{name} = self.local({value.expr})  # whole on every rank: plain PyTorch")
            else:
                comments.append(f"{name} = {value.expr}.to_local()  # whole on every rank: runs as plain PyTorch from here")
            self.localized[value.expr] = name
        return self.localized[value.expr]

    def local_parameters(self) -> list[str]:
        """Parameters every reader of which runs on local tensors: they stay plain tensors
        (the same on every rank, their gradients too), so no DTensor dispatch touches them,
        in the optimizer neither."""
        return [name for name in self.param_placements if name in self.params_read_locally - self.params_read_as_dtensors]

    def _read_as(self, fx_node: torch.fx.Node) -> Placements | None:
        """How the first consumer with a plan reads ``fx_node``'s result."""
        for user in fx_node.users:
            if user.name in self.strategies:
                wanted = planned_input(self.strategies[user.name], self.graph.node(user.name), fx_node.name)
                if wanted is not None:
                    return wanted
        return None

    def _divergence(self, op: str, actual: Placements, planned: Placements) -> str:
        """A comment where DTensor's rule lays an op's result out otherwise than the plan."""
        actions = []
        for axis, seen, wanted in zip(self.axes, actual, planned):
            if same((seen,), (wanted,)) or not isinstance(seen, Replicate):
                continue
            for operand, given in self._operand_placements:
                if given is not None and isinstance(given[self.axes.index(axis)], Partial):
                    actions.append(f"all-reduces {operand} over {axis}")
                    break
                if given is not None and not isinstance(given[self.axes.index(axis)], (Replicate, Partial)):
                    actions.append(f"all-gathers {operand} over {axis}")
                    break
        inside = f": it {', '.join(actions)} inside the op" if actions else ""
        if actions and notes.short_op(op) in ("split", "split_with_sizes", "chunk"):
            inside += (
                " (the plan keeps each piece split, as Megatron-LM lays a fused weight out per rank; "
                "a weight split on whole rows holds whole pieces instead)"
            )
        return comment(
            f"DTensor's {notes.short_op(op)} gives {notes.describe(actual, self.axes)} where the plan has "
            f"{notes.describe(planned, self.axes)}{inside}"
        )

    def _op_arguments(self, fx_node: torch.fx.Node, op: str) -> tuple[list, dict]:
        """The op's arguments, with dropout probabilities read from their modules at run time."""
        args, kwargs = list(fx_node.args), dict(fx_node.kwargs)
        if op.startswith(DROPOUTS) and len(args) >= 2:
            args[1] = Code(f"self.dropout_p({fx_node.name!r}, {literal_argument(args[1])})")
            if len(args) >= 3 and isinstance(args[2], bool):
                args[2] = Code("self.training")
        elif fx_node.name in self.facts.dropout_modules and drop_path_keep(fx_node) is not None:
            # drop path's keep probability, 1 - the module's probability now (module docstring of graph_facts)
            args[1] = Code(f"1.0 - self.dropout_p({fx_node.name!r}, {literal_argument(1.0 - drop_path_keep(fx_node))})")
        elif op.startswith(ATTENTION) and attention_dropout(fx_node):
            code = Code(f"self.dropout_p({fx_node.name!r}, {literal_argument(attention_dropout(fx_node))}) if self.training else 0.0")
            if "dropout_p" in kwargs:
                kwargs["dropout_p"] = code
            else:
                args[4] = code
        return args, kwargs

    def _operand(
        self,
        arg: torch.fx.Node,
        on_dtensors: bool,
        strategy: NodeStrategy | None,
        opnode,
        consumer: torch.fx.Node,
        comments: list[str],
    ) -> str:
        """How op ``consumer`` reads value ``arg``: as is, or redistributed by ``_to`` on a line
        of its own (with a comment naming the collective). A value redistributed once is reused
        by every later consumer that reads it the same way: one collective, not one per reader."""
        value = self.values[arg.name]
        if value.param:
            self.params_read_as_dtensors.add(value.param)
        if not on_dtensors or value.kind not in ("dt", "plain"):
            return value.expr
        wanted = planned_input(strategy, opnode, arg.name)
        if value.kind == "plain":
            wanted = whole(wanted or tuple(Replicate() for _ in self.axes))
            source = None
        elif wanted is not None and value.placements is not None:
            from codegen.runtime.spmd import keep_whole

            wanted = keep_whole(value.placements, wanted)  # no whole -> partial conversion (DTensor refuses it)
        if value.kind == "plain":
            pass
        elif wanted is None or value.placements is None or same(value.placements, wanted):
            self._operand_placements.append((value.expr, value.placements))
            return value.expr
        else:
            source = value.placements
        self._operand_placements.append((value.expr, tuple(wanted)))
        key = (value.expr, tuple(wanted))
        if key in self.resharded:
            return self.resharded[key]
        constant = self.constant(wanted)
        name = self.fresh(f"{value.expr}_{constant.lower()}")
        module = strategy.module if strategy else ""
        why = notes.reshard_note(value.expr, source, wanted, consumer.name, str(consumer.target), module, self.axes)
        if value.param:
            why = f"{why} (parameter {value.param} is held as {placements_str(value.placements)})"
        comments.append(comment(why))
        comments.append(with_comment(f"{name} = _to({value.expr}, {constant})", self._note(arg, wanted)))
        self.resharded[key] = name
        return name

    def _planned_output(self, strategy: NodeStrategy | None, multi: bool, produced: bool) -> Any:
        if strategy is None or not strategy.outputs:
            return None
        outputs = strategy.produced if (produced and strategy.produced) else strategy.outputs
        return list(outputs) if multi else outputs[0]

    def _note(self, fx_node: torch.fx.Node, placements: Placements | None) -> str:
        val = fx_node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return ""
        shape = tuple(int(d) for d in val.shape)
        text = notes.value_note(shape, placements, self.axes, self.sizes)
        dtype = str(val.dtype).removeprefix("torch.")
        return text if dtype == "float32" else f"{text} ({dtype})"


def classes_split(strategy: NodeStrategy | None) -> bool:
    """Whether a loss reads its logits split over the classes (dim 1) on some mesh axis:
    the program runs it as a vocabulary-parallel cross entropy."""
    return strategy is not None and bool(strategy.inputs) and any(
        isinstance(p, Shard) and p.dim == 1 for p in strategy.inputs[0]
    )


def _targets_split(strategy: NodeStrategy | None) -> bool:
    """Whether a loss's targets (its second input) are split on some mesh axis."""
    return (
        strategy is not None and len(strategy.inputs) > 1
        and any(not isinstance(p, (Replicate, Partial)) for p in strategy.inputs[1])
    )
