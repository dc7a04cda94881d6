"""NCCL model against published nccl-tests figures: predicted vs published bus bandwidth.

    python benchmarks/nccl_fidelity.py

Each row is one public measurement (its source in the last column): the collective, the
preset, the group (ranks, nodes), the message size, the published busbw (or latency), what
``cost_model.collectives.collective_time`` predicts, and the error. The α–β model's prediction
(the preset's datasheet links under another name) is printed alongside for comparison.
Some rows are the figures the model's constants were read from (they check the formulas
reproduce them at the published size); the others are independent checks. Prints a median
absolute error at the end.
"""

from __future__ import annotations

import dataclasses
import statistics

from cost_model.collectives import collective_time
from cost_model.nccl import bus_bytes
from planner.cluster import Cluster

GIB = 2**30

# (kind, preset, nodes, ranks, size bytes, published value, unit, source, used to set a constant)
# unit "GB/s": busbw as nccl-tests reports it; "us": time of one collective.
PUBLISHED = [
    ("all_reduce", "dgx-a100-80g", 1, 8, 4 * GIB, 232.54, "GB/s", "NVIDIA/nccl#1048 (-e 4G)", True),
    ("all_reduce", "dgx-a100-80g", 4, 32, 8 * GIB, 192.0, "GB/s", "NVIDIA/nccl#812 (NVIDIA, DGX A100 8x HDR)", True),
    ("all_reduce", "dgx-a100-80g", 1, 2, 32, 10.14, "us", "NVIDIA/nccl#583 (2 x A100, 32 B)", False),
    ("all_reduce", "dgx-h100", 1, 8, 8 * GIB, 480.0, "GB/s", "NVIDIA/nccl-tests#212 (NVIDIA, NVLS)", True),
    ("all_reduce", "dgx-h100", 1, 8, 8 * GIB, 476.0, "GB/s", "NVIDIA/nccl-tests#290 (NVLS)", False),
    ("all_gather", "dgx-h100", 1, 8, 8 * GIB, 370.0, "GB/s", "NVIDIA/nccl-tests#212 (non-all-reduce)", True),
    # NVIDIA/nccl#1455: NCCL_ALGO=NVLS -b 2G -e 4G on 2..8 H100s of one node: busbw ~370 GB/s
    # at 2-4 GPUs (as ring), 420, 440, 460 GB/s at 5, 6, 7 GPUs.
    ("all_reduce", "dgx-h100", 1, 2, 4 * GIB, 367.5, "GB/s", "NVIDIA/nccl#1455 (2 GPUs)", True),
    ("all_reduce", "dgx-h100", 1, 4, 4 * GIB, 367.5, "GB/s", "NVIDIA/nccl#1455 (4 GPUs)", True),
    ("all_reduce", "dgx-h100", 1, 5, 4 * GIB, 420.0, "GB/s", "NVIDIA/nccl#1455 (5 GPUs, NVLS)", False),
    ("all_reduce", "dgx-h100", 1, 6, 4 * GIB, 440.0, "GB/s", "NVIDIA/nccl#1455 (6 GPUs, NVLS)", False),
    ("all_reduce", "dgx-h100", 1, 7, 4 * GIB, 460.0, "GB/s", "NVIDIA/nccl#1455 (7 GPUs, NVLS)", False),
    ("all_reduce", "dgx-h100", 4, 32, 8 * GIB, 320.0, "GB/s", "NVIDIA/nccl#1221 (8x400G RoCE, >2 nodes)", False),
]


def alpha_beta(cluster: Cluster) -> Cluster:
    """The same hardware described from scratch, not derived from the preset, so without
    its NCCL measurements (priced α–β)."""
    return dataclasses.replace(cluster, name=f"{cluster.name}-datasheet", derived_from=None)


def predicted(kind: str, cluster: Cluster, ranks: int, size: int, unit: str) -> float:
    seconds = collective_time(kind, size, cluster, list(range(ranks)))
    return seconds * 1e6 if unit == "us" else bus_bytes(kind, size, ranks) / seconds / 1e9


def main() -> None:
    header = (f"{'collective':<11} {'preset':<13} {'ranks':>5} {'nodes':>5} {'size':>9} {'published':>10} "
              f"{'NCCL model':>10} {'error':>7} {'alpha-beta':>10} {'error':>7}  source")
    print(header)
    print("-" * len(header))
    errors = []
    independent = []
    for kind, preset, nodes, ranks, size, published, unit, source, fitted in PUBLISHED:
        cluster = Cluster.preset(preset, nodes=nodes)
        model = predicted(kind, cluster, ranks, size, unit)
        datasheet = predicted(kind, alpha_beta(cluster), ranks, size, unit)
        error = model / published - 1
        errors.append(abs(error))
        if not fitted:
            independent.append(abs(error))
        size_text = f"{size / GIB:.0f} GiB" if size >= GIB else f"{size} B"
        print(f"{kind:<11} {preset:<13} {ranks:>5} {nodes:>5} {size_text:>9} {published:>7.1f} {unit:<4}"
              f"{model:>8.1f} {error:>+8.1%} {datasheet:>10.1f} {datasheet / published - 1:>+8.1%}  "
              f"{source}{' [constant read from it]' if fitted else ''}")
    print(f"median |error|: all rows {statistics.median(errors):.1%}, "
          f"rows not used to set a constant {statistics.median(independent):.1%}")


if __name__ == "__main__":
    main()
