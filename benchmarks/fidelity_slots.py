"""Where a pipeline run's step goes as data parallelism grows: per micro-batch slot or per step.

    python benchmarks/fidelity_slots.py                     # MT-NLG's three runs, micro-batch 1 and 2
    python benchmarks/fidelity_slots.py --micro-batches 1   # as fidelity.py states them only

A 1F1B pipeline of ``pp`` stages running ``m`` micro-batches takes ``m + pp - 1`` slots (the
schedule's ``pp - 1`` fill and drain slots are its bubble), each as long as one micro-batch's
forward and backward on the busiest stage, plus what runs once per step after the schedule
(gradient reduction, optimizer step, gathers). Runs of one model at one global batch on
several data-parallel sizes change only ``m = batch / (dp x micro-batch)``, so their steps
lie on a line ``seconds = per_slot x (m + pp - 1) + per_step``; a least-squares fit of the
published steps separates the two parts, and the same fit of the predicted steps shows which
part the simulator misses (``slot_fit``).

The fit needs the micro-batch, which sets ``m``. What ``fidelity_runs.py`` takes from MT-NLG's
paper (Smith et al. 2022, section 2.4: tp 8, pp 35, global batch 1920, the three iteration
times) has no micro-batch; the rows assume 1, the least bubble. The script fits the
published steps under each micro-batch asked for, and simulates the runs with it, so a reader
sees how much of a gap is the schedule's bubble under one assumption or the other. It changes
no row of ``fidelity.py``: choosing the micro-batch by which fits the published steps best
would be fitting to them.

Nor can the three runs choose it. Their slot counts at micro-batch 2 are an affine function of
those at micro-batch 1 (``m/2 + pp - 1 = (m + pp - 1 + pp - 1) / 2``), so the two lines are one
line in other units, with the same residuals: "a larger per-step cost" and "a larger bubble"
fit the published steps equally well. What the runs do determine, whatever the micro-batch, is
the line in sequences per pipeline, ``batch / dp``: seconds per sequence in the steady state,
and the seconds that do not shrink with dp (bubble and per-step work together):
``sequence_fit``. ``slot_fit_errors`` gives the fits' standard errors from their residuals
(three runs leave one degree of freedom).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity import simulate  # noqa: E402
from fidelity_runs import Run, runs as published_runs  # noqa: E402
from planner.cluster import Cluster  # noqa: E402


def pipeline_slots(run: Run, micro_batch: int) -> int:
    """Micro-batch slots of ``run``'s 1F1B schedule at ``micro_batch`` sequences per
    micro-batch: ``m + pp - 1`` with ``m = global batch / (dp x micro_batch)``."""
    cluster = Cluster.parse(run.cluster) if isinstance(run.cluster, str) else run.cluster
    tp, pp = run.layout.get("tp", 1), run.layout.get("pp", 1)
    dp = cluster.world_size // (tp * pp)
    batch = run.overrides["batch_size"]
    if batch % (dp * micro_batch):
        raise ValueError(f"{run.name}: global batch {batch} does not split into micro-batches of "
                         f"{micro_batch} over dp {dp}; pick a micro-batch that divides {batch // dp}")
    return batch // (dp * micro_batch) + pp - 1


def slot_fit(slots: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares line through (slots, seconds): (seconds per slot, seconds per step)."""
    if len(slots) != len(seconds) or len(set(slots)) < 2:
        raise ValueError("a slot fit needs at least two runs with different slot counts")
    mean_x = sum(slots) / len(slots)
    mean_y = sum(seconds) / len(seconds)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(slots, seconds))
    sxx = sum((x - mean_x) ** 2 for x in slots)
    per_slot = sxy / sxx
    return per_slot, mean_y - per_slot * mean_x


def slot_fit_errors(slots: list[int], seconds: list[float]) -> tuple[float, float]:
    """Standard errors of ``slot_fit``'s (seconds per slot, seconds per step), from the
    residuals of the fitted line with ``len(slots) - 2`` degrees of freedom (the ordinary
    least-squares formulas: s^2 = RSS / (n - 2), se(slope) = s / sqrt(Sxx), se(intercept) =
    s x sqrt(1/n + mean^2 / Sxx))."""
    if len(slots) != len(seconds) or len(slots) < 3:
        raise ValueError("standard errors need at least three runs (one degree of freedom)")
    per_slot, per_step = slot_fit(slots, seconds)
    mean_x = sum(slots) / len(slots)
    sxx = sum((x - mean_x) ** 2 for x in slots)
    variance = sum((y - per_step - per_slot * x) ** 2 for x, y in zip(slots, seconds)) / (len(slots) - 2)
    return math.sqrt(variance / sxx), math.sqrt(variance * (1 / len(slots) + mean_x ** 2 / sxx))


def sequences_per_pipeline(run: Run) -> int:
    """Sequences each pipeline (data-parallel replica) runs per step: global batch / dp."""
    cluster = Cluster.parse(run.cluster) if isinstance(run.cluster, str) else run.cluster
    dp = cluster.world_size // (run.layout.get("tp", 1) * run.layout.get("pp", 1))
    return run.overrides["batch_size"] // dp


def sequence_fit(runs: list[Run], seconds: list[float]) -> tuple[float, float]:
    """(seconds per sequence, seconds that do not shrink with dp) of the line through the
    runs' steps against their sequences per pipeline: the split the runs determine whatever
    their micro-batch (the bubble is inside the second term)."""
    return slot_fit([sequences_per_pipeline(run) for run in runs], seconds)


def mt_nlg_runs() -> list[Run]:
    """MT-NLG's three published runs (dp 8, 10, 12), as ``fidelity.py`` states them."""
    return [run for run in published_runs() if run.name.startswith("MT-NLG")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2],
                        help="sequences per micro-batch to fit and simulate the runs with (default: 1 2)")
    options = parser.parse_args()
    chosen = mt_nlg_runs()
    published = [run.published_step_s for run in chosen]
    for micro_batch in options.micro_batches:
        slots = [pipeline_slots(run, micro_batch) for run in chosen]
        predicted = []
        print(f"micro-batch {micro_batch}:")
        for run, count in zip(chosen, slots):
            layout = {**run.layout, "micro_batch": micro_batch}
            step = simulate(dataclasses.replace(run, layout=layout))[0].estimate.step_time_s
            predicted.append(step)
            print(f"  {run.name:<24} {count:>4} slots  published {run.published_step_s:>6.2f}s "
                  f"({run.published_step_s / count:.3f} s/slot)  predicted {step:>6.2f}s ({step / count:.3f} s/slot) "
                  f"{step / run.published_step_s - 1:>+7.1%}", flush=True)
        for label, values in (("published", published), ("predicted", predicted)):
            per_slot, per_step = slot_fit(slots, values)
            slot_error, step_error = slot_fit_errors(slots, values)
            print(f"  {label} fit: {per_slot:.4f} +- {slot_error:.4f} s per slot + {per_step:+.2f} +- "
                  f"{step_error:.2f} s per step (one standard error)")
        per_sequence, fixed = sequence_fit(chosen, predicted)
        print(f"  predicted: {per_sequence:.4f} s per sequence of a pipeline + {fixed:.2f} s that do not "
              f"shrink with dp (bubble and per-step work)")
    per_sequence, fixed = sequence_fit(chosen, published)
    print(f"published, whatever the micro-batch: {per_sequence:.4f} s per sequence of a pipeline + {fixed:.2f} s "
          f"that do not shrink with dp (bubble and per-step work)")


if __name__ == "__main__":
    main()
