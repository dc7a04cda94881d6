"""torchrun worker for ``tests/test_summa_runtime.py``: ``codegen.runtime.summa`` against one
device, every case in one launch. World 4 is a 2 x 2 grid (2-D SUMMA); world 8 a 2 x 2 x 2
grid, run as 2.5-D (q = 2, d = 2) and as 3-D (q = 2). Every rank computes the single-device
reference on the full tensors (same seed), then its own blocks; rank 0 prints
``RESULT <case>: ok worst <tensor> <error>`` or ``RESULT <case>: FAILED worst <tensor> <error>``
(absolute errors of fp32 tensors; the loss, a sum of a few hundred terms, relative).

The controls run the 2-D / 2.5-D MLP, and the 2.5-D matmul, with ``all_reduce_gradient``
replaced by the identity: the gradients of replicated shards (norm and bias chunks; 2.5-D's
weight blocks, shared by the depth slices) then count only this rank's rows, and must disagree
with one device."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from codegen.runtime import summa
from codegen.runtime.launcher import exit_now
from codegen.runtime.summa import (
    BlockMLP,
    SummaGroups,
    ThreeD,
    matmul_3d,
    split_input_3d,
    split_output_3d,
    split_rows_2d,
    split_vector_2d,
    split_vector_3d,
    split_weight_2d,
    split_weight_3d,
    summa_matmul,
)

TOKENS, HIDDEN, FFN, TOLERANCE = 16, 8, 16, 1e-5


def worst(errors: dict[str, torch.Tensor]) -> str:
    """The largest error over the tensors and over every rank, as a RESULT verdict."""
    values = torch.stack([error.detach().reshape(()) for error in errors.values()])
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    name, value = max(zip(errors, values.tolist()), key=lambda item: item[1])
    return f"{'ok' if value < TOLERANCE else 'FAILED'} worst {name} {value:.3e}"


def total(local_loss: torch.Tensor) -> torch.Tensor:
    """The sum of the ranks' losses: every output element lives on exactly one rank."""
    summed = local_loss.detach().clone()
    dist.all_reduce(summed)
    return summed


def matmul_case(family: str, grid: SummaGroups) -> str:
    """One product [T, K] x [K, N]: output, loss, input and weight gradients."""
    torch.manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    w = torch.randn(HIDDEN, FFN, requires_grad=True)
    probe = torch.randn(TOKENS, FFN)
    y = x @ w
    loss = (y * probe).sum()
    loss.backward()

    if family.startswith("3d"):
        x_mine = split_input_3d(x.detach(), grid).requires_grad_()
        w_mine = split_weight_3d(w.detach(), grid).requires_grad_()
        y_mine = matmul_3d(x_mine, w_mine, grid, keep_gathered=family == "3d kept")
        expected = {"output": split_output_3d(y.detach(), grid), "x grad": split_input_3d(x.grad, grid),
                    "w grad": split_weight_3d(w.grad, grid)}
        probe_mine = split_output_3d(probe, grid)
    else:
        x_mine = split_rows_2d(x.detach(), grid).requires_grad_()
        w_mine = split_weight_2d(w.detach(), grid).requires_grad_()
        y_mine = summa_matmul(x_mine, w_mine, grid)
        expected = {"output": split_rows_2d(y.detach(), grid), "x grad": split_rows_2d(x.grad, grid),
                    "w grad": split_weight_2d(w.grad, grid)}
        probe_mine = split_rows_2d(probe, grid)
    local_loss = (y_mine * probe_mine).sum()
    local_loss.backward()
    got = {"output": y_mine, "x grad": x_mine.grad, "w grad": w_mine.grad}
    errors = {name: (got[name] - expected[name]).abs().max() for name in expected}
    errors["loss (relative)"] = (total(local_loss) - loss).abs() / loss.abs()
    return worst(errors)


