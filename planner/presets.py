"""Built-in cluster presets: public spec numbers, each with its source.

Pure data in the cluster-file layout (see ``planner.cluster``), so presets and user files go
through one parser. Units: FLOP/s (dense, no structured sparsity), bytes, bytes/s per
direction per device, seconds. This module imports only ``planner.gpu_presets`` (the presets
named by GPU and cloud instance type, added at its end, and the usable memory of a GPU) and
``planner.ethernet_presets`` (cloud instances on Ethernet, added at its end), both data that
import nothing.

Memory sizes: the A100-80GB and H100-80GB presets (and the H800, the same 80 GB board) hold
what a training process can allocate, the total nvidia-smi reports (81,920 and 81,559 MiB)
less the CUDA context and one NCCL communicator, each figure cited (``planner.gpu_presets.usable_memory_bytes``: 80,932 MiB =
84.86e9 bytes and 80,571 MiB = 84.49e9 bytes, where the datasheets' round "80 GB" was 80e9).
The other devices still use the datasheet's decimal gigabytes, a margin of uncited size.

Latencies are not on any datasheet: they are typical NCCL small-message latencies per hop,
estimates to be replaced by measured ones (``python -m planner profile -o cluster.toml``).

``nccl_tests`` (the DGX presets only): what NCCL achieves on the preset's links, as public
nccl-tests runs measured it. ``cost_model.nccl`` prices those presets' collectives from these
figures, and those of every cluster derived from them (``Cluster.derived_from``), scaled for
the links a derived cluster changed.
"""

from __future__ import annotations

from typing import Any

from planner.gpu_presets import NVIDIA_SMI_TOTAL_MIB, usable_memory_bytes

# Shared link estimates (seconds): typical NCCL small-message latency per hop, estimates.
_NVLINK_LATENCY = 3e-6  # s, NVLink/NVSwitch hop, estimate
_INFINIBAND_LATENCY = 8e-6  # s, GPUDirect RDMA over InfiniBand, estimate
_TCP_LATENCY = 30e-6  # s, NCCL socket transport over datacenter Ethernet (no EFA), estimate

