"""Heterogeneous clusters: uneven data-parallel shares against the even split and against the
fast devices alone, simulated on two mixes and measured on CPU; uneven tensor parallelism and
pipelines per device group likewise.

    python benchmarks/heterogeneous.py              # (a) to (d)
    python benchmarks/heterogeneous.py --simulated  # (a) and (c) only
    python benchmarks/heterogeneous.py --steps 12   # (a)-(d), with more measured steps
    python benchmarks/heterogeneous.py --pipelines  # (e) only, simulated and measured
    python benchmarks/heterogeneous.py --pipelines --simulated  # (e) simulated only, about 2 minutes
    python benchmarks/heterogeneous.py --tensor-parallel  # (c) and (d) only
    python benchmarks/heterogeneous.py --links      # (g) only: links per pair, collectives over sites
    python benchmarks/heterogeneous.py --widths     # (h) only: pipeline stages of different widths
    python benchmarks/heterogeneous.py --accpar     # (i) only: ACCPAR's own setting, about 5 minutes
    python benchmarks/heterogeneous.py --states     # (j) only: optimizer states by memory, predicted

(a) Simulated step of each mix: the even data-parallel plan (every rank B/dp samples, the step
    waits for the slowest device), the same flavour on the fastest devices alone (the others
    left out), and ours (``planner.families.uneven_dp``: shares by speed and memory).
    Mixes: ``examples/clusters/mixed.toml`` (2 fast + 2 slow CPU-class devices, GPT example at
    a CPU size, DDP) and ``examples/clusters/a100-h100.toml`` (4 DGX A100 + 4 DGX H100 nodes,
    a GPT-13B as MPT-13B's llm-foundry run: 40 layers, width 5120, 40 heads, sequence 2048,
    2 sequences per GPU, FSDP, bf16).
(b) Measured on CPU gloo at world 4 on ``mixed.toml``: the uneven and the even DDP programs of
    the CPU GPT, each rank slowed to its declared speed (``launch.py
    --slowdown-from-cluster 16``: the fast ranks 16x slower than a core of this host, the slow
    ones 32x, ``codegen/runtime/slowdown.py``),
    median step time over the steps after the first two, beside the prediction. The CPU
    devices' figures are the ``cpu`` preset's placeholders (not a profile of this host), so
    the absolute predictions are not expected to match; the ratio uneven / even is the claim.
(c) Uneven tensor parallelism (``planner.families.uneven_tp``, ACCPAR: each linear layer
    split by batch, column or row with shares by speed), simulated where tensor parallelism
    is needed: a GPT-2.7B-shaped model whose batch of 8 sequences is smaller than the 16
    GPUs of one DGX A100 and one DGX H100 node (the first node of each kind of
    ``a100-h100.toml``), so data parallelism alone cannot use them all. Rows: the same
    layer kinds with even shares (what an even-split system runs), ours, and the even
    split on the H100 node alone.
(d) Measured on CPU gloo at world 4 on ``mixed.toml`` as (b): the uneven-tp programs of the
    CPU GPT and of a 3x wider one (``WIDE_CPU_GPT``) against the same space with even shares,
    predicted and measured, with each rank's ops, op CPU and sleep per step. Before the
    slowdown stretched each op (it stretched a rank's whole forward after it ran, collectives
    included) the CPU GPT measured 0.94x against 1.13x predicted: ranks that meet at every
    split layer computed at full speed between meetings. Stretched op by op, the split
    layers' share of a rank's CPU is what decides: on a 2-core host shared with other jobs,
    the CPU GPT measured 1.13x (even 2535.4 ms, uneven 2236.2 ms) against 1.19x predicted,
    and 0.98x in another run (its split layers are about a third of a rank's op CPU: each of
    its 1166 ops per step costs about 55 us on average, where the simulator prices an op's
    dispatch at 5 us, so it puts two thirds in the split layers and the measured gain is
    small and noisy); the wide GPT, whose linear layers dominate, measured 1.29x (even
    2127.2 ms, uneven 1654.5 ms) against 1.29x predicted, and 1.25x in another run.
    In (c) the simulator keeps nearly even shares: the gathers over InfiniBand cost more
    than the A100s' smaller slices save, and the H100 node alone is faster: every op outside
    the split linears runs whole on the A100s too. With the MLPs fused:
    even 326.7 ms, ours 317.1 ms (1.03x), the H100 node alone 156.8 ms (156.0 ms before its batch
    splits' weight-gradient all-reduces were priced in fp32, as the bf16 program moves them).
(e) Pipelines with one stage per device group (``planner.families.hetero_pipeline``, Metis):
    on each mix, the family's best plan (blocks balanced by speed and memory, the stage order
    chosen), simulated, against the same configuration with Megatron-LM's even split of the
    blocks (``search.layouts.nearly_even_layers``), each stage priced on its own device; on
    ``mixed.toml`` both programs also measured as (b) measures them (the plan's cluster lists
    its nodes in stage order, so the slowdown follows each stage's device).
(f) Where uneven tensor parallelism wins (``WINNING_GPT``, ``--tensor-parallel``): on
    ``mixed.toml`` a GPT of width 768 at a batch of 4 sequences, as many samples as ranks,
    so data parallelism cannot give the fast ranks more samples than the slow ones (uneven
    shares need a batch of at least 6 here) and every rank runs the whole model's other ops
    on its sample. The linear layers are most of the work, and the fused MLPs' all-reduces
    move 4 x 64 x 768 values each against DDP's 14.6M gradients. Rows: ours, the same with even
    shares, even DDP over the four, the search's best plan on the two fast devices alone,
    and the search over all four (which picks ours); each measured as (b). Measured on the
    shared 2-core host (median of 4 steps): ours 218.8 ms predicted, 2421.7 ms measured; the
    even shares 1.30x slower predicted, 1.26x measured; even DDP 1.30x predicted, 1.71x
    measured (its 58 MB gradient all-reduce over gloo is slower than the placeholder link);
    the fast devices alone (``soap (tp=2)``, DTensor) 1.04x predicted, 1.28x measured
    (DTensor's dispatch per op, not in the placeholder figures, is stretched with the op).
(g), (h): ``benchmarks/heterogeneous_links.py`` (its docstring says what each row compares).
(i) ACCPAR's own setting (``benchmarks/heterogeneous_accpar.py``, ``examples/clusters/accpar-tpu.toml``):
    64 TPU-v2 + 64 TPU-v3 chips, batch 512, bf16, VGG-16 and a CNN; even data parallelism,
    uneven data parallelism, uneven-tp with even and with speed shares, the search's pick and
    the TPU-v3 half alone, beside the paper's reported average speed-ups (OWT 2.98x, HyPar
    3.78x, ACCPAR 6.30x over data parallelism). On VGG-16 the search's pick (ZeRO-2 with 2 or 6
    samples per chip) is predicted 1.83x faster than even data parallelism, uneven data
    parallelism alone 1.26x; uneven-tp 0.02x: it splits only the classifier's linears and runs
    every convolution on all 512 images on every chip, where ACCPAR splits convolutions too.
(j) Optimizer states by memory (``benchmarks/heterogeneous_states.py``, Cephalo), predicted:
    ``mixed.toml``'s speeds, each fast device with 1.01x and 0.85x the memory the even ZeRO-1
    plan of a 4 x 512 GPT (batch 24, fp32) needs, each slow one twice that. At 0.85x (142.9
    MB fast, 285.8 MB slow) no ZeRO-1 plan with even states fits at any micro-batch count;
    shares 8/8/4/4 with the states on the slow ranks (0/0/500/500) fit (128.8 MB on a fast
    rank) at 249.6 ms, against 393.9 ms for the even FSDP plan. At 1.01x the even states fit
    in 2 micro-batches (245.9 ms) and beat ours (249.6 ms): the search keeps that one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import prepare_model  # noqa: E402
from planner.cluster import Cluster  # noqa: E402
from planner.device_groups import device_groups, sub_cluster  # noqa: E402
from planner.families.uneven_dp.candidates import uneven_plan  # noqa: E402
from planner.model_spec import ModelSpec  # noqa: E402
from search.budget import SearchBudget  # noqa: E402
from search.data_parallel import data_parallel_plan  # noqa: E402
from search.layouts import nearly_even_layers  # noqa: E402

MIXED = REPO / "examples/clusters/mixed.toml"
# The fast ranks compute 16x slower than a core and the slow ones 32x (launch.py
# --slowdown-from-cluster 16): sleeps, not the shared cores the ranks contend for, fill the step.
# At 4, with a load average of 15 on 2 cores, contention alone stretched the ranks nearly as
# much as the sleeps meant to (this GPT measured 1.19x, one 4x its width x sequence 1.08x; at
# 16 this GPT measured 1.28x with a whole forward stretched, 1.17x with each op stretched, the
# optimizer's included; predicted 1.43x: each rank runs the same ops on 9 or 3 samples, and
# this host's small and memory-bound ops cost more beside its matmuls than the cluster file's
# placeholder figures say).
SLOWDOWN_BASE = 16
A100_H100 = REPO / "examples/clusters/a100-h100.toml"
# The CPU GPT: large enough that compute, not dispatch, fills a step on one core.
CPU_GPT = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 64, "vocab_size": 256, "batch_size": 24}
# MPT-13B as llm-foundry ran it on 64 H100s (benchmarks/fidelity.py: 40 x 5120, 40 heads,
# seq 2048, 2 per GPU, FSDP); vocabulary as fidelity.py's MPT_VOCAB.
GPT_13B = {"n_layer": 40, "n_embd": 5120, "n_head": 40, "vocab_size": 50368, "seq_len": 2048, "batch_size": 128}
MIXES = (
    ("2 fast + 2 slow CPU, GPT (CPU size)", MIXED, CPU_GPT, "ddp", "fp32"),
    ("4 DGX A100 + 4 DGX H100, GPT-13B", A100_H100, GPT_13B, "fsdp", "bf16"),
)


def three_plans(cluster_file: Path, overrides: dict, flavour: str, precision: str):
    """(even, fast devices alone, uneven) plans of the GPT example on the cluster file."""
    spec = ModelSpec(str(REPO / "examples/gpt.py"), overrides)
    graph, spec, name, cluster = prepare_model(spec, Cluster.load(cluster_file))
    even = data_parallel_plan(graph, cluster, spec, name, flavour, (), precision)
    fastest = max(device_groups(cluster), key=lambda group: group.peak_flops("bfloat16"))
    fast = data_parallel_plan(graph, sub_cluster(cluster, fastest.device), spec, name, flavour, (), precision)
    return even, fast, uneven_plan(even, graph)


def simulated_rows() -> list[tuple]:
    """(a): one row per mix."""
    rows = []
    for title, cluster_file, overrides, flavour, precision in MIXES:
        even, fast, ours = three_plans(cluster_file, overrides, flavour, precision)
        rows.append((title, even, fast, ours))
        shares = ours.sections["uneven"].shares
        print(f"{title}\n  even {even.name}: {even.estimate.step_time_s * 1e3:.1f} ms"
              f"{'' if even.estimate.fits else ' (does not fit)'}\n"
              f"  fast devices alone {fast.name} on {fast.world_size} ranks: {fast.estimate.step_time_s * 1e3:.1f} ms"
              f"{'' if fast.estimate.fits else ' (does not fit)'}\n"
              f"  ours, shares {sorted(set(shares))} (ranks 0 and {len(shares) - 1}: {shares[0]}, {shares[-1]}): "
              f"{ours.estimate.step_time_s * 1e3:.1f} ms: {even.estimate.step_time_s / ours.estimate.step_time_s:.2f}x "
              f"the even plan, {fast.estimate.step_time_s / ours.estimate.step_time_s:.2f}x the fast devices alone",
              flush=True)
    return rows


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measured_step_s(folder: Path, steps: int, cwd: Path, summaries: list[str] | None = None, world: int = 4) -> float:
    """Median step seconds of ``launch.py --steps`` at world ``world`` with the cluster's slowdown,
    the first two steps (warm-up) left out; each rank's line of where its step went
    (``slowdown.Pacer.summary``) appended to ``summaries`` when given."""
    metrics = cwd / f"{folder.name}.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(folder / "launch.py"),
               "--steps", str(steps), "--slowdown-from-cluster", str(SLOWDOWN_BASE), "--metrics", str(metrics)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(_free_port())}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    if summaries is not None:
        # Four processes print to one pipe: a line may start inside another's.
        summaries.extend(sorted(re.findall(r"rank \d+ slowed .*? collectives", done.stdout)))
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(record["step_time_s"] for record in records[2:])


def measured_rows(steps: int) -> None:
    """(b): the uneven and the even DDP programs on mixed.toml, predicted and measured."""
    import planner

    even, _, ours = three_plans(MIXED, CPU_GPT, "ddp", "fp32")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        measured = {}
        for label, plan in (("even", even), ("uneven", ours)):
            folder = planner.compile(plan, scratch / label)
            measured[label] = measured_step_s(folder, steps, scratch)
    print_measured("measured on CPU gloo, world 4, mixed.toml, slow ranks 2x", steps, even, ours, measured)


def print_measured(title: str, steps: int, even, ours, measured: dict) -> None:
    """The even and uneven plans' predicted and measured steps, and the speed-ups."""
    predicted = {"even": even.estimate.step_time_s, "uneven": ours.estimate.step_time_s}
    print(f"{title} (median of {steps - 2} steps):")
    for label in ("even", "uneven"):
        print(f"  {label:6}: predicted {predicted[label] * 1e3:7.1f} ms, measured {measured[label] * 1e3:7.1f} ms")
    print(f"  uneven speed-up: predicted {predicted['even'] / predicted['uneven']:.2f}x, "
          f"measured {measured['even'] / measured['uneven']:.2f}x", flush=True)