def mlp_case(family: str, grid: SummaGroups) -> str:
    """LN -> fc1 -> GELU -> fc2 -> residual: output, loss, input and every parameter gradient."""
    torch.manual_seed(2)
    names = ("norm_weight", "norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")
    shapes = ((HIDDEN,), (HIDDEN,), (HIDDEN, FFN), (FFN,), (FFN, HIDDEN), (HIDDEN,))
    params = {name: (torch.randn(shape) * 0.5).requires_grad_() for name, shape in zip(names, shapes)}
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    probe = torch.randn(TOKENS, HIDDEN)
    normed = F.layer_norm(x, (HIDDEN,), params["norm_weight"], params["norm_bias"], 1e-5)
    hidden = F.gelu(normed @ params["fc1_weight"] + params["fc1_bias"])
    y = x + hidden @ params["fc2_weight"] + params["fc2_bias"]
    loss = (y * probe).sum()
    loss.backward()

    block = BlockMLP(family, grid, *(params[name].detach() for name in names))
    if family == "3d":
        split = lambda t: split_input_3d(t, grid)  # the MLP's input and output layout
        roles = {"fc1": ThreeD(), "fc2": ThreeD().swapped()}
        split_param = {
            "norm_weight": lambda g: split_vector_3d(g, grid, block.norm_group),
            "norm_bias": lambda g: split_vector_3d(g, grid, block.norm_group),
            "fc1_weight": lambda g: split_weight_3d(g, grid, roles["fc1"]),
            "fc1_bias": lambda g: split_vector_3d(g, grid, roles["fc1"].gather_input),
            "fc2_weight": lambda g: split_weight_3d(g, grid, roles["fc2"]),
            "fc2_bias": lambda g: split_vector_3d(g, grid, roles["fc2"].gather_input),
        }
    else:
        split = lambda t: split_rows_2d(t, grid)
        split_param = {name: (lambda g: split_weight_2d(g, grid)) if g_is_matrix
                       else (lambda g: split_vector_2d(g, grid))
                       for name, g_is_matrix in zip(names, (False, False, True, False, True, False))}
    x_mine = split(x.detach()).requires_grad_()
    y_mine = block(x_mine)
    local_loss = (y_mine * split(probe)).sum()
    local_loss.backward()
    errors = {"output": (y_mine - split(y.detach())).abs().max(),
              "x grad": (x_mine.grad - split(x.grad)).abs().max(),
              "loss (relative)": (total(local_loss) - loss).abs() / loss.abs()}
    for name in names:
        errors[f"{name} grad"] = (getattr(block, name).grad - split_param[name](params[name].grad)).abs().max()
    return worst(errors)


def without_replica_reduction(case):
    """``case`` with the replicas' gradient all-reduce skipped: a control that must fail."""
    def control(family: str, grid: SummaGroups) -> str:
        real = summa.all_reduce_gradient
        summa.all_reduce_gradient = lambda grad, groups: grad
        try:
            return case(family, grid)
        finally:
            summa.all_reduce_gradient = real
    return control


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("row", "col"))
        grid = SummaGroups.from_mesh(mesh, "row", "col")
        cases = [("2d matmul", matmul_case, "2d"), ("2d mlp", mlp_case, "2d"),
                 ("2d mlp, replica gradients not summed (control)", without_replica_reduction(mlp_case), "2d")]
    elif world == 8:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("depth", "row", "col"))
        grid = SummaGroups.from_mesh(mesh, "row", "col", "depth")
        cases = [("2.5d matmul", matmul_case, "2d"), ("2.5d mlp", mlp_case, "2d"),
                 ("3d matmul", matmul_case, "3d"), ("3d mlp", mlp_case, "3d"),
                 ("3d matmul, gathers kept", matmul_case, "3d kept"),
                 ("2.5d mlp, replica gradients not summed (control)", without_replica_reduction(mlp_case), "2d"),
                 # The matmul's only replicated tensor is W over depth: the depth all-reduce.
                 ("2.5d matmul, depth all-reduce skipped (control)", without_replica_reduction(matmul_case), "2d")]
    else:
        raise SystemExit(f"summa_parity_worker runs at world 4 or 8, not {world}")
    for name, case, family in cases:
        result = case(family, grid)
        if dist.get_rank() == 0:
            print(f"RESULT {name}: {result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main() or 0)  # not sys.exit: see codegen.runtime.exit_status.exit_now
