"""Bytes a compiled program sends per mesh axis in one training step, counted, against the
bytes its plan's simulator charged (``SimResult.bytes_per_axis``).

    python benchmarks/comm_audit.py            # worlds 2 and 4 (about half a minute on 2 cores)
    python benchmarks/comm_audit.py --worlds 2
    python benchmarks/comm_audit.py --sites    # and the line of model_spmd.py behind each collective

Compiles the plans of ``tests/comm_audit_plans.py`` (DDP, ZeRO-1/2, FSDP2, Megatron tp=2, a
graph program of random placements, a 1F1B pipeline, an expert-parallel MoE, at world 4 one
with its experts sharded over their copies) into a temporary
folder, runs ``tests/comm_audit_many.py`` under torchrun once per world size (gloo on CPU) and
prints one row per plan and axis: predicted bytes, counted bytes (the busiest rank), ratio;
then, per axis, the collectives the busiest rank issued; with ``--sites``, for each plan whose
count differs from the prediction, the same rank's collectives by the line of ``model_spmd.py``
that issued them (forward, or the forward line of the backward step), largest first, under
autograd's anomaly mode (slower). ``tests/test_comm_audit.py`` checks the same figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--sites", action="store_true", help="attribute the collectives of plans off their prediction to lines")
    options = parser.parse_args()
    from comm_audit_plans import plans

    import planner

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    print(f"{'world':>5} {'plan':<24} {'axis':<6} {'predicted B':>13} {'counted B':>13} {'ratio':>8}")
    details, sites, off = [], [], set()
    with tempfile.TemporaryDirectory() as root:
        for world in options.worlds:
            folders = {str(planner.compile(plan, Path(root) / f"w{world}" / case)): case for case, plan in plans(world).items()}
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                       str(REPO / "tests" / "comm_audit_many.py"), *(["--sites"] if options.sites else []), *folders]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                sys.exit(f"torchrun failed at world {world}:\n{done.stderr[-3000:]}")
            for line in done.stdout.splitlines():
                kind, folder, axis, *rest = line.split(" ") if line.startswith(("AUDIT ", "CALLS ", "SITE ")) else ("", "", "", "")
                if kind == "AUDIT" and axis == "FAILED":
                    print(f"{world:>5} {folders[folder]:<24} FAILED {' '.join(rest)}")
                elif kind == "AUDIT":
                    predicted, counted = float(rest[0]), float(rest[1])
                    ratio = f"{counted / predicted:.4f}" if predicted else ("-" if not counted else "unpriced")
                    if abs(counted - predicted) > 64:  # tests/test_comm_audit.py's slack for unpriced scalars
                        off.add((folder, axis))
                    print(f"{world:>5} {folders[folder]:<24} {axis:<6} {predicted:>13.0f} {counted:>13.0f} {ratio:>8}")
                elif kind == "CALLS":
                    op, size, calls, sent = rest
                    details.append(f"{world:>5} {folders[folder]:<24} {axis:<6} {calls:>3} x {op} (n={size}): {float(sent):.0f} B")
                elif kind == "SITE":
                    op, calls, sent, *where = rest
                    sites.append((world, folders[folder], folder, axis, float(sent), f"{calls:>3} x {op}", " ".join(where)))
    print("\nCollectives of the busiest rank per axis:")
    print("\n".join(details))
    if options.sites:
        print("\nWhere the plans off their prediction send, by line of model_spmd.py (busiest rank, largest first):")
        for world, case, folder, axis, sent, calls, where in sorted(sites, key=lambda row: (row[0], row[1], row[3], -row[4])):
            if (folder, axis) in off:
                print(f"{world:>5} {case:<24} {axis:<6} {sent:>10.0f} B {calls:<28} {where}")


if __name__ == "__main__":
    main()
