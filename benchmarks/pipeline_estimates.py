"""The pipeline grid's estimates against the simulator, configuration by configuration.

    python benchmarks/pipeline_estimates.py                     # every configuration, then a summary
    python benchmarks/pipeline_estimates.py --summary           # the summary only
    python benchmarks/pipeline_estimates.py --max-micro-batches 4

The grid (``search.pipeline_search.PipelineGrid``) prices each configuration with a closed form
or a walk of its schedule (``search.pipeline_step``) and simulates only its finalists in full;
a schedule whose estimate errs high is then never simulated. This prints, for every pipelined
configuration of the grid of ``tests/test_pipeline_search.py`` (GPT of 8 blocks, width 1024,
a 64K vocabulary whose head costs about five blocks, sequence 256, batch 32, on two DGX
A100 nodes of two devices, bf16) that fits, its estimate, the simulated step of the plan it
builds, and the signed error; then per schedule and dp flavour (FSDP apart: its estimate
counts the weight gathers in full, an upper bound by design) the median and largest
absolute error and the mean signed one. About a minute on one core at the default bound of
16 micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.pipeline_search import PipelineGrid, PipelineSpace

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
SETTINGS = {"n_layer": 8, "n_embd": 1024, "n_head": 16, "vocab_size": 65536, "seq_len": 256, "batch_size": 32}
CLUSTER = "dgx-a100-80g:2x2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-micro-batches", type=int, default=16, help="skip configurations with more (default 16)")
    parser.add_argument("--summary", action="store_true", help="print the summary only")
    args = parser.parse_args()
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, SETTINGS), CLUSTER)
    grid = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    errors: dict[str, list[float]] = {}
    for config in grid.configurations():
        if config.pp == 1 or config.layout != "megatron" or config.micro_batches > args.max_micro_batches:
            continue
        estimate = grid.estimate(config)
        if estimate is None:
            continue
        simulated = grid.plan(estimate, spec, name).estimate.step_time_s
        error = estimate.step_s / simulated - 1
        group = f"{config.schedule}{' (fsdp)' if config.flavour == 'fsdp' else ''}"
        errors.setdefault(group, []).append(error)
        if not args.summary:
            print(f"{config.schedule:11s} x{config.virtual_stages} tp{config.tp} pp{config.pp} dp{config.dp} "
                  f"{config.micro_batch}x{config.micro_batches:<2d} {config.flavour:5s} {config.recompute:9s} "
                  f"sp={int(config.sequence_parallel)} blocks {estimate.layers_per_stage}: estimate "
                  f"{estimate.step_s * 1e3:7.2f} ms, simulated {simulated * 1e3:7.2f} ms, {100 * error:+5.1f}%")
    print(f"{'schedule':20s} {'configs':>7s} {'median |err|':>12s} {'max |err|':>9s} {'mean err':>8s}")
    for group, values in sorted(errors.items()):
        absolute = [abs(value) for value in values]
        print(f"{group:20s} {len(values):7d} {100 * statistics.median(absolute):11.1f}% "
              f"{100 * max(absolute):8.1f}% {100 * statistics.fmean(values):+7.1f}%")


if __name__ == "__main__":
    main()
