"""Cluster presets named by GPU and by cloud instance type: ``--cluster h100:16``, ``a100-40g:8x4``,
``p5:4``, ``nd-h100-v5:2`` (Google Cloud's A100 machines on Ethernet are ``planner.ethernet_presets``'
``a2-highgpu-*``).

Each is one 8-GPU server (``NAME:NODES`` or ``NAME:NODESxGPUS``) with the datasheet figures of
its GPU (but the 80 GB GPUs' memory: what nvidia-smi reports less a cited reserve,
``usable_memory_bytes``) and the links its vendor states, each cited where it is written. ``gpu_presets``
returns them in the cluster-file layout of ``planner.presets``, which adds them to
``PRESETS``; the GPU names reuse the DGX/HGX presets' measured NCCL figures where the links
are the same hardware (``h100``, ``h200``: NVLink 4 + NDR; ``a100``, ``a100-40g``: NVLink 3
+ HDR), so a plan on ``h100:4`` is priced exactly as one on ``dgx-h100:4``.

Kernel efficiencies follow the device name (``cost_model.gpu_kernels``: V100, A100, H100,
H200); the L40S and MI300X have no measured kernel table here and are priced by the roofline
with the default efficiencies: profile them (``planner profile``) before trusting a plan.

Latencies are estimates, as in ``planner.presets``: NVLink 3 us, InfiniBand 8 us, EFA 15 us
(libfabric's SRD over the AWS Nitro card, a round trip above InfiniBand's), TCP-based cloud
transports 30 us.

This module imports nothing (``planner.presets`` imports it).
"""

from __future__ import annotations

import copy
from typing import Any

_NVLINK = 3e-6  # s, NVLink/NVSwitch/Infinity Fabric hop, estimate
_INFINIBAND = 8e-6  # s, GPUDirect RDMA over InfiniBand, estimate
_EFA = 15e-6  # s, AWS Elastic Fabric Adapter (SRD), estimate
_TCP = 30e-6  # s, GPUDirect-TCPX / socket transports over Ethernet, estimate

# Per GPU, dense FLOP/s (datasheets list sparse figures at 2x).
_A100_FLOPS = {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12}  # A100 datasheet
_H100_FLOPS = {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12}  # H100 SXM datasheet


# Device memory a training process can allocate: the total the board reports (nvidia-smi's
# "Memory-Usage" column) less what every process holds before its first tensor. The
# datasheets' "80GB" is a round decimal figure, not the size.
NVIDIA_SMI_TOTAL_MIB = {
    # "0MiB / 81559MiB" for "NVIDIA H100 80GB HBM3" (nvidia-smi in NVIDIA/nccl#1264, 8 x H100
    # SXM; the same total in wilicc/gpu-burn#114); modal-labs/modal-client#2797 lists H100
    # 81559MiB and A100 80GB 81920MiB from nvidia-smi on its fleet.
    "H100-SXM5-80GB": 81_559,
    "A100-SXM4-80GB": 81_920,
}
# MiB held by the CUDA context of a PyTorch process with lazy module loading (CUDA >= 11.7):
# "the currently used ~300MB" (NVIDIA's ptrblck, pytorch/pytorch#107667, 2023-08).
CUDA_CONTEXT_MIB = 300
# MiB one NCCL communicator over more than two NVLink-connected GPUs holds once it has run a
# collective: 688 MB measured through PyTorch on 4 x A100 with NVLink (NVIDIA/nccl#964; 544 MB
# for a group of two). A plan has at least one; NCCL's maintainers say each further
# communicator holds more (NVIDIA/nccl#986), which this reserve does not count. Both sources'
# "MB" are read as MiB, the unit nvidia-smi and torch's memory counters print.
NCCL_COMMUNICATOR_MIB = 688


def usable_memory_bytes(total_mib: int) -> int:
    """Bytes of a GPU reporting ``total_mib`` MiB (nvidia-smi) that a training process can
    allocate: the total less the CUDA context and one NCCL communicator
    (``CUDA_CONTEXT_MIB``, ``NCCL_COMMUNICATOR_MIB``). The caching allocator's fragmentation is
    not subtracted: no public figure bounds it for a training step."""
    return (total_mib - CUDA_CONTEXT_MIB - NCCL_COMMUNICATOR_MIB) * 2**20


def _gb_per_s(gigabits: float, gpus: int = 8) -> float:
    """A node's stated network rate in Gb/s as bytes/s per direction per GPU."""
    return gigabits * 1e9 / 8 / gpus


