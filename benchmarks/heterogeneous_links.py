"""Rows (g) and (h) of ``benchmarks/heterogeneous.py`` (simulated, nothing launched):

(g) Links per pair and collectives that keep traffic inside a site: the all-reduce of a
    GPT-13B's bf16 gradients over every rank of ``examples/clusters/two-sites.toml`` (two DGX
    A100 nodes in each of two buildings, 100 Gb/s between them) and of
    ``examples/clusters/three-racks.toml`` (racks a and b of DGX A100 nodes under one spine, rack
    c of PCIe-only L40S servers behind a 400 Gb/s uplink), and over racks a and b alone: the
    flat ring at the slowest link it crosses against the hierarchical algorithm across sites
    (``cost_model.site_collectives``), with the links crossed named.
(h) Pipeline stages of different widths (``planner.families.hetero_pipeline.widths``): one DGX
    H100 node and two DGX A100 nodes (8 + 16 GPUs, one InfiniBand network), a GPT-2.7B-shaped
    model (32 x 2560) at a batch of 64 sequences of 1024, DDP in bf16: the best layout whose
    stages share one width against the best of any widths, each stage's device, width, blocks,
    samples per rank per micro-batch and the link its gradient all-reduce crosses, and whether
    the layout is compiled (stages of different widths: in fp32, ``codegen.uneven_width_emit``;
    a bf16 plan of them is refused in one line).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cost_model.collectives import site_algorithm_times  # noqa: E402
from planner.cluster_links import crossed_link, site_members  # noqa: E402
from planner.api import prepare_model  # noqa: E402
from planner.cluster import Cluster, format_si  # noqa: E402
from planner.model_spec import ModelSpec  # noqa: E402
from search.budget import SearchBudget  # noqa: E402

# GPT-13B (benchmarks/heterogeneous.py's GPT_13B): 12 L d^2 + V d parameters
# = 12 x 40 x 5120^2 + 50368 x 5120 = 12.84e9, 2 bytes each in bf16.
GPT_13B_GRADIENT_BYTES = 2 * (12 * 40 * 5120**2 + 50368 * 5120)
# GPT-3 2.7B's shape (Brown et al. 2020, table 2.1) at sequence 1024, 64 sequences a step.
GPT_2_7B = {"n_layer": 32, "n_embd": 2560, "n_head": 32, "vocab_size": 50368, "seq_len": 1024, "batch_size": 64}


def site_rows() -> None:
    """(g): flat against hierarchical across sites."""
    cases = (
        ("two-sites, all 32 GPUs", REPO / "examples/clusters/two-sites.toml", None),
        ("three-racks, all 48 GPUs", REPO / "examples/clusters/three-racks.toml", None),
        ("three-racks, racks a + b (32 GPUs)", REPO / "examples/clusters/three-racks.toml", range(32)),
    )
    size = GPT_13B_GRADIENT_BYTES
    print(f"(g) all-reduce of a GPT-13B's bf16 gradients ({format_si(size, 'B')}), simulated:")
    for title, path, ranks in cases:
        cluster = Cluster.load(path)
        ranks = list(ranks if ranks is not None else range(cluster.world_size))
        times = site_algorithm_times("all_reduce", size, cluster, ranks)
        flat = min(times[name] for name in ("ring", "tree"))
        link = crossed_link(cluster, ranks)
        sites = ", ".join(f"{site} {len(members)}" for site, members in site_members(cluster, ranks).items())
        best = min(times, key=times.get)
        print(f"  {title} (ranks per site: {sites}): flat {flat:.2f} s at the slowest link crossed "
              f"({format_si(link.bandwidth, 'B/s')} per GPU); hierarchical across sites "
              f"{times.get('hierarchical-sites', float('nan')):.2f} s; within nodes only "
              f"{times.get('hierarchical', float('nan')):.2f} s; chosen {best}: "
              f"{flat / times[best]:.2f}x the flat ring", flush=True)


def width_rows() -> None:
    """(h): the best layout of one width against the best of any widths."""
    from planner.families.hetero_pipeline.candidates import ordered_cluster, stage_groups, width_estimates

    h100, a100 = Cluster.preset("dgx-h100"), Cluster.preset("dgx-a100-80g")
    cluster = Cluster("h100-a100", (h100.nodes[0], a100.nodes[0], a100.nodes[0]), a100.inter_link, "nccl")
    spec = ModelSpec(str(REPO / "examples/gpt.py"), GPT_2_7B)
    graph, spec, name, cluster = prepare_model(spec, cluster)
    found = width_estimates(graph, cluster, "bf16", SearchBudget())
    groups = stage_groups(cluster)
    even = next((e for e in found if not e.step.layout.uneven), None)
    uneven = next((e for e in found if e.step.layout.uneven), None)
    print("(h) pipeline stages on 1 DGX H100 + 2 DGX A100 nodes, GPT-2.7B shape, batch 64, DDP, bf16, simulated:")
    for label, estimate in (("one width", even), ("any widths", uneven)):
        if estimate is None:
            print(f"  {label}: no layout fits")
            continue
        layout = estimate.step.layout
        ordered = ordered_cluster(cluster, groups, layout.groups)
        start, stages = 0, []
        for group, width, blocks in zip(layout.groups, layout.widths, estimate.step.blocks):
            ranks = list(range(start, start + width))
            link = crossed_link(ordered, ranks)
            where = "inside a node" if link is None else f"{format_si(link.bandwidth, 'B/s')} per GPU"
            stages.append(f"{groups[group].device.name.split('-')[0]} x{width}: {blocks} blocks, "
                          f"{estimate.micro_batch // width} samples/rank/micro-batch, sync {where}")
            start += width
        print(f"  {label}: {estimate.step_s * 1e3:.1f} ms ({estimate.micro_batches} micro-batches of "
              f"{estimate.micro_batch}; gradient sync {estimate.sync_s * 1e3:.1f} ms, hops {estimate.hops_s * 1e3:.1f} ms)"
              f"\n    " + "\n    ".join(stages), flush=True)
    if even and uneven:
        print(f"  any widths against one width: {even.step_s / uneven.step_s:.2f}x; compiled: yes "
              f"({'one width: the pipeline family' if not uneven.step.layout.uneven else 'different widths: GPipe in fp32, codegen.uneven_width_emit; this bf16 plan is refused until their bf16 parity is checked'})")


if __name__ == "__main__":
    site_rows()
    width_rows()