def pipeline_rows(steps: int | None) -> None:
    """(e): the hetero-pp family's best plan on each mix against the even split of its blocks;
    with ``steps``, both programs of the CPU mix also measured as (b) measures."""
    import planner
    from planner.families.hetero_pipeline.candidates import staged_estimates, staged_plan

    for title, cluster_file, overrides, _, precision in MIXES:
        spec = ModelSpec(str(REPO / "examples/gpt.py"), overrides)
        graph, spec, name, cluster = prepare_model(spec, Cluster.load(cluster_file))
        estimates, grids = staged_estimates(graph, cluster, precision, ("ddp", "zero1", "fsdp"), SearchBudget())
        best = min((staged_plan(e, graph, cluster, grids, spec, name, ()) for e in estimates[:2]),
                   key=lambda plan: plan.estimate.step_time_s)
        chosen = next(e for e in estimates if e.blocks == best.sections["hetero-pp"].blocks
                      and best.sections["hetero-pp"].stage_devices[0] == device_groups(cluster)[e.order[0]].device.name)
        even = staged_plan(dataclasses.replace(chosen, blocks=nearly_even_layers(sum(chosen.blocks), len(chosen.blocks))),
                           graph, cluster, grids, spec, name, ())
        section = best.sections["hetero-pp"]
        print(f"{title}, pipeline per device group:\n"
              f"  ours {best.name}: blocks {'/'.join(map(str, section.blocks))} on "
              f"{'/'.join(section.stage_devices)}: {best.estimate.step_time_s * 1e3:.1f} ms"
              f"{'' if best.estimate.fits else ' (does not fit)'}\n"
              f"  even split {'/'.join(map(str, even.sections['hetero-pp'].blocks))}: "
              f"{even.estimate.step_time_s * 1e3:.1f} ms{'' if even.estimate.fits else ' (does not fit)'}: "
              f"ours {even.estimate.step_time_s / best.estimate.step_time_s:.2f}x", flush=True)
        if steps is None or cluster_file != MIXED:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            scratch = Path(scratch)
            measured = {label: measured_step_s(planner.compile(plan, scratch / label), steps, scratch)
                        for label, plan in (("even", even), ("ours", best))}
        print(f"  measured on CPU gloo, world 4, slow ranks 2x (median of {steps - 2} steps): even split "
              f"{measured['even'] * 1e3:.1f} ms, ours {measured['ours'] * 1e3:.1f} ms: ours "
              f"{measured['even'] / measured['ours']:.2f}x (predicted "
              f"{even.estimate.step_time_s / best.estimate.step_time_s:.2f}x)", flush=True)
