"""The parts a cluster is built of: a device (``DeviceSpec``), a link class (``LinkSpec``), a node
(``NodeSpec``) and a link declared between two sites or node groups (``PairLink``). ``planner.cluster``
joins them into a ``Cluster`` and re-exports the names other modules use.

Units everywhere: FLOP/s (dense), bytes, bytes/s per direction per device, seconds.

Calibration. A device may carry measured efficiencies (``python -m planner profile`` writes
them; ``cost_model/profile.py`` defines how each is measured), all optional, each falling back
to the documented default in ``cost_model/defaults.py`` when absent:
  * ``matmul_efficiency``: achieved fraction of ``peak_flops`` for large matmuls, in (0, 1];
  * ``memory_efficiency``: achieved fraction of ``memory_bandwidth`` for streaming ops, in (0, 1];
  * ``kernel_overhead_s``: fixed cost per op (dispatch and launch), seconds, >= 0;
  * ``dtensor_op_overhead_s``: extra cost of each op dispatched on DTensors, seconds, >= 0:
    DTensor's sharding propagation and Python dispatch, which a plain tensor does not pay.
    A program that replays the traced graph (every plan that is not plain data parallel:
    tensor parallel, pipelines, searched layouts) pays it on every traced op, forward and
    backward; optimizer steps on DTensor parameters (FSDP, ZeRO-2, graph programs) on each of
    their ops. Absent: 0. ``planner calibrate`` fits it (``cost_model/calibration.py``).
  * ``redistribute_overhead_s``: extra cost of each collective a graph program issues from
    inside its forward or backward (DTensor's redistribute of an operand, the gradient
    all-reduce of a replicated activation), seconds, >= 0: planning the redistribute, the
    functional collective's wrapper and its wait, which the step pays in line. The
    collectives of data parallelism (DDP buckets, FSDP's gathers) run on their own threads
    or streams and do not pay it. Absent: 0. ``planner calibrate`` fits it.
They are flat fields of ``DeviceSpec``; in files they live in their own table, so measured
numbers stand apart from datasheet ones::

    [nodes.device.calibration]
    matmul_efficiency = 0.93
    memory_efficiency = 0.71
    kernel_overhead_s = 2.2e-06

(``"calibration": {...}`` inside ``"device"`` in JSON; keys left out mean "use the default").
Measured collective α and β need no new field: they are a ``LinkSpec``'s latency and bandwidth.

Attention kernel. ``DeviceSpec.attention_kernel`` names the fused attention kernel the training
software runs on a GPU (``ATTENTION_KERNELS``): ``"flash-attention-2"`` (PyTorch's SDPA flash
backend, the default), ``"flash-attention-triton"`` (the Triton FlashAttention kernel, e.g.
llm-foundry's ``attn_impl: triton``) or ``"cudnn-fused-attention"`` (cuDNN's flash attention,
which Transformer Engine's ``DotProductAttention`` picks on Hopper); ``cost_model.gpu_kernels``
prices each. Files write it as
``attention_kernel = "..."`` in ``[nodes.device]`` (left out: the default).

Vocabulary layer: imports only the standard library, ``planner.errors`` and ``planner.cluster_values``;
never torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.cluster_values import (
    FlopsTable,
    check_instance,
    checked_name,
    efficiency_value,
    overhead_value,
    positive_float,
    positive_int,
    unknown_key,
)
from planner.errors import ClusterError

__all__ = ["ATTENTION_KERNELS", "BACKENDS", "CALIBRATION_KEYS", "DTYPE_KEYS", "DeviceSpec", "LinkSpec", "NodeSpec",
           "PairLink", "SHORT_DTYPE", "HEADLINE_DTYPES"]

DTYPE_KEYS = ("float32", "tf32", "bfloat16", "float16", "float8")
BACKENDS = ("nccl", "gloo")
_DTYPE_ALIASES = {
    "float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
    "fp16": "float16", "fp8": "float8", "float8_e4m3fn": "float8", "float8_e5m2": "float8",
    "float8_e4m3fnuz": "float8", "float8_e5m2fnuz": "float8",
}
SHORT_DTYPE = {"float32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "float16": "fp16",
                "float8": "fp8"}
HEADLINE_DTYPES = ("bfloat16", "float16", "float32")  # in order of preference on ties
CALIBRATION_KEYS = ("matmul_efficiency", "memory_efficiency", "kernel_overhead_s", "dtensor_op_overhead_s",
                    "redistribute_overhead_s")
# Fused attention kernels a device's software may run (see the module docstring); first: default.
ATTENTION_KERNELS = ("flash-attention-2", "flash-attention-triton", "cudnn-fused-attention")


# ---- the model ----

@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU worker process): peak dense FLOP/s per dtype, memory, bandwidth.

    The calibration fields are None unless measured (see the module docstring); the cost
    model then uses ``cost_model.defaults``.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth: float
    matmul_efficiency: float | None = None  # fraction of peak_flops, large matmuls
    memory_efficiency: float | None = None  # fraction of memory_bandwidth, streaming ops
    kernel_overhead_s: float | None = None  # seconds per op, dispatch + launch
    dtensor_op_overhead_s: float | None = None  # seconds more per op on DTensors (dispatch)
    redistribute_overhead_s: float | None = None  # seconds more per in-step collective of a graph program
    attention_kernel: str = ATTENTION_KERNELS[0]  # fused attention kernel (ATTENTION_KERNELS)

    def __post_init__(self) -> None:
        checked_name(self.name, "DeviceSpec.name")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ClusterError(f"DeviceSpec.attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, "
                               f"got {self.attention_kernel!r}")
        check_instance(self.peak_flops, Mapping, "DeviceSpec.peak_flops")
        if not self.peak_flops:
            raise ClusterError("DeviceSpec.peak_flops is empty; add at least float32 = <FLOP/s>")
        for key in self.peak_flops:
            if key not in DTYPE_KEYS:
                raise unknown_key(key, DTYPE_KEYS, "DeviceSpec.peak_flops")
        flops = {key: positive_float(self.peak_flops[key], f"DeviceSpec.peak_flops.{key}")
                 for key in DTYPE_KEYS if key in self.peak_flops}  # canonical order
        object.__setattr__(self, "peak_flops", FlopsTable(flops))
        positive_int(self.memory_bytes, "DeviceSpec.memory_bytes")
        object.__setattr__(self, "memory_bandwidth",
                           positive_float(self.memory_bandwidth, "DeviceSpec.memory_bandwidth"))
        for key in ("matmul_efficiency", "memory_efficiency"):
            object.__setattr__(self, key, efficiency_value(getattr(self, key), f"DeviceSpec.{key}"))
        for key in ("kernel_overhead_s", "dtensor_op_overhead_s", "redistribute_overhead_s"):
            object.__setattr__(self, key, overhead_value(getattr(self, key), f"DeviceSpec.{key}"))

    @property
    def calibration(self) -> dict[str, float]:
        """The measured calibration fields that are set, in file order (empty: none measured)."""
        values = {key: getattr(self, key) for key in CALIBRATION_KEYS}
        return {key: value for key, value in values.items() if value is not None}

    def flops_for(self, dtype: Any) -> float:
        """Peak dense FLOP/s for a dtype.

        Args:
            dtype: a torch-style name ("float32", "bfloat16", "torch.float16", "bf16", ...) or a
                torch.dtype; names without an entry (e.g. bf16 on a V100, or int64) fall back to
                float32.
        Returns:
            FLOP/s. Raises ClusterError when neither the dtype nor float32 has an entry.
        """
        key = str(dtype).removeprefix("torch.").lower()
        key = _DTYPE_ALIASES.get(key, key)
        for candidate in (key, "float32"):
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        raise ClusterError(f"device {self.name!r} has no peak_flops for {key!r} nor float32; "
                           f"add float32 = <FLOP/s> to its peak_flops")


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth in bytes/s per direction per device, latency in seconds."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", positive_float(self.bandwidth, "LinkSpec.bandwidth"))
        object.__setattr__(self, "latency", positive_float(self.latency, "LinkSpec.latency"))


@dataclass(frozen=True)
class NodeSpec:
    """One node: ``devices`` identical devices joined by ``intra_link``, at ``site`` (a
    building or data centre; empty: the cluster's one site)."""

    device: DeviceSpec
    devices: int
    intra_link: LinkSpec
    site: str = ""

    def __post_init__(self) -> None:
        check_instance(self.device, DeviceSpec, "NodeSpec.device")
        positive_int(self.devices, "NodeSpec.devices")
        check_instance(self.intra_link, LinkSpec, "NodeSpec.intra_link")
        if not isinstance(self.site, str) or len(self.site) > 60 or not self.site.isprintable():
            raise ClusterError(f"NodeSpec.site must be a printable name of at most 60 characters (or empty), "
                               f"got {str(self.site)[:40]!r}")




@dataclass(frozen=True)
class PairLink:
    """The link between two sites (named sets of nodes: buildings, racks, the nodes behind one
    switch), per device as ``Cluster.inter_link``; both names equal: the network between the
    nodes of that one site, where it differs from the cluster's ``inter_link``.

    ``sites`` is kept sorted, so ``PairLink(("b", "a"), l) == PairLink(("a", "b"), l)``.
    """

    sites: tuple[str, str]
    link: LinkSpec

    def __post_init__(self) -> None:
        sites = tuple(self.sites) if isinstance(self.sites, (list, tuple)) else self.sites
        if not isinstance(sites, tuple) or len(sites) != 2 or any(
                not isinstance(site, str) or not 0 < len(site) <= 60 or not site.isprintable() for site in sites):
            raise ClusterError(f"PairLink.sites must be two site names (printable, 1 to 60 characters), "
                               f"got {str(self.sites)[:60]!r}")
        object.__setattr__(self, "sites", tuple(sorted(sites)))
        check_instance(self.link, LinkSpec, "PairLink.link")
