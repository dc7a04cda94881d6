"""What graph codegen reads from the model and from DTensor, besides the plan.

- the model built on meta: the output structure of its forward (run on fake tensors, which
  skips data-dependent branches and allocates nothing), and where each dropout op of the
  traced graph finds its probability (an ``nn.Dropout``'s ``p``, or a float attribute of the
  module that issued it), so the program reads it at run time;
- DTensor's coverage of an ATen op: a sharding rule, a composite that decomposes before
  DTensor sees it, a ``torch._decomp`` decomposition we can call, or nothing.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map

from planner.graph import OpGraph
from planner.plans import Plan

# Seed every rank builds the model with (planner.api.BUILD_SEED, codegen.runtime.program.BUILD_SEED).
BUILD_SEED = 0
DROPOUTS = (
    "aten.dropout.", "aten.native_dropout.", "aten.feature_dropout.", "aten.alpha_dropout.", "aten.feature_alpha_dropout.",
    # nn.Dropout(inplace=True) (MobileNet's classifier): the same arguments (input, p, train)
    "aten.dropout_.", "aten.feature_dropout_.", "aten.alpha_dropout_.", "aten.feature_alpha_dropout_.",
)
ATTENTION = "aten.scaled_dot_product_attention."


@dataclass
class ModelFacts:
    """What codegen reads from the model built on meta: output structure, dropout owners."""

    class_name: str
    out_spec: TreeSpec
    dropout_modules: dict[str, str | tuple[str, str]] = field(default_factory=dict)


def build_meta_model(plan: Plan) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(BUILD_SEED)
    if plan.model.is_hf:
        import transformers

        transformers.logging.set_verbosity_error()
    return plan.model.build("meta")


def trace_model(model: torch.nn.Module, args: tuple, kwargs: dict) -> OpGraph:
    from planner.trace import trace

    return trace(model, args, kwargs)


def model_facts(model: torch.nn.Module, args: tuple, kwargs: dict, graph: OpGraph) -> ModelFacts:
    """The output structure (from a forward on fake tensors: cheap, no data-dependent
    branches) and, for each dropout op of the graph, the ``nn.Dropout`` it belongs to."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    was_training = model.training
    model.train()
    # Tensors the forward makes without a device (torch.tensor([...])) follow the model's
    # parameters onto the meta device, as they would follow them onto a GPU at run time.
    on_meta = any(p.is_meta for p in model.parameters())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # The inputs enter as fake tensors, not as real or meta ones the mode converts on the fly:
    # libraries skip their data-dependent checks when they see a fake input (transformers'
    # is_tracing: the padding check of BERT-like encoders reads token values, which a fake
    # tensor does not have).
    args, kwargs = tree_map(lambda value: mode.from_tensor(value) if isinstance(value, torch.Tensor) else value, (args, kwargs))
    try:
        with torch.no_grad(), mode, torch.device("meta") if on_meta else nullcontext(), _static_shape_experts(model):
            output = model(*args, **kwargs)
    finally:
        model.train(was_training)
    _, out_spec = tree_flatten(output)
    return ModelFacts(type(model).__name__, out_spec, _dropout_owners(model, graph))