# The CPU GPT 3x wider, with a third of its batch and half its blocks: its linear layers, not
# per-op dispatch, fill a rank's CPU time (in the CPU GPT the 1166 ops a rank runs per step cost
# about 56 us each on average, so the split layers are about a third of it, where the simulator,
# at 5 us per op, prices them at about two thirds).
WIDE_CPU_GPT = {"n_layer": 2, "n_embd": 384, "n_head": 6, "seq_len": 64, "vocab_size": 256, "batch_size": 8}
# GPT-2.7B's shape (32 x 2560, 32 heads: GPT-3 2.7B, Brown et al. 2020, table 2.1) at a
# sequence of 1024 and a batch of 8 sequences: fewer samples than the 16 GPUs.
GPT_2_7B = {"n_layer": 32, "n_embd": 2560, "n_head": 32, "vocab_size": 50368, "seq_len": 1024, "batch_size": 8}


def tensor_parallel_plans(cluster: Cluster, overrides: dict, precision: str):
    """(even shares, uneven shares, even shares on the fastest devices alone) uneven-tp plans."""
    from planner.families.uneven_tp.candidates import uneven_tp_plan

    spec = ModelSpec(str(REPO / "examples/gpt.py"), overrides)
    graph, spec, name, cluster = prepare_model(spec, cluster)
    fastest = max(device_groups(cluster), key=lambda group: group.peak_flops("bfloat16"))
    alone = sub_cluster(cluster, fastest.device)
    return (uneven_tp_plan(graph, cluster, spec, name, precision, even=True),
            uneven_tp_plan(graph, cluster, spec, name, precision),
            uneven_tp_plan(graph, alone, spec, name, precision, even=True))