def _server(description: str, device: dict, intra: tuple[float, float], inter: tuple[float, float],
            nccl_from: str | None = None) -> dict[str, Any]:
    entry = {
        "description": description,
        "backend": "nccl",
        "devices_per_node": 8,
        "device": device,
        "intra_node": {"bandwidth": intra[0], "latency": intra[1]},
        "inter_node": {"bandwidth": inter[0], "latency": inter[1]},
    }
    if nccl_from is not None:
        entry["nccl_from"] = nccl_from
    return entry


_A100_80 = {"name": "A100-SXM4-80GB", "peak_flops": _A100_FLOPS,
            # 80 GB HBM2e (A100 datasheet): 81,920 MiB less the reserve (usable_memory_bytes)
            "memory_bytes": usable_memory_bytes(NVIDIA_SMI_TOTAL_MIB["A100-SXM4-80GB"]),
            "memory_bandwidth": 2.039e12}  # 2,039 GB/s (A100 datasheet, SXM 80GB)
_A100_40 = {"name": "A100-SXM4-40GB", "peak_flops": _A100_FLOPS,
            "memory_bytes": 40_000_000_000,  # 40 GB HBM2 (A100 datasheet)
            "memory_bandwidth": 1.555e12}  # 1,555 GB/s (A100 datasheet, SXM 40GB)
_H100 = {"name": "H100-SXM5-80GB", "peak_flops": _H100_FLOPS,
         # 80 GB HBM3 (H100 datasheet): 81,559 MiB less the reserve (usable_memory_bytes)
         "memory_bytes": usable_memory_bytes(NVIDIA_SMI_TOTAL_MIB["H100-SXM5-80GB"]),
         "memory_bandwidth": 3.35e12}  # 3.35 TB/s (H100 datasheet, SXM)
_H200 = {"name": "H200-SXM-141GB", "peak_flops": _H100_FLOPS,  # same GH100 compute (H200 datasheet)
         "memory_bytes": 141_000_000_000,  # 141 GB HBM3e (H200 datasheet)
         "memory_bandwidth": 4.8e12}  # 4.8 TB/s (H200 datasheet)
_V100_32 = {"name": "V100-SXM2-32GB",
            "peak_flops": {"float32": 15.7e12, "float16": 125e12},  # V100 datasheet (SXM2); no bf16, no tf32
            "memory_bytes": 32_000_000_000,  # 32 GB HBM2 (V100 datasheet)
            "memory_bandwidth": 900e9}  # 900 GB/s (V100 datasheet)
_L40S = {"name": "L40S-48GB",
         # L40S datasheet: FP32 91.6 TFLOPS; TF32 183; BF16/FP16 362.05 dense (733 with sparsity)
         "peak_flops": {"float32": 91.6e12, "tf32": 183e12, "bfloat16": 362.05e12, "float16": 362.05e12},
         "memory_bytes": 48_000_000_000,  # 48 GB GDDR6 (L40S datasheet)
         "memory_bandwidth": 864e9}  # 864 GB/s (L40S datasheet)
_MI300X = {"name": "MI300X-192GB",
           # AMD Instinct MI300X datasheet: FP32 matrix 163.4 TFLOPS, TF32 653.7, BF16/FP16 1307.4 dense
           "peak_flops": {"float32": 163.4e12, "tf32": 653.7e12, "bfloat16": 1307.4e12, "float16": 1307.4e12},
           "memory_bytes": 192_000_000_000,  # 192 GB HBM3 (MI300X datasheet)
           "memory_bandwidth": 5.3e12}  # 5.3 TB/s (MI300X datasheet)

# NVLink per direction per GPU: NVLink 3 600 GB/s and NVLink 4 900 GB/s total bidirectional
# (A100 and H100 datasheets); NVLink 2 300 GB/s over a hybrid cube mesh (V100 datasheet).
_NVLINK3 = (300e9, _NVLINK)
_NVLINK4 = (450e9, _NVLINK)