@contextmanager
def _static_shape_experts(model: torch.nn.Module):
    """HuggingFace MoE experts pick their kernel at run time: on meta tensors outside
    ``torch.export`` they take ``grouped_mm``, whose meta kernel takes bf16 only. Only the
    output's structure is wanted here, which every kernel gives alike: run them as batched
    matmuls (static shapes, any dtype) for this forward."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_experts_implementation")}
    saved = {key: config._experts_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            if config._experts_implementation in (None, "grouped_mm"):
                config._experts_implementation = "batched_mm"
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation = saved[key]


def _dropout_owners(model: torch.nn.Module, graph: OpGraph) -> dict[str, str | tuple[str, str]]:
    """Dropout node -> where its probability lives, so the program reads it at run time:
    the path of an ``nn.Dropout`` (its ``p``), or ``(module path, attribute)`` for a float
    attribute of the module that issued it (``F.dropout(x, self.dropout, self.training)``;
    ``dropout_p=self.attention_dropout``). An attention op with a dropout probability reads
    a dropout module of its own module with that ``p`` (``attn_dropout`` in GPT-2) or such an
    attribute, preferring names that say attention."""
    modules = dict(model.named_modules())
    owners: dict[str, str | tuple[str, str]] = {}
    for fx_node in graph.graph_module.graph.nodes:
        if fx_node.op != "call_function":
            continue
        op = str(fx_node.target)
        stack = [clean_path(entry[0]) for entry in (fx_node.meta.get("nn_module_stack") or {}).values()]
        path = stack[-1] if stack else ""
        if op.startswith(DROPOUTS):
            if isinstance(modules.get(path), torch.nn.modules.dropout._DropoutNd):
                owners[fx_node.name] = path
            elif isinstance(fx_node.args[1] if len(fx_node.args) > 1 else None, float) and fx_node.args[1] > 0:
                attribute = _float_attribute(modules, stack, fx_node.args[1], attention=False)
                if attribute:
                    owners[fx_node.name] = attribute
        elif op.startswith(ATTENTION) and path in modules:
            traced = attention_dropout(fx_node)
            if traced:
                candidates: list[tuple[bool, int, str | tuple[str, str]]] = [
                    (not _ATTENTION_NAME.search(name.rsplit(".", 1)[-1]), 0, f"{path}.{name}" if path else name)
                    for name, module in modules[path].named_modules()
                    if isinstance(module, torch.nn.modules.dropout._DropoutNd) and math.isclose(module.p, traced)
                ]
                attribute = _float_attribute(modules, stack, traced, attention=True)
                if attribute:
                    candidates.append((not _ATTENTION_NAME.search(attribute[1]), 1, attribute))
                if candidates:  # attention's own first, a module before an attribute
                    owners[fx_node.name] = min(candidates, key=lambda c: c[:2])[2]
        elif drop_path_keep(fx_node) is not None:
            attribute = _drop_path_attribute(modules.get(path), drop_path_keep(fx_node))
            if attribute:
                owners[fx_node.name] = (path, attribute)
    return owners


# Stochastic depth (timm's and HuggingFace's drop_path): ``keep = 1 - drop_prob``, then
# ``input.div(keep) * floor(keep + rand)``. The traced graph holds ``keep`` as a float in the
# add and the div; a program that keeps it there drops samples even after the module's
# probability is set to 0 (``--check``), so these ops read it at run time too.
DROP_PATH_CLASS = re.compile(r"drop_?path|stochastic_?depth", re.IGNORECASE)
_DROP_PATH_OPS = ("aten.add.Tensor", "aten.div.Tensor")
_DROP_PATH_ATTRIBUTES = ("drop_prob", "p", "drop_rate", "drop_path_rate", "prob")


def drop_path_keep(fx_node: torch.fx.Node) -> float | None:
    """The keep probability ``fx_node`` holds as its float argument, when it is the add or
    the div of a stochastic-depth module (its innermost module's class says so); else None."""
    if str(fx_node.target) not in _DROP_PATH_OPS or len(fx_node.args) != 2 or not isinstance(fx_node.args[1], float):
        return None
    stack = list((fx_node.meta.get("nn_module_stack") or {}).values())
    if not stack or not DROP_PATH_CLASS.search(getattr(stack[-1][1], "__name__", str(stack[-1][1]))):
        return None
    return fx_node.args[1]


def _drop_path_attribute(module: torch.nn.Module | None, keep: float) -> str | None:
    """The float attribute of a stochastic-depth ``module`` whose ``1 - value`` is ``keep``."""
    for name in _DROP_PATH_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, float) and not isinstance(value, bool) and value > 0 and math.isclose(1 - value, keep):
            return name
    return None


_ATTENTION_NAME = re.compile(r"attn|attention")


def _float_attribute(
    modules: dict[str, torch.nn.Module], stack: list[str], value: float, attention: bool
) -> tuple[str, str] | None:
    """The float attribute equal to ``value`` whose name says dropout (or is ``p``), of the
    innermost module on ``stack`` that has one: ``(module path, attribute)``; for attention,
    names that say attention first, for other dropout the others first."""
    for path in reversed(stack):
        module = modules.get(path)
        if module is None:
            continue
        names = [
            name
            for name, held in vars(module).items()
            if isinstance(held, float) and math.isclose(held, value) and re.search(r"drop|^p$", name)
        ]
        names.sort(key=lambda name: (bool(_ATTENTION_NAME.search(name)) != attention, name))
        if names:
            return path, names[0]
    return None


def clean_path(path: str) -> str:
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.removeprefix("self.").strip(".")


def attention_dropout(fx_node: torch.fx.Node) -> float:
    if "dropout_p" in fx_node.kwargs:
        return float(fx_node.kwargs["dropout_p"])
    return float(fx_node.args[4]) if len(fx_node.args) > 4 else 0.0




def dtensor_support(op: torch._ops.OpOverload) -> str:
    """How DTensor runs ``op``: ``"rule"`` (a sharding rule), ``"composite"`` (it
    decomposes into other ops before DTensor sees it), ``"decomposition"`` (no rule, but
    ``torch._decomp`` has a decomposition we can call) or ``"none"``."""
    from torch.distributed.tensor import DTensor

    try:
        propagator = DTensor._op_dispatcher.sharding_propagator
        registered = (
            op in propagator.op_strategy_funcs
            or op in propagator.op_to_rules
            or op in (getattr(propagator, "op_single_dim_strategy_funcs", None) or {})
        )
    except AttributeError:  # a private API moved: assume a rule, DTensor will say otherwise
        return "rule"
    if registered:
        return "rule"
    if op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return "composite"
    from torch._decomp import decomposition_table

    return "decomposition" if op in decomposition_table else "none"
