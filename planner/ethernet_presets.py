"""Cluster presets for training over commodity Ethernet: cloud instances whose machines talk
through NCCL's socket transport (TCP, no RDMA), at 10 to 100 Gb/s per machine.

Pure data in the cluster-file layout, merged into ``planner.presets.PRESETS``. Units as
there: FLOP/s, bytes, bytes/s per direction per device, seconds. This module imports nothing.

The socket transport, as the α–β model of ``cost_model.collectives`` sees it: the inter-node
link of a preset here is what NCCL's socket transport achieves, not the line rate.

- Bandwidth: the instance's network (its documented figure, shared by its GPUs) times the
  fraction of line rate NCCL's sockets reach, measured with nccl-tests ``all_reduce_perf``
  (ring bus bandwidth, large messages): "not more than 60% of wire speed over 32Gbps
  networks" (NVIDIA/nccl#209, V100 hosts), and 4-6 GB/s bus bandwidth between four
  8 x V100 hosts on 100 Gb/s TCP, "less than half" the 12.5 GB/s line rate (NVIDIA/nccl#450):
  ``SOCKET_EFFICIENCY`` 0.6 up to 50 Gb/s, 0.4 at 100 Gb/s (5 GB/s of 12.5).
- Latency: 38-46 µs for an 8-byte NCCL broadcast between two V100 hosts over the socket
  transport (nccl-tests#82, ``NCCL_IB_DISABLE=1``, ring, simple protocol): ``SOCKET_LATENCY``
  40 µs per hop, against 8 µs on InfiniBand (``planner.presets``).

The figures are those of AWS and Google Cloud instance pages (network bandwidth per
instance; "up to" figures are burst rates, used as they are since a training step's
transfers are bursts).
"""

from __future__ import annotations

from typing import Any

SOCKET_LATENCY = 40e-6  # s per hop, NCCL socket transport (nccl-tests#82: 38-46 µs, 8-byte broadcast)
_NVLINK_LATENCY = 3e-6  # s, as planner.presets (estimate)


def socket_efficiency(gbps: float) -> float:
    """Fraction of a ``gbps`` Gb/s line rate that NCCL's socket transport reaches: 0.6 up to
    50 Gb/s (NVIDIA/nccl#209, measured at 32 Gb/s), 0.4 above (NVIDIA/nccl#450, at 100 Gb/s)."""
    return 0.6 if gbps <= 50 else 0.4


def socket_bandwidth(gbps: float, gpus_per_node: int) -> float:
    """Bytes/s per direction per GPU that NCCL's sockets give each of a machine's
    ``gpus_per_node`` GPUs on a ``gbps`` Gb/s network: ``gbps * 1e9 / 8 * efficiency / gpus``."""
    return gbps * 1e9 / 8 * socket_efficiency(gbps) / gpus_per_node


_V100 = {  # NVIDIA V100 datasheet (SXM2)
    "peak_flops": {"float32": 15.7e12, "float16": 125e12},  # FLOP/s; tensor-core fp16, no bf16
    "memory_bandwidth": 900e9,  # bytes/s, 900 GB/s HBM2
}
_A100_40GB = {  # NVIDIA A100 datasheet (SXM4 40GB), FLOP/s dense
    "name": "A100-SXM4-40GB",
    "peak_flops": {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
    "memory_bytes": 40_000_000_000,  # bytes, 40 GB HBM2, decimal GB
    "memory_bandwidth": 1.555e12,  # bytes/s, 1,555 GB/s
}
_T4 = {  # NVIDIA T4 datasheet
    "name": "T4-16GB",
    "peak_flops": {"float32": 8.1e12, "float16": 65e12},  # FLOP/s; mixed-precision fp16 tensor cores
    "memory_bytes": 16_000_000_000,  # bytes, 16 GB GDDR6
    "memory_bandwidth": 320e9,  # bytes/s, 320+ GB/s
}
# A100's NVLink 3 through NVSwitch on A2's 8-GPU machines (600 GB/s bidirectional per GPU,
# A100 datasheet); PCIe 3.0 x16 between T4s (16 GB/s per direction, no NVLink on T4).
_NVLINK3 = {"bandwidth": 300e9, "latency": _NVLINK_LATENCY}
_PCIE3 = {"bandwidth": 16e9, "latency": 5e-6}  # latency: estimate, a PCIe hop through the host


def _instance(description: str, gpus: int, device: dict[str, Any], intra: dict[str, float], gbps: float) -> dict[str, Any]:
    return {
        "description": f"{description}; {gbps:g} Gb/s Ethernet, NCCL sockets",
        "backend": "nccl",
        "devices_per_node": gpus,
        "device": device,
        "intra_node": intra,
        "inter_node": {"bandwidth": socket_bandwidth(gbps, gpus), "latency": SOCKET_LATENCY},
    }


ETHERNET_PRESETS: dict[str, dict[str, Any]] = {
    # AWS EC2 P3 page: p3.2xlarge, 1 x V100 16 GB, "Up to 10 Gbps".
    "p3.2xlarge": _instance("AWS p3.2xlarge: 1 x V100-SXM2-16GB", 1,
                            {"name": "V100-SXM2-16GB", **_V100, "memory_bytes": 16_000_000_000},
                            {"bandwidth": 150e9, "latency": _NVLINK_LATENCY}, 10),
    # Google Cloud A2 machine types: a2-highgpu-1g, 1 x A100 40GB, 24 Gbps default egress.
    "a2-highgpu-1g": _instance("Google Cloud a2-highgpu-1g: 1 x A100-SXM4-40GB", 1, _A100_40GB, _NVLINK3, 24),
    # AWS EC2 G4 page: g4dn.8xlarge, 1 x T4, 50 Gbps.
    "g4dn.8xlarge": _instance("AWS g4dn.8xlarge: 1 x T4-16GB", 1, _T4, _PCIE3, 50),
    # Google Cloud A2: a2-highgpu-4g, 4 x A100 40GB, 50 Gbps.
    "a2-highgpu-4g": _instance("Google Cloud a2-highgpu-4g: 4 x A100-SXM4-40GB, NVLink", 4, _A100_40GB, _NVLINK3, 50),
    # Google Cloud A2: a2-highgpu-8g, 8 x A100 40GB with NVSwitch, 100 Gbps.
    "a2-highgpu-8g": _instance("Google Cloud a2-highgpu-8g: 8 x A100-SXM4-40GB, NVSwitch", 8, _A100_40GB, _NVLINK3, 100),
    # AWS EC2 P3 page: p3dn.24xlarge, 8 x V100 32 GB, NVLink, 100 Gbps (here without EFA).
    "p3dn.24xlarge": _instance("AWS p3dn.24xlarge: 8 x V100-SXM2-32GB, NVLink 2", 8,
                               {"name": "V100-SXM2-32GB", **_V100, "memory_bytes": 32_000_000_000},
                               {"bandwidth": 150e9, "latency": _NVLINK_LATENCY}, 100),
}