def gpu_presets(existing: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The presets of this module; ``existing`` (``planner.presets.PRESETS``) lends the DGX
    presets' measured NCCL figures to the servers built of the same links."""
    presets = {
        "h100": _server("8 x H100-SXM5-80GB server (DGX/HGX H100): NVLink 4/NVSwitch, 8 x NDR 400 Gb/s "
                        "InfiniBand; same figures as dgx-h100", _H100, _NVLINK4,
                        (_gb_per_s(8 * 400), _INFINIBAND), nccl_from="dgx-h100"),
        "h200": _server("8 x H200-SXM-141GB server (HGX H200): NVLink 4/NVSwitch, 8 x NDR 400 Gb/s "
                        "InfiniBand", _H200, _NVLINK4, (_gb_per_s(8 * 400), _INFINIBAND), nccl_from="dgx-h100"),
        "a100": _server("8 x A100-SXM4-80GB server (DGX/HGX A100): NVLink 3/NVSwitch, 8 x HDR 200 Gb/s "
                        "InfiniBand; same figures as dgx-a100-80g", _A100_80, _NVLINK3,
                        (_gb_per_s(8 * 200), _INFINIBAND), nccl_from="dgx-a100-80g"),
        "a100-40g": _server("8 x A100-SXM4-40GB server (DGX A100 320GB): NVLink 3/NVSwitch, 8 x HDR 200 Gb/s "
                            "InfiniBand", _A100_40, _NVLINK3, (_gb_per_s(8 * 200), _INFINIBAND),
                            nccl_from="dgx-a100-80g"),
        # DGX-1 datasheet: 8 x V100 in an NVLink 2 hybrid cube mesh, 4 x 100 Gb/s EDR InfiniBand.
        "v100": _server("8 x V100-SXM2-32GB server (DGX-1): NVLink 2 cube mesh, 4 x EDR 100 Gb/s InfiniBand",
                        _V100_32, (150e9, _NVLINK), (_gb_per_s(4 * 100), _INFINIBAND)),
        # L40S: no NVLink; PCIe Gen4 x16, 64 GB/s bidirectional (L40S datasheet). The network of
        # AWS g6e.48xlarge (8 x L40S): 400 Gb/s (AWS EC2 G6e instance page).
        "l40s": _server("8 x L40S-48GB PCIe server (network of AWS g6e.48xlarge, 400 Gb/s); roofline kernel "
                        "model: profile to calibrate", _L40S, (32e9, 5e-6), (_gb_per_s(400), _EFA)),
        # MI300X platform: 8 GPUs fully connected by Infinity Fabric, 7 links x 128 GB/s = 896 GB/s
        # aggregate bidirectional per GPU (MI300X datasheet); one 400 Gb/s NIC per GPU in AMD's
        # reference node. A ring over the fully connected mesh reaches the aggregate.
        "mi300x": _server("8 x MI300X-192GB platform: Infinity Fabric 896 GB/s per GPU, 8 x 400 Gb/s; "
                          "roofline kernel model: profile to calibrate", _MI300X, (448e9, _NVLINK),
                          (_gb_per_s(8 * 400), _INFINIBAND)),
        # AWS EC2 P4d page: p4d.24xlarge, 8 x A100 40GB, NVSwitch 600 GB/s, 400 Gb/s EFA.
        "p4d": _server("AWS p4d.24xlarge: 8 x A100-SXM4-40GB, NVSwitch, 400 Gb/s EFA", _A100_40, _NVLINK3,
                       (_gb_per_s(400), _EFA)),
        # AWS EC2 P5 page: p5.48xlarge, 8 x H100 80GB, NVSwitch 900 GB/s, 3,200 Gb/s EFA (v2).
        "p5": _server("AWS p5.48xlarge: 8 x H100-SXM5-80GB, NVSwitch, 3200 Gb/s EFA", _H100, _NVLINK4,
                      (_gb_per_s(3200), _EFA)),
        # Google Cloud accelerator-optimized machine types: a3-highgpu-8g, 8 x H100 80GB, 1,000 Gb/s maximum network bandwidth (GPUDirect-TCPX).
        "a3": _server("Google Cloud a3-highgpu-8g: 8 x H100-SXM5-80GB, NVSwitch, 1000 Gb/s GPUDirect-TCPX",
                      _H100, _NVLINK4, (_gb_per_s(1000), _TCP)),
        # Azure ND H100 v5 documentation: 8 x H100 80GB over NVLink 4, 3.2 Tb/s of InfiniBand per VM
        # (8 x 400 Gb/s NDR, one per GPU).
        "nd-h100-v5": _server("Azure ND H100 v5: 8 x H100-SXM5-80GB, NVLink 4, 8 x NDR 400 Gb/s InfiniBand",
                              _H100, _NVLINK4, (_gb_per_s(3200), _INFINIBAND)),
    }
    for entry in presets.values():
        source = entry.pop("nccl_from", None)
        if source is not None and "nccl_tests" in existing.get(source, {}):
            entry["nccl_tests"] = copy.deepcopy(existing[source]["nccl_tests"])
    return presets
