"""Train the example GPT end to end: plan -> compile -> train on a text -> checkpoint -> export.

    python examples/train_gpt.py [--nproc 2] [--steps 200] [--out gpt_run]

1. Plans examples/gpt.py (small: 2 layers, hidden 64, characters as tokens) for ``cpu:1xN``
   (``python -m planner plan ... -o OUT/plan.json``) and compiles it (``planner compile``).
2. Trains it with ``torchrun --nproc_per_node N OUT/program/launch.py --data
   examples/train_gpt.py:batches``: the text below, as next-character pairs, with warm-up
   and cosine decay and gradient clipping; each step prints loss, step time, tokens/s,
   MFU and peak memory beside the planner's prediction; per-step figures go to
   OUT/metrics.jsonl.
3. Checkpoints every quarter of the run (``torch.distributed.checkpoint``, OUT/checkpoints)
   and exports the last checkpoint's weights as one plain state_dict, OUT/model.pt, which
   loads into the example GPT with ``torch.load(..., weights_only=True)``.

The text is made here, deterministically, from a tiny grammar (a few thousand sentences), so
every rank draws the same batches without a download. ``batches(batch_size)`` is the
``--data`` function: any file with such a function trains any planned model the same way.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN = 64
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": SEQ_LEN, "batch_size": 16, "vocab_size": 64, "dropout": 0.0}

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the planner", "a small bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "finds", "builds", "trains", "follows", "moves", "reads"]
_OBJECTS = ["the red ball", "a long book", "the model", "a quiet river", "the green hill", "every plan", "the map"]
_ENDINGS = [".", " today.", " again.", " at night.", " with care."]


def make_text(sentences: int = 4000, seed: int = 0) -> str:
    """A deterministic text of simple sentences: enough structure for a tiny model to learn."""
    chooser = random.Random(seed)
    return " ".join(
        f"{chooser.choice(_SUBJECTS)} {chooser.choice(_VERBS)} {chooser.choice(_OBJECTS)}{chooser.choice(_ENDINGS)}"
        for _ in range(sentences)
    )


def encode(text: str) -> tuple[list[int], list[str]]:
    """Character tokens: the ids of ``text`` and the sorted alphabet they index."""
    alphabet = sorted(set(text))
    index = {char: position for position, char in enumerate(alphabet)}
    return [index[char] for char in text], alphabet


def batches(batch_size: int, seed: int = 1234):
    """The ``--data`` function: endless global batches (idx, targets), each (batch_size,
    SEQ_LEN) int64, random windows of the text; the same on every rank (a fixed seed)."""
    import torch

    ids, alphabet = encode(make_text())
    if len(alphabet) > MODEL["vocab_size"]:
        raise ValueError(f"the text has {len(alphabet)} characters, more than vocab_size {MODEL['vocab_size']}")
    tokens = torch.tensor(ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - SEQ_LEN - 1, (batch_size,), generator=generator)
        window = torch.stack([tokens[start:start + SEQ_LEN + 1] for start in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def run(command: list[str]) -> None:
    """Run ``command`` (printed first, as it can be pasted), stop on failure."""
    print(f"$ {shlex.join(command)}", flush=True)
    if subprocess.run(command, cwd=ROOT).returncode != 0:
        raise SystemExit(f"failed: {shlex.join(command)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes (devices), default 2")
    parser.add_argument("--steps", type=int, default=200, help="training steps, default 200")
    parser.add_argument("--out", default="gpt_run", help="output folder, default gpt_run")
    parser.add_argument("--dp", default=None, choices=("ddp", "zero1", "zero2", "fsdp"), help="force a data-parallel flavour")
    options = parser.parse_args()
    out = Path(options.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    torchrun = str(Path(python).with_name("torchrun"))
    settings = [part for key, value in MODEL.items() for part in ("--set", f"{key}={value}")]
    plan = [python, "-m", "planner", "plan", "examples/gpt.py", "--cluster", f"cpu:1x{options.nproc}", *settings,
            "-o", str(out / "plan.json"), "--force"]
    run(plan + (["--dp", options.dp] if options.dp else []))
    run([python, "-m", "planner", "compile", str(out / "plan.json"), "-o", str(out / "program"), "--force"])
    warmup = max(0, min(options.steps // 20 or 1, options.steps - 1))  # leave the cosine a step to decay over
    train = [
        torchrun, "--nproc_per_node", str(options.nproc), str(out / "program" / "launch.py"),
        "--data", f"{Path(__file__).resolve()}:batches", "--steps", str(options.steps), "--lr", "3e-3",
        "--lr-schedule", "cosine", "--warmup-steps", str(warmup), "--min-lr-ratio", "0.1",
        "--clip-grad-norm", "1.0", "--log-every", str(max(1, options.steps // 20)), "--metrics", str(out / "metrics.jsonl"),
        "--checkpoint-dir", str(out / "checkpoints"), "--save-every", str(max(1, options.steps // 4)),
    ]
    run(train)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0]["loss"], sum(record["loss"] for record in records[-10:]) / len(records[-10:])
    print(f"loss {first:.3f} at step 1 -> {last:.3f} (mean of the last 10 steps) over {len(records)} steps")
    run([python, "-m", "planner", "export-checkpoint", str(out / "checkpoints"), "-o", str(out / "model.pt"), "--force"])
    import torch  # only here: planning and training run in their own processes

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.gpt import build

    model = build(**MODEL)[0]
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))  # strict: every weight, nothing else
    print(f"{out / 'model.pt'} loads into the example GPT ({sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    main()
