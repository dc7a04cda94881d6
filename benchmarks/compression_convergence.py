"""Convergence of lossy gradient compression: final training loss of each method beside
uncompressed DDP, same seeds, same data, same number of steps, on CPU gloo processes.

    torchrun --nproc_per_node 2 benchmarks/compression_convergence.py                 # gpt and cnn
    torchrun --nproc_per_node 4 benchmarks/compression_convergence.py --model cnn --steps 300
    torchrun --nproc_per_node 2 benchmarks/compression_convergence.py --model tiny --steps 80
    torchrun --nproc_per_node 2 benchmarks/compression_convergence.py --model gpt --sgd-lr 0.3   # or --no-clip

Compressed training is lossy, so a compressed plan cannot pass ``launch.py --check`` (parity
with one device); this is what we check instead. Models:

- ``gpt``: ``examples/train_gpt.py``'s GPT (2 layers, width 64, characters as tokens) on its
  text (``train_gpt.batches``), AdamW at 3e-3 with gradient clipping 1.0, as that script
  trains it.
- ``cnn``: ``examples/cnn.py``'s CNN (width 16, 16 x 16 images, 10 classes) telling ten fixed
  random images apart in noise (a sample: one of them at half strength plus unit Gaussian
  noise), SGD with momentum 0.9 at 0.02.
- ``tiny``: a 2-layer MLP regressing a fixed random teacher, SGD at 0.1 (the test's model,
  ``tests/test_compression_convergence.py``).

Methods (each a DDP communication hook on the same DDP module): ``none`` (DDP's all-reduce),
``fp16`` and ``bf16`` (``default_hooks.fp16_compress_hook``/``bf16_compress_hook``),
``powersgd`` (rank 1 and 4, with error feedback and warm start; ``powersgd-no-ef``: neither;
uncompressed for the first 10% of the steps, as PyTorch's docs advise)
and ``top-k`` (1% with error feedback; ``top-k-no-ef``: without) from
``planner.families.gradient_compression.runtime``, as a compiled plan registers them.

Each method's line: the trained model's loss on ``EVAL_BATCHES`` held-out global batches (the
same for every method), its ratio to uncompressed, and the step at which it first came within
the tolerance of uncompressed training's final loss (evaluated ``EVALUATIONS`` times along the
run), as a multiple of the step uncompressed training got there: a ratio of final losses is
harsh when uncompressed training drives its loss near 0, steps to a target loss are not.
The tolerance we accept: a method with error feedback ends within ``TOLERANCE`` (10%) of
uncompressed training's final loss; without error feedback it may be worse (that is what
error feedback is for).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples import cnn as cnn_example  # noqa: E402
from examples import gpt as gpt_example  # noqa: E402
from examples import train_gpt  # noqa: E402
from planner.families.gradient_compression import convergence  # noqa: E402
from planner.families.gradient_compression.runtime import register_compression  # noqa: E402

# Relative: a method with error feedback ends within 10% of uncompressed loss (the report's
# convergence-risk line reads the same figure).
TOLERANCE = convergence.TOLERANCE
EVAL_BATCHES = 8  # held-out global batches the final loss is measured on
EVAL_SEED_OFFSET = 1000  # their data seed: the training data's plus this (same model, task)
EVALUATIONS = 20  # held-out evaluations along a run, for the steps each method takes to the target
METHODS = ("none", "fp16", "bf16", "powersgd-1", "powersgd-4", "powersgd-no-ef", "top-k", "top-k-no-ef")
WITH_ERROR_FEEDBACK = ("powersgd-1", "powersgd-4", "top-k")


def _gpt_task(seed: int):
    torch.manual_seed(seed)
    model, _ = gpt_example.build(**train_gpt.MODEL)
    batches = lambda data_seed: train_gpt.batches(train_gpt.MODEL["batch_size"] * 2, seed=data_seed)  # noqa: E731
    optimizer = lambda params: torch.optim.AdamW(params, lr=3e-3)  # noqa: E731
    return model, batches, optimizer, 1.0


def _teacher_batches(inputs_shape: tuple[int, ...], teacher, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        inputs = torch.randn(inputs_shape, generator=generator)
        with torch.no_grad():  # left before the yield: the caller's step needs gradients
            targets = teacher(inputs)
        yield inputs, targets


def _prototype_batches(prototypes: torch.Tensor, batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        labels = torch.randint(0, len(prototypes), (batch,), generator=generator)
        yield 0.5 * prototypes[labels] + torch.randn((batch, *prototypes.shape[1:]), generator=generator), labels


def _cnn_task(seed: int):
    torch.manual_seed(seed)
    model, _ = cnn_example.build(batch_size=32)
    # Ten fixed random 16 x 16 images; a sample is one of them, half strength, in unit noise.
    prototypes = torch.randn((10, 3, 16, 16), generator=torch.Generator().manual_seed(seed + 1))
    optimizer = lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9)  # noqa: E731
    return model, lambda data_seed: _prototype_batches(prototypes, 32, data_seed), optimizer, None


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(inputs), targets)


def _tiny_task(seed: int):
    torch.manual_seed(seed)
    model = _Regressor()
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 16))
    optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    return model, lambda data_seed: _teacher_batches((32, 32), teacher, data_seed), optimizer, None


TASKS = {"gpt": _gpt_task, "cnn": _cnn_task, "tiny": _tiny_task}


def _register(module: DistributedDataParallel, method: str, steps: int) -> None:
    if method == "none":
        return
    if method in ("fp16", "bf16"):
        hook = default_hooks.fp16_compress_hook if method == "fp16" else default_hooks.bf16_compress_hook
        module.register_comm_hook(module.process_group, hook)
    elif method.startswith("powersgd"):
        feedback = method != "powersgd-no-ef"
        rank = int(method.rsplit("-", 1)[1]) if feedback else 1
        # Plain all-reduces for the first 10% of the steps, as PyTorch's PowerSGD docs advise
        # (start_powerSGD_iter; 2 is the least it takes with error feedback or warm start).
        register_compression(module, "powersgd", rank=rank, error_feedback=feedback, warm_start=feedback,
                             start_iter=max(2, steps // 10))
    elif method.startswith("top-k"):
        register_compression(module, "top-k", fraction=0.01, error_feedback=method == "top-k")
    else:
        raise ValueError(f"no method {method!r}; methods are {', '.join(METHODS)}")


def _held_out_loss(model: torch.nn.Module, held_out: list) -> float:
    """``model``'s mean loss on the ``held_out`` global batches, averaged over ranks."""
    with torch.no_grad():
        loss = torch.stack([model(*(part.contiguous() for part in batch)) for batch in held_out]).mean()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def train(task: str, method: str, steps: int, seed: int = 0, sgd_lr: float | None = None,
          clip: bool = True) -> list[tuple[int, float]]:
    """Train ``task`` for ``steps`` steps with ``method``; the trained model's mean loss on
    ``EVAL_BATCHES`` held-out global batches (drawn with another seed, the same for every
    method), averaged over ranks, after every ``steps // EVALUATIONS`` steps: (step, loss)
    pairs, the last after step ``steps``. ``sgd_lr``: SGD with momentum 0.9 at this rate
    instead of the task's optimizer (does a method's gap come from the optimizer?); ``clip``
    False: no gradient clipping even where the task clips (does clipping cut error feedback's
    catch-up?)."""
    model, make_batches, make_optimizer, max_norm = TASKS[task](seed)
    if sgd_lr is not None:
        make_optimizer = lambda params: torch.optim.SGD(params, lr=sgd_lr, momentum=0.9)  # noqa: E731
    batches, held_out_batches = make_batches(seed), make_batches(seed + EVAL_SEED_OFFSET)
    held_out = [next(held_out_batches) for _ in range(EVAL_BATCHES)]
    module = DistributedDataParallel(model)
    _register(module, method, steps)
    optimizer = make_optimizer(module.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    every = max(1, steps // EVALUATIONS)
    curve = []
    for step in range(1, steps + 1):
        inputs, targets = next(batches)
        local = (inputs.chunk(world)[rank].contiguous(), targets.chunk(world)[rank].contiguous())
        loss = module(*local)
        loss.backward()
        if clip and max_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % every == 0 or step == steps:
            curve.append((step, _held_out_loss(model, held_out)))
    return curve


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step at which ``curve``'s loss is at most ``target``; None if never."""
    return next((step for step, loss in curve if loss <= target), None)


def _print_table(task: str, steps: int, curves: dict[str, list[tuple[int, float]]]) -> None:
    """Each method's final loss and its ratio to uncompressed training's, and the steps it
    took to come within the tolerance of uncompressed training's final loss (the ratio of
    final losses alone is harsh when uncompressed training drives its loss near 0)."""
    base = curves["none"][-1][1]
    target = base * (1 + TOLERANCE)
    base_steps = steps_to_reach(curves["none"], target)
    print(f"{task}: world {dist.get_world_size()}, {steps} steps, loss on {EVAL_BATCHES} held-out batches every "
          f"{curves['none'][0][0]} steps; tolerance with error feedback {TOLERANCE:.0%} (target loss {target:.4f})",
          flush=True)
    for method, curve in curves.items():
        loss = curve[-1][1]
        reached = steps_to_reach(curve, target)
        when = f"target at step {reached} (x{reached / base_steps:.2f})" if reached else "target not reached"
        verdict = ""
        if method in WITH_ERROR_FEEDBACK:
            verdict = "within tolerance" if loss <= target else "OUTSIDE tolerance"
        print(f"  {method:<15} final loss {loss:.4f}  x{loss / base:.3f} of uncompressed  {when:<28} {verdict}".rstrip(),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=(*TASKS, "all"), default="all")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from " + ", ".join(METHODS))
    parser.add_argument("--sgd-lr", type=float, default=None,
                        help="train with SGD (momentum 0.9) at this rate instead of each task's optimizer")
    parser.add_argument("--no-clip", action="store_true", help="no gradient clipping (the gpt task clips at 1.0)")
    options = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    methods = [name.strip() for name in options.methods.split(",") if name.strip()]
    if "none" not in methods:
        methods.insert(0, "none")
    if "bf16" in methods and dist.get_backend() == "gloo":
        methods.remove("bf16")
        if dist.get_rank() == 0:
            print("bf16: not run, PyTorch's bf16_compress_hook needs NCCL (it refuses gloo)", flush=True)
    tasks = list(TASKS) if options.model == "all" else [options.model]
    tasks = [task for task in tasks if options.model != "all" or task != "tiny"]
    for task in tasks:
        curves = {method: train(task, method, options.steps, sgd_lr=options.sgd_lr, clip=not options.no_clip)
                  for method in methods}
        if dist.get_rank() == 0:
            _print_table(task, options.steps, curves)
    dist.barrier()  # PowerSGD's gloo work finishes on every rank before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
