"""The traced program: one node per ATen op of the forward pass.

An ``OpGraph`` is what every later stage reads: search assigns a strategy to each node, the
cost model prices it, codegen rewrites the ``torch.fx.GraphModule`` it keeps. Nodes are in
topological order. Nothing here depends on torch beyond dtypes and the fx graph it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

# Ops that only reinterpret or re-stride their input: they move no data of their own.
VIEW_OPS = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.transpose.int",
        "aten.t.default",
        "aten.permute.default",
        "aten.expand.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.alias.default",
        "aten.detach.default",
        "aten.split.Tensor",
        "aten.split_with_sizes.default",
        "aten.chunk.default",  # torch.export keeps torch.chunk as itself: views of its input, as split's
        "aten.unbind.int",
        "aten.flatten.using_ints",
        "aten.unflatten.int",
        "aten.view_as.default",
        "aten.expand_as.default",
        "aten._assert_tensor_metadata.default",
        "getitem",
    }
)


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor of the traced program (global, unsharded)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]"


@dataclass
class OpNode:
    """One ATen op of the forward pass.

    Attributes:
        name: the fx node name (unique in the graph).
        op: the op's qualified name, e.g. ``"aten.mm.default"``.
        inputs: names of the graph nodes whose outputs this op reads (tensors only).
        input_meta: shape and dtype of each tensor input, aligned with ``inputs``.
        output_meta: shape and dtype of each tensor output.
        params: qualified names of the parameters and buffers this op reads directly.
        param_inputs: the names in ``inputs`` that carry them, aligned with ``params``.
        attrs: the op's positional arguments with tensors replaced by ``None`` (dims, sizes).
        module: the innermost module path that issued the op (``""`` for the root).
        flops: forward FLOPs counted by ``torch.utils.flop_counter``.
        bytes_moved: bytes read plus written (0 for view-like ops, which move nothing).
        block: ``(group, index)`` when the op belongs to repeated block ``index`` of a stack
            of same-structured blocks (e.g. ``("model.layers", 3)``), else ``None``.
        attention_mask_kind: for a fused attention op, what its mask allows
            (``planner.attention_masks``: ``"none"``, ``"causal"``, ``"sliding:W"`` or
            ``"arbitrary"``); ``None`` for other ops and where it was not read.
    """

    name: str
    op: str
    inputs: tuple[str, ...]
    input_meta: tuple[TensorMeta, ...]
    output_meta: tuple[TensorMeta, ...]
    params: tuple[str, ...] = ()
    param_inputs: tuple[str, ...] = ()
    attrs: tuple = ()
    module: str = ""
    module_type: str = ""
    flops: int = 0
    bytes_moved: int = 0
    block: tuple[str, int] | None = None
    attention_mask_kind: str | None = None

    @property
    def is_view(self) -> bool:
        return self.op in VIEW_OPS


@dataclass(frozen=True)
class GraphInput:
    """A user input of the traced program (not a parameter): its name and metadata.

    ``batch_dim`` is 0 when dim 0 of this tensor is the global batch, else ``None``.
    """

    name: str
    meta: TensorMeta | None
    batch_dim: int | None


@dataclass(frozen=True)
class BlockRun:
    """A run of consecutive, structurally identical blocks of one stack: blocks ``start`` ..
    ``start + count - 1`` of ``group`` (DeepSeek-V3's ``model.layers`` holds two runs: its 3
    dense layers from 0, its 58 MoE layers from 3). ``kind`` numbers the structures of a
    stack in the order they first run (0, 1, ...): blocks of runs of one kind issue the same
    ops on the same shapes, blocks of different kinds do not."""

    group: str
    start: int
    count: int
    kind: int = 0

    @property
    def indices(self) -> range:
        """The block indices of the run, as ``OpNode.block`` numbers them."""
        return range(self.start, self.start + self.count)


@dataclass
class OpGraph:
    """The traced forward program of a model on one global batch.

    Attributes:
        nodes: the ops in topological order.
        inputs: user inputs (tensors and constants), in the order the model takes them.
        parameters: qualified name -> metadata of every parameter (trainable weights).
        buffers: qualified name -> metadata of every buffer (non-trainable state).
        batch_size: the global batch (dim 0 of the first tensor input).
        block_runs: the runs of repeated blocks (``BlockRun``), in graph order; one per
            plain decoder stack, several where a stack's blocks change structure.
        tracer: ``"export"`` or ``"symbolic_trace"``, the front end that produced it.
        warnings: things noticed while tracing that a user should know (shown in reports).
        opaque_backward: ``(module path, what)`` for each part of the model whose backward is
            not the autograd of its traced ops (a custom autograd Function, a backward hook;
            ``planner.opaque_backward``): only programs that run the model's own modules
            (data parallelism) train it right.
        graph_module: the ``torch.fx.GraphModule`` the nodes were read from.
        model_fingerprint: ``planner.fingerprint.model_fingerprint`` of the traced model and
            inputs (set by the tracer; plans store it).
        constants: placeholder name -> value of each tensor the forward makes from Python
            data (export's lifted tensor constants, e.g. ``torch.tensor([...])``), on the CPU.
        trace_note: how the tracer took the repeated blocks (``planner.trace_stamp``): "model.layers:
            6 of 61 blocks traced, 55 copied", or why every block was traced; empty when nothing repeats.
        moe_blocks: the model's Mixture-of-Experts layers (``planner.moe_blocks.MoEBlock``),
            in module order; the ops of a layer are those whose ``module`` is the layer's
            path or lies under it (``moe_nodes``).
    """

    nodes: list[OpNode]
    inputs: list[GraphInput]
    parameters: dict[str, TensorMeta]
    buffers: dict[str, TensorMeta]
    batch_size: int
    block_runs: tuple[BlockRun, ...] = ()
    tracer: str = "export"
    warnings: list[str] = field(default_factory=list)
    opaque_backward: list[tuple[str, str]] = field(default_factory=list)
    graph_module: torch.fx.GraphModule | None = field(default=None, repr=False)
    model_fingerprint: str = ""
    constants: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    moe_blocks: tuple = ()
    trace_note: str = ""
    _by_name: dict[str, OpNode] = field(default_factory=dict, init=False, repr=False)
    # moe_nodes' answers while the node list stays the one they were read from (searches ask
    # for every layer's ops many times; each answer scans the whole graph).
    _moe_nodes: tuple = field(default=(None, {}), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name = {node.name: node for node in self.nodes}

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, name: str) -> OpNode:
        return self._by_name[name]

    def has_node(self, name: str) -> bool:
        return name in self._by_name

    @property
    def blocks(self) -> dict[str, int]:
        """Repeated blocks per stack, ``group -> number of blocks`` (all its runs together)."""
        counts: dict[str, int] = {}
        for run in self.block_runs:
            counts[run.group] = counts.get(run.group, 0) + run.count
        return counts

    @property
    def block_start(self) -> dict[str, int]:
        """``group -> index`` of the stack's first repeated block (a stack may begin with
        blocks that repeat nowhere, as T5's first block with its relative position bias)."""
        starts: dict[str, int] = {}
        for run in self.block_runs:
            starts.setdefault(run.group, run.start)
        return starts

    def block_ids(self) -> tuple[tuple[str, int], ...]:
        """The repeated blocks as ``OpNode.block`` names them, in order: (group, index), the
        index counted from the stack's first module (DeepSeek-V3's dense layers 0..2, then its
        MoE layers 3..60, two runs of one stack)."""
        return tuple((run.group, index) for run in self.block_runs for index in run.indices)

    def block_run_of(self, block: tuple[str, int]) -> BlockRun:
        """The run holding ``block`` (``OpNode.block``'s ``(group, index)``)."""
        group, index = block
        return next(run for run in self.block_runs if run.group == group and index in run.indices)

    def block_runs_text(self) -> str:
        """The repeated blocks per stack in words: ``model.layers x61`` for one run, its runs
        where a stack has several (``model.layers x61: 3 dense (0-2) + 58 MoE (3-60)``: a run
        is MoE when its blocks hold one of ``moe_blocks``; in a model without MoE layers the
        runs are told apart by their structure, ``kind 0``, ``kind 1``); ``none`` without any."""
        moe_modules = [block.module for block in self.moe_blocks]

        def label(run: BlockRun) -> str:
            if not moe_modules:
                return f"kind {run.kind}"
            first = f"{run.group}.{run.start}"
            return "MoE" if any(m == first or m.startswith(first + ".") for m in moe_modules) else "dense"

        words = []
        for group, count in self.blocks.items():
            runs = [run for run in self.block_runs if run.group == group]
            if len(runs) == 1:
                words.append(f"{group} x{count}")
                continue
            parts = [f"{run.count} {label(run)} ({run.start}" + (f"-{run.start + run.count - 1})" if run.count > 1 else ")")
                     for run in runs]
            words.append(f"{group} x{count}: " + " + ".join(parts))
        return ", ".join(words) or "none"

    def block_paths(self) -> tuple[str, ...]:
        """Module paths of the repeated blocks, in order (``("blocks.0", "blocks.1", ...)``)."""
        return tuple(f"{group}.{index}" for group, index in self.block_ids())

    def moe_nodes(self, module: str) -> list[OpNode]:
        """The ops of the MoE layer at module path ``module`` (its own and its submodules')."""
        stamp, found = self._moe_nodes
        if stamp != (id(self.nodes), len(self.nodes)):
            found = {}
            self._moe_nodes = ((id(self.nodes), len(self.nodes)), found)
        if module not in found:
            prefix = module + "."
            found[module] = tuple(node for node in self.nodes if node.module == module or node.module.startswith(prefix))
        return list(found[module])

    @property
    def total_flops(self) -> int:
        """Forward FLOPs of the whole program."""
        return sum(node.flops for node in self.nodes)

    @property
    def parameter_count(self) -> int:
        return sum(meta.numel for meta in self.parameters.values())

    @property
    def parameter_bytes(self) -> int:
        return sum(meta.nbytes for meta in self.parameters.values())

    def op_counts(self) -> dict[str, int]:
        """How many nodes use each op, most frequent first."""
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))
