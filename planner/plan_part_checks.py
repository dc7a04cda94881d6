"""A plan's parts checked against each other, on their own (``Plan.__post_init__`` runs
these): the pipeline's counts against the batch and the ops, each SUMMA layout against the
mesh, each MoE layer's expert layout against the mesh and the plan's sections. Each failure
is a ``ValueError`` that ``Plan.from_dict`` turns into one line naming the field.
"""

from __future__ import annotations

from planner.errors import one_line
from planner.strategy import ExpertLayout, Mesh, NodeStrategy, PipelineConfig, SummaLayout, expert_axes


def check_pipeline_size(pipeline: PipelineConfig, batch_size: int, ops: int) -> None:
    """The pipeline's counts are bounded by the plan's, so that what the simulator and the
    program allocate per micro-batch and per stage module stays within the batch and the
    model: a micro-batch holds at least one sample, a stage module at least one op."""
    counts = (pipeline.stages, pipeline.micro_batches, pipeline.virtual_stages)
    if any(isinstance(count, bool) or not isinstance(count, int) for count in counts):
        raise ValueError(f"pipeline stages, micro_batches and virtual_stages must be integers, got {counts!r}")
    if pipeline.micro_batches > batch_size:
        raise ValueError(
            f"the pipeline has {pipeline.micro_batches} micro-batches but the global batch holds {batch_size} "
            f"samples; a micro-batch holds at least one sample, so micro_batches must be <= batch_size"
        )
    if pipeline.stages * pipeline.virtual_stages > max(ops, 1):
        raise ValueError(
            f"the pipeline has {pipeline.stages} x {pipeline.virtual_stages} stage modules but the plan has {ops} "
            f"op(s); a stage module holds at least one op, so stages x virtual_stages must be <= the ops"
        )


def check_summa_layouts(strategies: tuple[NodeStrategy, ...], mesh: Mesh) -> None:
    """Every SUMMA layout fits the mesh: ``row`` and ``col`` of size q, ``dep`` of size d
    (absent for 2-D), ordered as ``SummaLayout`` says."""
    for strategy in strategies:
        layout = strategy.layout
        if not isinstance(layout, SummaLayout):
            continue
        where = f"node '{one_line(strategy.node)[:80]}' has a {layout.describe()} layout"
        wanted = {"row": layout.q, "col": layout.q, **({"dep": layout.d} if layout.family != "2d" else {})}
        sizes = dict(mesh.axes)
        if any(sizes.get(axis) != size for axis, size in wanted.items()):
            raise ValueError(f"{where}, which needs mesh axes {wanted}, but the mesh is {mesh}")
        order = [name for name in mesh.names if name in wanted]
        expected = {"2d": ["row", "col"], "2.5d": ["dep", "row", "col"], "3d": ["row", "col", "dep"]}[layout.family]
        if order != expected:
            raise ValueError(f"{where}, which needs mesh axes in the order {' x '.join(expected)}, but the mesh is {mesh}")


def check_expert_layouts(layouts: tuple[ExpertLayout, ...], mesh: Mesh, sections=()) -> None:
    """Each MoE layer once, on an axis of the mesh, its placement over that axis's ranks; a
    layout folded over several axes or with expert tensor parallelism only in a plan with a
    ``moe_folding`` section (whose ``check`` validates the degrees)."""
    seen = set()
    for layout in layouts:
        where = f"expert layout of '{one_line(layout.module)[:80]}'"
        if layout.module in seen:
            raise ValueError(f"{where} is given twice; give each MoE layer one layout")
        seen.add(layout.module)
        missing = [name for name in expert_axes(layout.axis) if name not in mesh.names]
        if missing:
            raise ValueError(f"{where} runs over axis '{one_line(missing[0])[:20]}', which mesh {mesh} does not have")
        if len(expert_axes(layout.axis)) > 1 or layout.tensor_parallel > 1:
            # EP x ETP folded over several axes: the moe_folding section checks the degrees.
            if "moe-folding" not in sections:
                raise ValueError(
                    f"{where} folds its experts over '{one_line(layout.axis)[:20]}' with tensor_parallel="
                    f"{layout.tensor_parallel}, which only a plan with a 'moe_folding' section runs; add the section "
                    f"or lay the layer out on one axis with tensor_parallel 1"
                )
            continue
        if layout.placement is not None and layout.placement.devices != mesh.axis_size(layout.axis):
            raise ValueError(
                f"{where} places experts on {layout.placement.devices} devices but axis {layout.axis} has "
                f"{mesh.axis_size(layout.axis)} ranks"
            )


