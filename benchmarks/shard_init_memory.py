"""How much memory each rank of a compiled FSDP program needs to build its model, and to
train it, against the model's whole fp32 weights (per-shard initialisation,
``codegen/runtime/materialize.py``).

    python benchmarks/shard_init_memory.py --world 4 --hidden 4096 --layers 5 --steps 3
    python benchmarks/shard_init_memory.py --world 4 --model gpt --hidden 1024 --layers 4 --steps 2

Compiles ``examples/mlp.py`` (wide, so its weights dominate; FSDP2 wraps it as one unit, so
training gathers all of it) or ``examples/gpt.py`` (one FSDP2 unit per block) as an FSDP plan on
``cpu:1x<world>``, runs ``tests/init_ckpt_worker.py`` on it under torchrun (gloo, CPU) and
prints, per rank, the parameter bytes it holds, how far its resident memory rose while
building (after a warm-up build) and while training ``--steps`` AdamW steps.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    options = parser.parse_args()

    import planner
    from planner.model_spec import ModelSpec

    if options.model == "mlp":
        spec = ModelSpec(str(REPO / "examples/mlp.py"), {"batch_size": 8, "hidden": options.hidden, "layers": options.layers})
    else:
        spec = ModelSpec(
            str(REPO / "examples/gpt.py"),
            {"batch_size": 8, "seq_len": 16, "n_embd": options.hidden, "n_head": 8, "n_layer": options.layers, "vocab_size": 256},
        )
    with tempfile.TemporaryDirectory() as scratch:
        folder = planner.compile(planner.plan(spec, f"cpu:1x{options.world}", dp_flavour="fsdp", precision="fp32"), Path(scratch) / "wide")
        whole = sum(p.numel() * 4 for p in spec.build("meta")[0].parameters())
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(options.world),
             str(REPO / "tests/init_ckpt_worker.py"), f"steps={options.steps}:{folder}"],
            env=env, capture_output=True, text=True, check=False,
        )
        if run.returncode != 0:
            print(run.stdout[-2000:] + run.stderr[-2000:])
            return 1
    mib = 1 << 20
    print(f"whole model: {whole / mib:.1f} MiB of fp32 weights, {options.world} FSDP ranks")
    built = dict(re.findall(r"^RESULT \S+ rank=(\d+) (.*)$", run.stdout, re.MULTILINE))
    trained = dict(re.findall(r"^TRAINED \S+ rank=(\d+) peak_train_bytes=(\d+)$", run.stdout, re.MULTILINE))
    for rank in sorted(built, key=int):
        fields = dict(re.findall(r"(\w+)=(\d+)", built[rank]))
        print(
            f"rank {rank}: holds {int(fields['held_bytes']) / mib:.1f} MiB, build peak +{int(fields['peak_build_bytes']) / mib:.1f} MiB "
            f"({int(fields['peak_build_bytes']) / whole:.2f} x the whole model), training peak +{int(trained[rank]) / mib:.1f} MiB "
            f"({int(trained[rank]) / whole:.2f} x)"
        )
    print("losses:", ", ".join(re.findall(r"loss ([-\d.]+)", run.stdout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
