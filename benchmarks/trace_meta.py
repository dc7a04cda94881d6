"""How long tracing takes on meta tensors (no weights allocated), for growing models.

    python benchmarks/trace_meta.py            # hf:llama 7B shape (32 layers, hidden 4096)
    python benchmarks/trace_meta.py --quick    # a 4-layer version, for a smoke run

Prints build and trace seconds, op count, parameters and forward FLOPs. The target of the
end-to-end issue is under 30 s for the 32-layer model on a 2-core machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from planner.model_spec import ModelSpec
from planner.trace import trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers instead of 32")
    options = parser.parse_args()
    layers = 4 if options.quick else 32
    spec = ModelSpec(
        "hf:llama",
        {
            "num_hidden_layers": layers,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "batch_size": 1,
            "seq_len": 2048,
        },
    )
    start = time.perf_counter()
    model, args, kwargs = spec.build("meta")
    built = time.perf_counter()
    graph = trace(model, args, kwargs)
    traced = time.perf_counter()
    assert all(p.is_meta for p in model.parameters()), "tracing must not allocate weights"
    print(f"hf:llama {layers} layers, hidden 4096, seq 2048, torch {torch.__version__}")
    print(f"  build on meta: {built - start:.2f} s")
    print(f"  trace:         {traced - built:.2f} s  ({len(graph)} ops, blocks {graph.blocks})")
    print(f"  total:         {traced - start:.2f} s  (target < 30 s for 32 layers)")
    print(f"  parameters:    {graph.parameter_count / 1e9:.3f} B; forward FLOPs {graph.total_flops / 1e12:.2f} TFLOP")


if __name__ == "__main__":
    main()