def tensor_parallel_rows() -> None:
    """(c): the GPT-2.7B-shaped model on one A100 node beside one H100 node."""
    whole = Cluster.load(A100_H100)
    kinds = {}
    for node in whole.nodes:
        kinds.setdefault(node.device.name, node)
    cluster = dataclasses.replace(whole, name="a100-h100-1+1", nodes=tuple(kinds.values()))
    even, ours, alone = tensor_parallel_plans(cluster, GPT_2_7B, "bf16")
    layer = ours.sections["uneven-tp"].layers[0]
    print(f"uneven tensor parallelism, 1 DGX A100 + 1 DGX H100, GPT-2.7B shape, batch 8 (bf16):\n"
          f"  even shares {even.name}: {even.estimate.step_time_s * 1e3:.1f} ms"
          f"{'' if even.estimate.fits else ' (does not fit)'}\n"
          f"  the H100 node alone, even shares: {alone.estimate.step_time_s * 1e3:.1f} ms"
          f"{'' if alone.estimate.fits else ' (does not fit)'}\n"
          f"  ours {ours.name}, e.g. {layer.module} {layer.kind} {layer.shares[0]} (A100) / {layer.shares[-1]} (H100): "
          f"{ours.estimate.step_time_s * 1e3:.1f} ms{'' if ours.estimate.fits else ' (does not fit)'}: "
          f"{even.estimate.step_time_s / ours.estimate.step_time_s:.2f}x the even shares, "
          f"{alone.estimate.step_time_s / ours.estimate.step_time_s:.2f}x the H100 node alone", flush=True)


