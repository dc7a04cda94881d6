"""Run under torchrun by ``tests/test_checkpoint.py``: for each compiled program folder given,
build this rank's module the way ``launch.py`` does (``Program.build_module``: meta, then
only this rank's shards) and print, per rank, one ``RESULT`` line:

    RESULT <folder> rank=<r> peak_build_bytes=<b> held_bytes=<h> mismatched=<m> compared=<c>

``peak_build_bytes`` (of a second build: the first pays for imports and caches) is how much the rank's resident memory rose above where it was before
the build at its highest (``VmHWM`` reset through ``/proc/self/clear_refs``), ``held_bytes``
the bytes of the parameter shards it holds. With ``exact:``, every held shard is also
compared (``torch.equal``) with the same slice of the whole model ``Program.build_model``
gives (the single-device reference's weights): ``mismatched`` counts the unequal ones. With
``steps=N:`` the folder then trains N steps through ``launch.py``'s loop (losses printed),
and a ``TRAINED <folder> rank=<r> peak_train_bytes=<b>`` line says how far the rank's
resident memory rose while training (build, weights, gradients, AdamW states, gathers).

    torchrun --nproc_per_node N tests/init_ckpt_worker.py [exact:|steps=N:]FOLDER...

(a folder may carry one prefix: ``exact:`` or ``steps=N:``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codegen.runtime.launcher import exit_now  # noqa: E402
from codegen.runtime.materialize import derived_parameters, parameter_names  # noqa: E402
from codegen.runtime.program import load_program  # noqa: E402
from codegen.runtime.training_loop import LoopOptions, train  # noqa: E402


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def check(folder: str, exact: bool, steps: int) -> None:
    program = load_program(folder)
    mesh = program.build_mesh()
    warm_up = program.build_module(mesh)  # once unmeasured: first-use imports and caches are not the model's
    del warm_up
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as refs:  # the peak from here on
        refs.write("5")
    before = _status_kib("VmRSS")
    model, module, _, _ = program.build_module(mesh)
    peak = (_status_kib("VmHWM") - before) * 1024
    held = {id(p): p for p in module.parameters()}
    held_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in held.values())
    mismatched = compared = 0
    if exact:
        reference, _, _ = program.build_model()
        whole = dict(reference.named_parameters())
        names = parameter_names(model)
        derived = derived_parameters(model)  # MoE layers' experts: parts of the model's weights
        for param in held.values():
            name = names[id(param)]
            if name in derived:
                expected = derived[name].part_of(whole[derived[name].source_name].detach())
            else:
                expected = whole[name].detach()
            if isinstance(param, DTensor):
                expected = distribute_tensor(expected, param.device_mesh, param.placements, src_data_rank=None).to_local()
                local = param.to_local()
            else:
                local = param
            compared += 1
            mismatched += not torch.equal(local.detach(), expected)
    line = (
        f"RESULT {folder} rank={dist.get_rank()} peak_build_bytes={peak} held_bytes={held_bytes} "
        f"mismatched={mismatched} compared={compared}\n"
    )
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())  # one write: the ranks share stdout
    del model, module, held
    gc.collect()
    if steps:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = _status_kib("VmRSS")
        train(program, mesh, LoopOptions(steps=steps, lr=1e-3, optimizer="adamw"))
        trained = f"TRAINED {folder} rank={dist.get_rank()} peak_train_bytes={(_status_kib('VmHWM') - before) * 1024}\n"
        os.write(sys.stdout.fileno(), trained.encode())
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+")
    options = parser.parse_args()
    for argument in options.folders:
        exact = argument.startswith("exact:")
        steps = int(argument.split(":", 1)[0].removeprefix("steps=")) if argument.startswith("steps=") else 0
        folder = argument.split(":", 1)[1] if exact or steps else argument
        check(folder, exact, steps)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())
