"""How long compiling a graph program takes, and how long the program is, as models deepen.

    python benchmarks/compile_time.py            # Llama-3-70B- and 405B-sized plans, and 2-layer ones
    python benchmarks/compile_time.py --quick    # the 2-layer versions only, for a smoke run

Each plan is Megatron-LM's layout (``search.megatron.megatron_plan``: tensor parallelism 8
with sequence parallelism, data parallelism over the rest) of ``examples/llama.py`` at the
published shapes, on DGX H100 nodes; the model is traced on meta tensors (nothing is
allocated). ``planner.compile`` writes the program (tracing and the compile-time dry run
included); the figures are its wall-clock seconds, the CPU seconds of this process (the
machine may be shared), and the lines of ``model_spmd.py``. Each repeated
block is written once (``codegen.block_fold``), so an 80-layer program is about as long as
a 2-layer one. The target of issue 12 is under 60 s for each large plan on a 2-core machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import planner
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

REPO = Path(__file__).resolve().parent.parent
# Llama 3 paper, table 3; one sequence of 8,192 tokens per data-parallel rank.
SHAPES = {
    "Llama-3-70B": dict(n_layer=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "Llama-3-405B": dict(n_layer=126, dim=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}
NODES = {"Llama-3-70B": 8, "Llama-3-405B": 16}  # DGX H100 nodes of 8 GPUs
TP = 8


def compile_once(name: str, layers: int | None, root: Path) -> tuple[float, float, int, int]:
    """Wall-clock and CPU seconds to compile the plan of ``name`` (with ``layers`` blocks, or
    the published count), lines of its ``model_spmd.py``, and the number of blocks."""
    shape = dict(SHAPES[name])
    if layers is not None:
        shape["n_layer"] = layers
    dp = NODES[name] * 8 // TP
    spec = ModelSpec(str(REPO / "examples" / "llama.py"), {**shape, "batch_size": dp, "seq_len": 8192})
    graph, spec, model_name, cluster = prepare_model(spec, f"dgx-h100:{NODES[name]}")
    plan = megatron_plan(graph, cluster, spec, model_name, tp=TP, sequence_parallel=True)
    start, cpu = time.perf_counter(), time.process_time()
    folder = planner.compile(plan, root / f"{name}-{shape['n_layer']}")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    lines = len((folder / "model_spmd.py").read_text().splitlines())
    return seconds, cpu, lines, shape["n_layer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2-layer versions only")
    options = parser.parse_args()
    print(f"{'model':<14} {'layers':>6} {'compile s':>10} {'cpu s':>7} {'program lines':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in SHAPES:
            for layers in (2,) if options.quick else (2, None):
                seconds, cpu, lines, count = compile_once(name, layers, Path(tmp))
                print(f"{name:<14} {count:>6} {seconds:>10.1f} {cpu:>7.1f} {lines:>14}", flush=True)


if __name__ == "__main__":
    main()