PRESETS: dict[str, dict[str, Any]] = {
    "dgx-a100-80g": {
        "description": "NVIDIA DGX A100: 8 x A100-SXM4-80GB, NVLink 3/NVSwitch, 8 x HDR InfiniBand",
        "backend": "nccl",
        "devices_per_node": 8,  # DGX A100 user guide: 8 GPUs per system
        "device": {
            "name": "A100-SXM4-80GB",
            "peak_flops": {  # FLOP/s dense (NVIDIA A100 datasheet; sparse figures are 2x)
                "float32": 19.5e12,
                "tf32": 156e12,
                "bfloat16": 312e12,
                "float16": 312e12,
            },
            # bytes: "80GB HBM2e" (A100 datasheet) is 81,920 MiB in nvidia-smi, less the CUDA
            # context and an NCCL communicator (planner.gpu_presets.usable_memory_bytes)
            "memory_bytes": usable_memory_bytes(NVIDIA_SMI_TOTAL_MIB["A100-SXM4-80GB"]),
            "memory_bandwidth": 2.039e12,  # bytes/s, 2,039 GB/s HBM2e, SXM 80GB (A100 datasheet)
        },
        "intra_node": {
            # bytes/s per direction per GPU, NVLink 3: 600 GB/s total bidirectional per GPU
            # through NVSwitch (NVIDIA A100 datasheet)
            "bandwidth": 300e9,
            "latency": _NVLINK_LATENCY,
        },
        "inter_node": {
            # bytes/s per direction per GPU: 8 x 200 Gb/s HDR InfiniBand ConnectX-6 per node,
            # one per GPU (DGX A100 user guide) -> 200e9 / 8 bits = 25e9 B/s
            "bandwidth": 25e9,
            "latency": _INFINIBAND_LATENCY,
        },
        # Collectives as NCCL runs them on this hardware, published nccl-tests figures, bytes/s
        # (how ``cost_model.nccl`` uses each: its ``NcclProfile``).
        "nccl_tests": {
            # 232.54 GB/s: all_reduce_perf -b 8 -e 4G -g 8 on one 8 x A100 NVSwitch node
            # (NVIDIA/nccl#1048 and NVIDIA/nccl-tests#175); NVIDIA engineers quote "close to
            # 240 GB/s" (NVIDIA/nccl#1712).
            "ring_busbw": 232.5e9,
            # 24 GB/s per 200 Gb/s HDR NIC, "what we see ourselves in general on perfect setups"
            # (NVIDIA, NVIDIA/nccl-tests#160; also NVIDIA/nccl#412); 8 of them: NVIDIA measures
            # 192 GB/s all-reduce busbw across DGX A100s (NVIDIA/nccl#812).
            "nic_busbw": 24e9,
            "nvls_algbw": None,  # A100's NVSwitch cannot reduce
            "sources": "NVIDIA/nccl#1048, NVIDIA/nccl-tests#175, NVIDIA/nccl-tests#160, NVIDIA/nccl#812",
        },
    },
    "dgx-h100": {
        "description": "NVIDIA DGX H100: 8 x H100-SXM5-80GB, NVLink 4/NVSwitch, 8 x NDR InfiniBand",
        "backend": "nccl",
        "devices_per_node": 8,  # DGX H100 user guide: 8 GPUs per system
        "device": {
            "name": "H100-SXM5-80GB",
            "peak_flops": {  # FLOP/s dense (NVIDIA H100 datasheet lists sparse = 2x these)
                "float32": 67e12,
                "tf32": 494.7e12,
                "bfloat16": 989.4e12,
                "float16": 989.4e12,
                "float8": 1978.9e12,
            },
            # bytes: "80GB HBM3" (H100 SXM datasheet) is 81,559 MiB in nvidia-smi, less the CUDA
            # context and an NCCL communicator (planner.gpu_presets.usable_memory_bytes)
            "memory_bytes": usable_memory_bytes(NVIDIA_SMI_TOTAL_MIB["H100-SXM5-80GB"]),
            "memory_bandwidth": 3.35e12,  # bytes/s, 3.35 TB/s HBM3 (H100 SXM datasheet)
        },
        "intra_node": {
            # bytes/s per direction per GPU, NVLink 4: 900 GB/s total bidirectional per GPU
            # through NVSwitch (NVIDIA H100 datasheet)
            "bandwidth": 450e9,
            "latency": _NVLINK_LATENCY,
        },
        "inter_node": {
            # bytes/s per direction per GPU: 8 x 400 Gb/s NDR InfiniBand ConnectX-7 per node,
            # one per GPU (DGX H100 user guide) -> 400e9 / 8 bits = 50e9 B/s
            "bandwidth": 50e9,
            "latency": _INFINIBAND_LATENCY,
        },
        "nccl_tests": {  # as for dgx-a100-80g, bytes/s
            # ~370 GB/s: "NCCL can get an effective NVLink bandwidth of 370GB/s" on ring and
            # non-all-reduce collectives (NVIDIA, NVIDIA/nccl-tests#212); 365-370 GB/s measured at
            # 2-8 GPUs (NVIDIA/nccl#1455), 368.76 GB/s (NVIDIA/nccl-tests#309).
            "ring_busbw": 370e9,
            # "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (NVIDIA, NVIDIA/nccl-tests#290).
            "nic_busbw": 47e9,
            # NVLS on 8 H100s: busbw ~480 GB/s, "algbw ~275GB/s" (NVIDIA, NVIDIA/nccl-tests#212;
            # GTC S62129 via NVIDIA/nccl#1374; 476 GB/s in NVIDIA/nccl-tests#290).
            "nvls_algbw": 275e9,
            "sources": "NVIDIA/nccl-tests#212, NVIDIA/nccl#1455, NVIDIA/nccl-tests#290",
        },
    },
    "hgx-h800": {
        "description": "NVIDIA HGX H800 (DeepSeek-V3's cluster): 8 x H800-SXM5-80GB, NVLink 400 GB/s, 8 x NDR InfiniBand",
        "backend": "nccl",
        # DeepSeek-V3 technical report (arXiv 2412.19437), section 3.1: "Each node in the H800
        # cluster contains 8 GPUs connected by NVLink and NVSwitch within nodes"
        "devices_per_node": 8,
        "device": {
            "name": "H800-SXM5-80GB",
            # FLOP/s dense: the H800 SXM5 datasheet lists the H100 SXM5's tensor-core figures
            # (the export variant cuts NVLink, see intra_node, and FP64, which no plan uses)
            "peak_flops": {
                "float32": 67e12,
                "tf32": 494.7e12,
                "bfloat16": 989.4e12,
                "float16": 989.4e12,
                "float8": 1978.9e12,
            },
            # bytes: 80 GB HBM3 as the H100 SXM5's, so the H100's usable memory (no nvidia-smi
            # total of an H800 found; planner.gpu_presets.usable_memory_bytes)
            "memory_bytes": usable_memory_bytes(NVIDIA_SMI_TOTAL_MIB["H100-SXM5-80GB"]),
            "memory_bandwidth": 3.35e12,  # bytes/s, 3.35 TB/s HBM3 (as H100 SXM5)
        },
        "intra_node": {
            # bytes/s per direction per GPU: H800's NVLink is 400 GB/s total bidirectional (NVIDIA
            # H800 product brief; 900 GB/s on H100) -> 200e9 per direction. What kernels reach:
            # "NVLink offers a bandwidth of 160 GB/s" (DeepSeek-V3 report, section 3.2.2),
            # "~160 GB/s NVLink maximum bandwidth" (deepseek-ai/DeepEP README, on H800).
            "bandwidth": 200e9,
            "latency": _NVLINK_LATENCY,
        },
        "inter_node": {
            # bytes/s per direction per GPU: one 400 Gb/s CX7 InfiniBand NIC per GPU, 8 per node
            # (DeepEP README: "each connected to a CX7 InfiniBand 400 Gb/s RDMA network card
            # (~50 GB/s maximum bandwidth)"; DeepSeek-V3 report 3.2.2: "IB (50 GB/s)") -> 50e9
            "bandwidth": 50e9,
            "latency": _INFINIBAND_LATENCY,
        },
        # No "nccl_tests": no public nccl-tests run on H800 is cited here, so its collectives are
        # priced by the alpha-beta model of ``cost_model.collectives``.
    },
    "p3.16xlarge": {
        "description": "AWS p3.16xlarge: 8 x V100-SXM2-16GB, NVLink 2 cube mesh, 25 Gb/s Ethernet",
        "backend": "nccl",
        "devices_per_node": 8,  # AWS EC2 P3 instance page: 8 GPUs
        "device": {
            "name": "V100-SXM2-16GB",
            "peak_flops": {  # FLOP/s (NVIDIA V100 datasheet, SXM2); no tf32, no bf16
                "float32": 15.7e12,
                "float16": 125e12,  # tensor-core mixed precision ("Tensor Performance")
            },
            "memory_bytes": 16_000_000_000,  # bytes, 16 GB HBM2 (V100 datasheet), decimal GB
            "memory_bandwidth": 900e9,  # bytes/s, 900 GB/s HBM2 (V100 datasheet)
        },
        "intra_node": {
            # bytes/s per direction per GPU, NVLink 2: 6 links x 25 GB/s per direction
            # (300 GB/s total bidirectional, V100 datasheet). The hybrid cube mesh joins each GPU
            # to only 4 of the 7 others, so this per-GPU aggregate is an upper bound that rings
            # over the mesh reach but arbitrary pairs do not.
            "bandwidth": 150e9,
            "latency": _NVLINK_LATENCY,
        },
        "inter_node": {
            # bytes/s per direction per GPU: "25 Gigabit" network per instance (AWS EC2 P3
            # page) shared by 8 GPUs -> 25e9 / 8 bits / 8 GPUs = 390.625e6 B/s
            "bandwidth": 25e9 / 8 / 8,
            "latency": _TCP_LATENCY,
        },
    },
    "cpu": {
        "description": "worker processes on one host over gloo (placeholder numbers)",
        "backend": "gloo",
        "devices_per_node": 2,  # processes per host; "cpu:1x4" gives 4
        # Rough placeholders for one laptop-class core per process, not measurements: replace
        # them with a profile of the machine (``python -m planner profile --nproc N -o
        # cluster.toml``, then ``--cluster cluster.toml``).
        "device": {
            "name": "cpu-process",
            "peak_flops": {"float32": 50e9, "bfloat16": 50e9},  # FLOP/s, placeholder
            "memory_bytes": 8 * 2**30,  # bytes, 8 GiB, placeholder
            "memory_bandwidth": 10e9,  # bytes/s, placeholder
        },
        "intra_node": {"bandwidth": 2e9, "latency": 50e-6},  # gloo over loopback, placeholder
        # Only used with "cpu:NODESx..." for several hosts: 10 Gb/s Ethernet shared by the
        # host's processes, placeholder.
        "inter_node": {"bandwidth": 1e9, "latency": 100e-6},
    },
}

# GPUs and cloud instance types by name (h100, a100-40g, p5, nd-h100-v5...): planner.gpu_presets.
from planner.gpu_presets import gpu_presets  # noqa: E402 - after PRESETS, which it reads

PRESETS.update(gpu_presets(PRESETS))

# Cloud instances on commodity Ethernet, priced through NCCL's socket transport.
from planner.ethernet_presets import ETHERNET_PRESETS  # noqa: E402  (data only; imports nothing)

PRESETS.update(ETHERNET_PRESETS)