def tensor_parallel_measured(steps: int) -> None:
    """(d): the uneven-tp and even-share programs of the CPU GPT and the wide CPU GPT on
    mixed.toml, with each rank's ops, op CPU and sleep per step."""
    import planner

    for title, overrides in (("CPU GPT", CPU_GPT), ("wide CPU GPT", WIDE_CPU_GPT)):
        even, ours, _ = tensor_parallel_plans(Cluster.load(MIXED), overrides, "fp32")
        summaries: dict[str, list[str]] = {"even": [], "uneven": []}
        with tempfile.TemporaryDirectory() as scratch:
            scratch = Path(scratch)
            measured = {label: measured_step_s(planner.compile(plan, scratch / f"tp-{label}"), steps, scratch,
                                               summaries[label])
                        for label, plan in (("even", even), ("uneven", ours))}
        print_measured(f"uneven tensor parallelism, {title}, measured on CPU gloo, world 4, mixed.toml, slow ranks 2x",
                       steps, even, ours, measured)
        for label in ("even", "uneven"):
            for line in summaries[label]:
                print(f"    {label}: {line}", flush=True)


# (f): a GPT of width 768 (GPT-2 small's) and 2 blocks at a batch of 4 sequences of 64: as many
# samples as ranks, so data parallelism cannot give the fast ranks more samples than the slow.
WINNING_GPT = {"n_layer": 2, "n_embd": 768, "n_head": 12, "seq_len": 64, "vocab_size": 256, "batch_size": 4}


