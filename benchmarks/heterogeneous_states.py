"""(j) of ``benchmarks/heterogeneous.py``: optimizer-state shares by memory (Cephalo), predicted.

``mixed.toml``'s speeds (two fast, two slow CPU-class devices) with memory that binds: each
fast device holds 1% more than the even ZeRO-1 plan of ``STATE_GPT`` needs, each slow one
twice that. Rows: the even ZeRO-1 plan (every rank B/4 samples), the uneven plan with even
states (speed-balanced shares capped by memory; where they do not fit at once, in the fewest
micro-batches that do, as the search would), and ours: shares by speed, optimizer states by
memory (``planner.families.uneven_dp.state_shares``); and, for comparison, the even FSDP
plan, which shards weights and gradients too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from planner.api import prepare_model
from planner.cluster import Cluster
from planner.families.uneven_dp.candidates import fitting_uneven_plan, states_by_memory_plan
from planner.model_spec import ModelSpec
from search.data_parallel import data_parallel_plan

REPO = Path(__file__).resolve().parents[1]
# Wide and short, so the states (8 bytes a parameter under AdamW) weigh beside the activations.
STATE_GPT = {"n_layer": 4, "n_embd": 512, "n_head": 8, "seq_len": 16, "vocab_size": 256, "batch_size": 24}


def _cluster(fast_bytes: int, folder: Path) -> Cluster:
    """``mixed.toml`` with ``fast_bytes`` on each fast device and twice that on each slow one."""
    before, fast_rest, slow_rest = (REPO / "examples/clusters/mixed.toml").read_text().split(
        "memory_bytes = 8589934592")
    path = folder / "mixed-memory.toml"
    path.write_text(f"{before}memory_bytes = {fast_bytes}{fast_rest}memory_bytes = {2 * fast_bytes}{slow_rest}")
    return Cluster.load(path)


# Each fast device's memory, as a fraction of what the even ZeRO-1 plan needs per device.
FAST_MEMORY_FRACTIONS = (1.01, 0.85)


def state_rows() -> None:
    """Print, per fast-device memory, the three plans' predicted steps and ours' memory."""
    with tempfile.TemporaryDirectory() as folder:
        spec = ModelSpec(str(REPO / "examples/gpt.py"), STATE_GPT)
        graph, spec, name, roomy = prepare_model(spec, _cluster(8 << 30, Path(folder)))
        needed = data_parallel_plan(graph, roomy, spec, name, "zero1", (), "fp32").estimate.memory.total
        print(f"optimizer states by memory (Cephalo), predicted: mixed.toml speeds, GPT {STATE_GPT['n_layer']} x "
              f"{STATE_GPT['n_embd']}, batch {STATE_GPT['batch_size']}, ZeRO-1, fp32; the even plan needs "
              f"{needed / 1e6:.1f} MB a device")
        for fraction in FAST_MEMORY_FRACTIONS:
            fast = int(needed * fraction)
            cluster = _cluster(fast, Path(folder))
            even = data_parallel_plan(graph, cluster, spec, name, "zero1", (), "fp32")
            _print_row(fast, even, fitting_uneven_plan(even, graph), states_by_memory_plan(even, graph))
            sharded = data_parallel_plan(graph, cluster, spec, name, "fsdp", (), "fp32")
            print(f"    for comparison, even {sharded.name} (weights and gradients sharded too): "
                  f"{sharded.estimate.step_time_s * 1e3:.1f} ms{'' if sharded.estimate.fits else ' (does not fit)'}")


def _print_row(fast: int, even, plain, ours) -> None:
    """One memory setting: the even plan, uneven shares with even states, ours."""
    print(f"  fast devices {fast / 1e6:.1f} MB, slow {2 * fast / 1e6:.1f} MB:\n"
          f"    even {even.name}: {even.estimate.step_time_s * 1e3:.1f} ms{'' if even.estimate.fits else ' (does not fit)'}")
    if plain is None:
        print("    uneven shares, even states: no fitting plan")
    else:
        print(f"    uneven shares, even states {plain.name}: {plain.estimate.step_time_s * 1e3:.1f} ms")
    if ours is None:
        print("    ours: no fitting plan with states by memory")
        return
    versus = [f"{even.estimate.step_time_s / ours.estimate.step_time_s:.2f}x the even plan"]
    if plain is not None:
        versus.append(f"{plain.estimate.step_time_s / ours.estimate.step_time_s:.2f}x uneven with even states")
    print(f"    ours {ours.name}: {ours.estimate.step_time_s * 1e3:.1f} ms, {', '.join(versus)}; per-rank MB "
          f"{', '.join(f'{held / 1e6:.1f}' for held in ours.sections['uneven'].memory_bytes)}", flush=True)
