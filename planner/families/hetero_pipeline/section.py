"""The section of a pipeline plan whose stages run on device groups of different types
(Metis, ATC'24): which device each stage runs on, the blocks it holds, and what the
simulator predicted for it.

The plan itself is an ordinary pipeline plan (``pp`` the mesh's first axis, each op's stage
in its strategy): the stages hold different numbers of blocks, balanced by each device's
speed and memory, and the order of the stages is the order of the plan's cluster's nodes
(the search reorders them: start the nodes as the plan's cluster lists them, node rank 0
first). The section names what a report and a reader need, and lets the simulator price
each stage on its own device (``costs.py``). Stored under the plan JSON key ``"hetero-pp"``
as ``{"stage_devices": [...], "blocks": [...], "busy_s": [...], "memory_bytes": [...]}``
(blocks per stage, and the predictions per stage; each empty when not recorded), and
``"widths"``: the ranks of each stage when the stages differ in width (empty: every stage as
wide as the mesh's ``dp``). A plan of stages of different widths (``widths.py``) has the mesh
``pp`` alone, one coordinate per rank: stage s holds the ``widths[s]`` coordinates after the
stages before it, runs data parallel over them and is compiled by
``codegen.uneven_width_emit``. A plan
that leaves devices out is not of this family: it runs on the fast group alone and says so
in a warning (``candidates.fast_group_pipelines``).

Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from planner.cluster import MAX_RANKS
from planner.errors import PlanFileError, one_line
from planner.json_files import section_lists

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "hetero-pp"
KEYS = ("stage_devices", "blocks", "busy_s", "memory_bytes", "widths")


@dataclass(frozen=True)
class HeteroStagesSection:
    """Stage ``s`` of the pipeline runs on devices named ``stage_devices[s]`` and holds
    ``blocks[s]`` repeated blocks (empty: not recorded); ``busy_s[s]``
    and ``memory_bytes[s]`` are its predicted compute seconds per step and bytes per device
    (empty: not simulated).

    Raises:
        ValueError: a device name is not a short non-empty string, a prediction is not a
            finite non-negative number, or the lengths differ.
    """

    stage_devices: tuple[str, ...]
    blocks: tuple[int, ...] = ()
    busy_s: tuple[float, ...] = ()
    memory_bytes: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    # Node costs read the stage's device (costs.py): the simulator's cache of node costs
    # must not hand this plan the costs of the same plan priced on its slowest device.
    changes_op_costs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        names = self.stage_devices
        names = tuple(names) if isinstance(names, (list, tuple)) else names
        object.__setattr__(self, "stage_devices", names)
        if not isinstance(names, tuple) or not 2 <= len(names) <= MAX_RANKS or any(
            not isinstance(name, str) or not 0 < len(name) <= 120 for name in names
        ):
            raise ValueError(
                f"field '{JSON_KEY}.stage_devices' must list 2 or more device names (one per stage), got "
                f"{_shown(names)}; name each stage's device as the cluster does"
            )
        for key, kind in (("blocks", int), ("busy_s", float), ("memory_bytes", int), ("widths", int)):
            values = tuple(getattr(self, key))
            if values and (len(values) != len(names) or any(
                isinstance(v, bool) or not isinstance(v, kind if kind is int else (int, float))
                or not 0 <= v < float("inf") for v in values
            )):
                what = "integer" if kind is int else "number"
                raise ValueError(
                    f"field '{JSON_KEY}.{key}' must be empty or one finite non-negative {what} per stage "
                    f"({len(names)}), got {_shown(values)}; drop it and simulate the plan again"
                )
            object.__setattr__(self, key, tuple(kind(v) for v in values))
        if 0 in self.widths or len(set(self.widths)) == 1:
            raise ValueError(
                f"field '{JSON_KEY}.widths' must be empty or give stages of different widths, each 1 or more, got "
                f"{_shown(self.widths)}; drop it for stages of one width"
            )

    def stage_ranks(self, plan: "Plan") -> list[range]:
        """The ranks of each stage: ``widths`` consecutive ranks each, else ``world / pp``."""
        widths = self.widths or (plan.cluster.world_size // plan.mesh.axis_size("pp"),) * len(self.stage_devices)
        starts = [sum(widths[:stage]) for stage in range(len(widths) + 1)]
        return [range(starts[stage], starts[stage + 1]) for stage in range(len(widths))]

    def check(self, plan: "Plan") -> None:
        """Raise ``ValueError`` (one line naming ``hetero-pp.stage_devices`` and the fix) unless
        this section fits ``plan``: a pipeline plan with ``pp`` first, one device name per
        stage, every rank of a stage on that device, no expert layouts or other sections."""
        mesh = plan.mesh
        if plan.pipeline is None or not mesh.names or mesh.names[0] != "pp" or plan.expert_layouts or (
                set(plan.sections) - {JSON_KEY}):
            raise ValueError(
                f"field '{JSON_KEY}.stage_devices' needs a pipeline plan with pp as the first mesh axis, without "
                f"expert layouts or other sections, but the plan is {plan.name}; drop the {JSON_KEY} section"
            )
        pp = mesh.axis_size("pp")
        if self.widths:
            self._check_widths(plan)
        elif len(self.stage_devices) != pp:
            raise ValueError(
                f"field '{JSON_KEY}.stage_devices' names {len(self.stage_devices)} devices for pp={pp} stages; "
                f"give one per stage"
            )
        for stage, (name, ranks) in enumerate(zip(self.stage_devices, self.stage_ranks(plan))):
            found = {plan.cluster.device_of(rank).name for rank in ranks}
            if found != {name}:
                raise ValueError(
                    f"field '{JSON_KEY}.stage_devices' says stage {stage} runs on {_shown(name)}, but its ranks "
                    f"{ranks[0]}-{ranks[-1]} run on {', '.join(sorted(found))[:80]}; "
                    f"order the cluster's nodes so each stage's ranks share one device"
                )

    def _check_widths(self, plan: "Plan") -> None:
        """Stages of different widths: one width per stage, the mesh ``pp`` alone with one
        coordinate per rank, every op on one of the stages, the micro-batches whole units."""
        stages, world = len(self.stage_devices), plan.cluster.world_size
        if len(self.widths) != stages or sum(self.widths) != world or plan.mesh.names != ("pp",):
            raise ValueError(
                f"field '{JSON_KEY}.widths' gives {len(self.widths)} stages of {sum(self.widths)} ranks in all for "
                f"{stages} stage devices, {world} ranks and mesh {plan.mesh}; give one width per stage, summing to the "
                f"world, on a mesh of pp={world} alone"
            )
        used = max(strategy.stage for strategy in plan.strategies)
        if used >= stages:
            raise ValueError(
                f"field '{JSON_KEY}.widths' gives {stages} stages but op stages reach {used}; plan the ops on stages "
                f"0..{stages - 1}"
            )

    @property
    def checkpoint_refusal(self) -> str:
        """Why ``launch.py --checkpoint-dir``/``--init-from`` refuse this plan ("" when they
        do not): a stage of several ranks holds its weights whole on each (one-rank meshes),
        which the pipeline family's checkpoints (one DTensor shard per pp x dp coordinate) do
        not describe."""
        if not self.widths:
            return ""
        return ("checkpoints of pipeline stages of different widths are not written yet (each rank of a stage holds "
                "its weights whole); train without --checkpoint-dir/--init-from, or plan stages of one width")

    def simulation_blocker(self, plan: "Plan") -> str | None:
        """Why the simulator cannot price ``plan`` (one line), or None: its step model runs
        every rank of a pp coordinate alike, which stages of different widths are not; their
        estimate is the layout's price the search computed (``width_plans``)."""
        if not self.widths:
            return None
        return (f"this plan's pipeline stages have different widths {'/'.join(map(str, self.widths[:8]))}; the "
                f"simulator prices stages of one width only, so its estimate is the one `planner plan` computed "
                f"for the layout (`planner report` prints it)")

    def pipeline_words(self, plan: "Plan") -> str:
        """The verdict's words for the pipeline of stages of different widths ("" otherwise):
        its stages, their widths, and micro-batches as the runtime's units make them."""
        if not self.widths:
            return ""
        per = math.lcm(*self.widths)
        return (f"{len(self.widths)} pipeline stages of widths {'/'.join(map(str, self.widths))}, each data parallel "
                f"over its ranks ({plan.pipeline.schedule}, {plan.pipeline.micro_batches // per} micro-batches of "
                f"{per} units)")

    def describe(self, plan: "Plan") -> str:
        """The words this section adds to the plan's name, ``"stages on cpu-fast/cpu-slow"``."""
        words = "stages on " + "/".join(self.stage_devices[:8]) + ("/..." if len(self.stage_devices) > 8 else "")
        return words + (" of widths " + "/".join(map(str, self.widths[:8])) if self.widths else "")

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"hetero-pp"`` key."""
        return {"stage_devices": list(self.stage_devices), "blocks": list(self.blocks), "busy_s": list(self.busy_s),
                "memory_bytes": list(self.memory_bytes), **({"widths": list(self.widths)} if self.widths else {})}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "HeteroStagesSection":
        """The section stored under a plan file's ``"hetero-pp"`` key, every field checked.

        Raises:
            PlanFileError: ``data`` is not an object, has an unknown key, lacks
                ``stage_devices``, or a field is malformed; one line naming ``source`` and the field.
        """
        section_lists(data, source, JSON_KEY, KEYS, KEYS, '{"stage_devices": ["h100", "a100"]}', PlanFileError)
        try:
            return cls(tuple(data["stage_devices"]), tuple(data.get("blocks", ())), tuple(data.get("busy_s", ())),
                       tuple(data.get("memory_bytes", ())), tuple(data.get("widths", ())))
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def _shown(value: Any) -> str:
    """``value`` as a message quotes it: one line, at most 40 characters."""
    return one_line(repr(value))[:40]