def winning_rows(steps: int | None) -> None:
    """(f): where uneven tensor parallelism wins on mixed.toml: against the same kinds with
    even shares, even DDP over the four, the search's best plan on the fast devices alone and
    the search's plan on all four; simulated, and with ``steps`` measured as (b)."""
    import planner

    spec = ModelSpec(str(REPO / "examples/gpt.py"), WINNING_GPT)
    graph, spec, name, cluster = prepare_model(spec, Cluster.load(MIXED))
    even, ours, _ = tensor_parallel_plans(cluster, WINNING_GPT, "fp32")
    fastest = max(device_groups(cluster), key=lambda group: group.peak_flops("float32"))
    plans = {
        "uneven-tp (ours)": ours,
        "uneven-tp, even shares": even,
        "ddp, even (1 sample per rank)": data_parallel_plan(graph, cluster, spec, name, "ddp", (), "fp32"),
        "search, fast devices alone": planner.plan(spec, sub_cluster(cluster, fastest.device), progress=False,
                                                   precision="fp32"),
        "search, all four": planner.plan(spec, cluster, progress=False, precision="fp32"),
    }
    measured: dict[str, float] = {}
    if steps:
        with tempfile.TemporaryDirectory() as scratch:
            scratch = Path(scratch)
            for index, (label, plan) in enumerate(plans.items()):
                if label != "search, all four":  # the search's pick is one of the others (printed below)
                    measured[label] = measured_step_s(planner.compile(plan, scratch / f"win-{index}"), steps,
                                                      scratch, world=plan.world_size)
    print(f"where uneven tensor parallelism wins: mixed.toml, GPT {WINNING_GPT['n_layer']} x {WINNING_GPT['n_embd']}, "
          f"batch {WINNING_GPT['batch_size']} x {WINNING_GPT['seq_len']} (fp32)"
          + (f", measured as (b), median of {steps - 2} steps" if steps else "") + ":", flush=True)
    for label, plan in plans.items():
        ratio = plan.estimate.step_time_s / ours.estimate.step_time_s
        line = (f"  {label:30} {plan.name}: predicted {plan.estimate.step_time_s * 1e3:6.1f} ms "
                f"(ours {ratio:.2f}x faster)")
        if label in measured:
            line += (f", measured {measured[label] * 1e3:7.1f} ms "
                     f"(ours {measured[label] / measured['uneven-tp (ours)']:.2f}x faster)")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulated", action="store_true", help="simulated rows only: nothing launched")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per program (>= 3; default 8)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="(c), (d) and (f) only (measured unless --simulated)")
    parser.add_argument("--pipelines", action="store_true", help="(e) only: pipelines per device group")
    parser.add_argument("--links", action="store_true", help="(g) only: links per pair, collectives over sites")
    parser.add_argument("--widths", action="store_true", help="(h) only: pipeline stages of different widths")
    parser.add_argument("--accpar", action="store_true", help="(i) only: ACCPAR's own setting (TPU-v2 + TPU-v3)")
    parser.add_argument("--states", action="store_true", help="(j) only: optimizer states by memory (Cephalo)")
    options = parser.parse_args()
    steps = None if options.simulated else max(3, options.steps)
    if options.accpar:
        from heterogeneous_accpar import accpar_rows  # this folder: benchmarks/

        accpar_rows()
        return
    if options.states:
        from heterogeneous_states import state_rows  # this folder: benchmarks/

        state_rows()
        return
    if options.links or options.widths:
        from heterogeneous_links import site_rows, width_rows  # this folder: benchmarks/

        for wanted, rows in ((options.links, site_rows), (options.widths, width_rows)):
            if wanted:
                rows()
        return
    if options.pipelines:
        pipeline_rows(steps)
        return
    if not options.tensor_parallel:
        simulated_rows()
        from heterogeneous_states import state_rows  # this folder: benchmarks/

        state_rows()
        if steps:
            measured_rows(steps)
    tensor_parallel_rows()
    if steps:
        tensor_parallel_measured(steps)
    winning_rows(steps)


if __name__ == "__main__":
    main()
