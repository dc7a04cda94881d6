"""The parts of a graph program's ``forward`` around its ops: the lines that make inputs and
parameters DTensors, the comment naming each module, ``getitem`` of multi-output ops, inlined
higher-order ops (grad and autocast regions), and the return statement.
``GraphStructure`` is mixed into ``codegen.spmd_emit.GraphEmitter``, which writes each op
(``GraphEmitter._op``) and holds the state these read and write (values, names, placements)."""

from __future__ import annotations

import torch
import torch.fx
from torch.distributed.tensor import Replicate

from codegen import spmd_notes as notes
from codegen.graph_facts import clean_path
from codegen.source_text import comment, identifier, with_comment
from codegen.spmd_literals import literal_argument, structure, tensor_literal
from codegen.spmd_placements import Value, whole
from planner.strategy import Placements

# Export's checks that a tensor is on the meta device: not written.
DROPPED_CHECKS = ("aten._assert_tensor_metadata.", "aten._assert_scalar.", "aten.sym_constrain_range")
_GRAD_HOP = "wrap_with_set_grad_enabled"
_AUTOCAST_HOP = "wrap_with_autocast"


class GraphStructure:
    """Writes a graph program's inputs, parameters, module comments, ``getitem``s, inlined
    higher-order ops and return (mixed into ``GraphEmitter``)."""

    def _input_placements(self, name: str) -> Placements:
        placements = self.plan.inputs.get(name)
        return whole(placements) if placements is not None else tuple(Replicate() for _ in self.axes)




    # ------------------------------------------------------------- inputs and parameters

    def _input_lines(self, gm: torch.fx.GraphModule) -> list[str]:
        lines = []
        user_inputs = {i.name: i for i in self.graph.inputs}
        for fx_node in gm.graph.nodes:
            if fx_node.op != "placeholder" or fx_node.name not in user_inputs:
                continue
            graph_input = user_inputs[fx_node.name]
            if graph_input.meta is None:
                self.values[fx_node.name] = Value(fx_node.name, "other")
                continue
            placements = self._input_placements(fx_node.name)
            note = notes.value_note(graph_input.meta.shape, placements, self.axes, self.sizes)
            shape = tuple(graph_input.meta.shape)
            name = identifier(fx_node.name, "a traced graph input")
            lines.append(with_comment(f"        {name} = self.input({name}, {self.constant(placements)}, {shape!r})", note))
            self.values[fx_node.name] = Value(fx_node.name, "dt", placements, exact=True)
        return lines

    def _parameter_lines(self, gm: torch.fx.GraphModule) -> list[str]:
        lines = []
        user_inputs = {i.name for i in self.graph.inputs}
        for fx_node in gm.graph.nodes:
            if fx_node.op != "placeholder" or fx_node.name in user_inputs:
                continue
            if not fx_node.users:
                continue  # a buffer the program never reads (e.g. rotary's original_inv_freq)
            name = self.param_of_placeholder.get(fx_node.name)
            if name in self.graph.parameters:
                placements = self.param_placements[name]
                note = notes.value_note(self.graph.parameters[name].shape, placements, self.axes, self.sizes)
                placeholder = identifier(fx_node.name, "a traced graph parameter")
                lines.append(with_comment(f"        {placeholder} = params[{name!r}]", note))
                self.values[fx_node.name] = Value(fx_node.name, "dt", placements, param=name)
            elif name in self.graph.buffers:
                meta = self.graph.buffers[name]
                note = f"buffer {notes.shape_text(meta.shape)}, the same on every rank"
                placeholder = identifier(fx_node.name, "a traced graph buffer")
                lines.append(with_comment(f"        {placeholder} = self.model.get_buffer({name!r})", note))
                self.values[fx_node.name] = Value(fx_node.name, "plain")
            elif fx_node.name in self.graph.constants:
                value = self.graph.constants[fx_node.name]
                note = f"a constant the forward makes, {notes.shape_text(tuple(value.shape))}, the same on every rank"
                placeholder = identifier(fx_node.name, "a traced graph constant")
                lines.append(with_comment(f"        {placeholder} = {tensor_literal(value, fx_node.name)}", note))
                self.values[fx_node.name] = Value(fx_node.name, "plain")
            else:
                raise NotImplementedError(
                    f"graph input '{fx_node.name}' is neither a user input, a parameter nor a buffer (a tensor constant "
                    f"captured by export); graph codegen cannot rebuild it on each rank yet: make it a buffer of the model"
                )
        return lines

    # ---------------------------------------------------------------------------- body


    def _module_header(self, fx_node: torch.fx.Node, indent: int) -> list[str]:
        stack = list((fx_node.meta.get("nn_module_stack") or {}).values())
        module, kind = (stack[-1][0], stack[-1][1]) if stack else ("", "")
        module = clean_path(module)
        if str(fx_node.target).startswith(DROPPED_CHECKS) or module == self.module:
            return []
        self.module = module
        kind = kind if isinstance(kind, str) else getattr(kind, "__qualname__", "")
        kind = kind.rsplit(".", 1)[-1]
        title = f"{module} ({kind})" if module else f"{self.facts.class_name} (top level)"
        return ["", " " * (4 * indent) + comment(f"---- {title}")]

    def _getitem(self, fx_node: torch.fx.Node, indent: int) -> list[str]:
        source, index = fx_node.args
        value = self.values[source.name]
        name = self._renames.get(fx_node.name, fx_node.name)
        kind = {"seq_dt": "dt", "seq_plain": "plain"}.get(value.kind, "other")
        if value.elements is not None and index < len(value.elements):
            kind = value.elements[index].kind
        placements = None
        if kind == "dt":
            strategy = self.strategies.get(fx_node.name)
            if self.observed.get(name) is not None:
                placements = self.observed[name]  # what DTensor gave (noted at the op that made it)
            elif isinstance(value.placements, list) and index < len(value.placements) and value.placements[index] is not None:
                placements = value.placements[index]
            elif strategy is not None and strategy.outputs:
                placements = strategy.outputs[0]
        self.values[fx_node.name] = Value(name, kind, placements)
        note = self._note(fx_node, placements if kind == "dt" else None)
        return [" " * (4 * indent) + with_comment(f"{name} = {value.expr}[{literal_argument(index)}]", note)]

    def _higher_order(self, fx_node: torch.fx.Node, gm: torch.fx.GraphModule, indent: int) -> list[str]:
        name = getattr(fx_node.target, "__name__", str(fx_node.target))
        pad = " " * (4 * indent)
        if name == _GRAD_HOP:
            enabled, submodule_node, *operands = fx_node.args
            header = f"with torch.set_grad_enabled({literal_argument(enabled)}):  # as the model does here ({'with' if enabled else 'no'} autograd)"
        elif name == _AUTOCAST_HOP:
            device_type, dtype, enabled, cache, submodule_node, *operands = fx_node.args
            header = (
                f"with torch.autocast(self.device.type, dtype={literal_argument(dtype)}, enabled={literal_argument(enabled)}, "
                f"cache_enabled={literal_argument(cache)}):  # the model's autocast region"
            )
        else:
            raise NotImplementedError(
                f"graph codegen cannot write higher-order op '{name}' (node '{fx_node.name}'); it inlines "
                f"{_GRAD_HOP} and {_AUTOCAST_HOP}"
            )
        submodule = getattr(gm, submodule_node.target)
        inner_nodes = list(submodule.graph.nodes)
        placeholders = [n for n in inner_nodes if n.op == "placeholder"]
        # The subgraph's names are its own: give it its own scope, and unique Python names.
        outer_values, outer_renames = self.values, self._renames
        self.values = dict(outer_values)
        for placeholder, operand in zip(placeholders, operands):
            if isinstance(operand, torch.fx.Node):
                self.values[placeholder.name] = outer_values[operand.name]
            else:
                self.values[placeholder.name] = Value(literal_argument(operand), "other")
        self._renames = {inner.name: self.fresh(inner.name) for inner in inner_nodes if inner.op == "call_function"}
        try:
            body = self._emit_nodes(inner_nodes, submodule, indent + 1, inner=True)
            output = next(n for n in inner_nodes if n.op == "output")
            results = [self.values[item.name] for item in output.args[0]]
        finally:
            self.values, self._renames = outer_values, outer_renames
        kinds = {v.kind for v in results}
        tuple_name = fx_node.name
        kind = "seq_dt" if "dt" in kinds else "seq_plain"
        self.values[fx_node.name] = Value(tuple_name, kind, [v.placements for v in results], elements=results)
        lines = [pad + header, *body]
        lines.append(pad + f"{tuple_name} = ({', '.join(v.expr for v in results)},)")
        return lines


    def _return(self, fx_node: torch.fx.Node, indent: int) -> list[str]:
        pad = " " * (4 * indent)
        leaves = list(fx_node.args[0]) if isinstance(fx_node.args[0], (list, tuple)) else [fx_node.args[0]]
        spec = self.facts.out_spec
        if spec.num_leaves != len(leaves):
            raise NotImplementedError(
                f"the model's output has {spec.num_leaves} tensors but the traced graph returns {len(leaves)} (export "
                f"also returns buffers the forward updates, e.g. BatchNorm statistics); graph codegen cannot write "
                f"such a program yet: use a data-parallel plan or a model without buffer updates"
            )
        exprs = []
        for leaf in leaves:
            if not isinstance(leaf, torch.fx.Node):
                exprs.append(literal_argument(leaf))
                continue
            value = self.values[leaf.name]
            val = leaf.meta.get("val")
            is_loss = isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()
            exprs.append(f"self.loss({value.expr})" if is_loss and value.kind == "dt" else value.expr)
        lines = ["", pad + "# The model's output; a scalar (the loss) as the full value on every rank, the rest as DTensors."]
        lines.append(pad + f"return {structure(spec, iter(exprs))}")
        return lines
