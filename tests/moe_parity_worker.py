"""torchrun worker for ``tests/test_moe_runtime.py``: ``codegen.runtime.moe`` and
``codegen.runtime.moe_modes`` against ``examples/moe.py``'s MoE layer on one device, for each
mode, several placements and capacities, in one launch. Rank 0 prints ``RESULT <case> ok <max error>`` or ``RESULT <case> FAILED <why>``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from codegen.runtime.moe import ExpertParallelMoE, FlatExchange, sum_copied_expert_gradients
from codegen.runtime.moe_exchange import TwoLevelExchange
from codegen.runtime.moe_modes import DataParallelMoE, ExpertSlicedMoE
from codegen.runtime.launcher import exit_now

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("moe_example", REPO / "examples" / "moe.py")
moe_example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(moe_example)

BATCH, SEQ, WIDTH, FFN, EXPERTS, TOP_K, COEF = 8, 6, 16, 24, 8, 2, 0.5


def placements(world: int) -> dict[str, list]:
    round_robin = [[(e % world, 1.0)] for e in range(EXPERTS)]
    # Experts 0 and 1 copied: expert 0 on ranks 0 and 1 (0.7 / 0.3 of its slots), expert 1
    # on the last two ranks (halves); the others round-robin.
    copied = [[(0, 0.7), (1, 0.3)], [(world - 2, 0.5), (world - 1, 0.5)]]
    copied += [[(e % world, 1.0)] for e in range(2, EXPERTS)]
    # Every expert on rank 0: the other ranks hold none and only send and receive tokens.
    one_rank = [[(0, 1.0)] for _ in range(EXPERTS)]
    return {"round-robin": round_robin, "copied": copied, "one rank": one_rank}


def build_layer(mode: str, reference, placement, capacity_factor: float, averaged: bool):
    """The layer under test, built from the reference layer's weights. ``expert_parallel
    two-level``: rows move by the two-level all-to-all, with nodes of 2 ranks (of 1 at world 2)."""
    weights = (reference.router.weight, reference.experts.w_in, reference.experts.w_out)
    if mode == "expert_parallel two-level":
        exchange = TwoLevelExchange(None, ranks_per_node=max(1, dist.get_world_size() // 2))
        return ExpertParallelMoE(*weights, placement, TOP_K, capacity_factor, rank_losses_averaged=averaged,
                                 exchange=exchange)
    if mode == "expert_parallel":
        return ExpertParallelMoE(*weights, placement, TOP_K, capacity_factor, rank_losses_averaged=averaged)
    if mode == "data_parallel":
        return DataParallelMoE(*weights, TOP_K, capacity_factor)
    return ExpertSlicedMoE(*weights, TOP_K, capacity_factor, rank_losses_averaged=averaged)


def run_case(mode: str, placement, capacity_factor: float, sum_copies: bool = True, averaged: bool = False) -> str:
    """One layer step against the reference. ``averaged``: each rank's loss is the mean over
    its own tokens (world x its share of the sum), as in data-parallel training; else the
    ranks' losses sum to the single device's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = moe_example.MoE(WIDTH, EXPERTS, TOP_K, capacity_factor, FFN)
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.3)
    # A skewed router: expert 0 gets most first choices, so capacities bind.
    with torch.no_grad():
        reference.router.weight[0] += 0.8
    x = torch.randn(BATCH, SEQ, WIDTH)
    probe = torch.randn(BATCH, SEQ, WIDTH)
    out, balance = reference(x)
    loss = (out * probe).sum() / (BATCH * SEQ) + COEF * balance
    loss.backward()

    layer = build_layer(mode, reference, placement, capacity_factor, averaged)
    local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    mine, their_balance = layer(x[local])
    # Per-rank losses sum to the single device's: the balance term split evenly.
    local_loss = (mine * probe[local]).sum() / (BATCH * SEQ) + COEF * their_balance / world
    (local_loss * world if averaged else local_loss).backward()
    if sum_copies and mode.startswith("expert_parallel") and not averaged:
        sum_copied_expert_gradients(layer)
    full = layer.full_parameters()
    replicated = ["router.weight"] + (["experts.w_in", "experts.w_out"] if mode == "data_parallel" else [])
    grads = {name: grad.clone() for name, (_, grad) in full.items()}
    for name in replicated:  # data parallel: gradients summed (averaged, for averaged losses) over ranks
        dist.all_reduce(grads[name])
        if averaged:
            grads[name] /= world
    total_loss = local_loss.detach().clone()
    dist.all_reduce(total_loss)

    reference_grads = dict(reference.named_parameters())
    errors = {
        "output": (mine - out[local]).abs().max(),
        "balance": (their_balance - balance).abs(),
        "loss": (total_loss - loss).abs(),
        **{f"{name} grad": (grads[name] - reference_grads[name].grad).abs().max() for name in grads},
        **{f"{name} value": (value - reference_grads[name].detach()).abs().max() for name, (value, _) in full.items()},
    }
    worst = torch.stack([e.detach().reshape(()) for e in errors.values()])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    kind, value = max(zip(errors, worst.tolist()), key=lambda item: item[1])
    dropped = torch.tensor(float(layer.last_dropped))
    dist.all_reduce(dropped)
    share = dropped.item() / (BATCH * SEQ * TOP_K)
    return f"{'ok' if value < 1e-5 else 'FAILED'} worst {kind} {value:.3e} dropped {share:.3f}"


def two_level_matches_flat() -> str:
    """The two-level all-to-all delivers exactly what the flat one does (same rows, same
    order, same sizes), for uneven random sizes including empty ones, and its backward
    returns each row's gradient to the row it came from."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    send_sizes = torch.randint(0, 4, (world,), generator=generator).tolist()
    # Each row says where it comes from and where it goes: (source, destination, index).
    rows = torch.tensor([[rank, d, i] for d in range(world) for i in range(send_sizes[d])], dtype=torch.float64)
    rows = rows.reshape(-1, 3).requires_grad_()
    flat, flat_sizes = FlatExchange()(rows, send_sizes)
    two_level, two_level_sizes = TwoLevelExchange(None, ranks_per_node=max(1, world // 2))(rows, send_sizes)
    (two_level * torch.arange(1, two_level.numel() + 1, dtype=torch.float64).view_as(two_level)).sum().backward()
    grad_two_level = rows.grad.clone()
    rows.grad = None
    (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64).view_as(flat)).sum().backward()
    same = torch.equal(flat, two_level) and flat_sizes == two_level_sizes and torch.equal(rows.grad, grad_two_level)
    same = same and bool((flat[:, 1] == rank).all())  # every row reached its destination
    verdict = torch.tensor(0.0 if same else 1.0)
    dist.all_reduce(verdict)
    return "ok same rows, order and gradients" if verdict.item() == 0 else "FAILED the two-level all-to-all differs"


def sharded_experts_step_with_foreach() -> str:
    """A multi-tensor (foreach, the GPU default) AdamW step over DDP-style plain weights and
    experts sharded over their copies (``codegen.runtime.expert_copies``) runs when the two
    kinds are in separate groups (``plain_and_sharded_groups``), and one mixed list is refused
    (what the groups are for)."""
    from torch.distributed.device_mesh import init_device_mesh

    from codegen.runtime.expert_copies import copy_mesh, plain_and_sharded_groups, shard_over_copies

    world = dist.get_world_size()
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))["dp"]
    groups = tuple((2 * g, 2 * g + 1) for g in range(world // 2))
    plain, experts = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    shard_over_copies(experts, copy_mesh(dp_mesh, groups))
    params = [*plain.parameters(), *experts.parameters()]
    for param in params:
        param.grad = torch.ones_like(param)
    torch.optim.AdamW(plain_and_sharded_groups(params), lr=1e-3, foreach=True).step()
    try:
        torch.optim.AdamW(params, lr=1e-3, foreach=True).step()
    except RuntimeError as error:
        if "mixed torch.Tensor and DTensor" in str(error):
            return "ok grouped step ran, one mixed list refused"
        raise
    return "FAILED a mixed list stepped: the groups are not needed"


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cases = []
    for placement_name in ("round-robin", "copied"):
        placement = placements(world)[placement_name]
        for capacity in (1.25, 0.5, 0.0):
            cases.append((f"{placement_name} capacity {capacity}", "expert_parallel", placement, capacity, True, False))
    for placement_name in ("round-robin", "copied"):
        cases.append((f"{placement_name} capacity 0.5, two-level all-to-all", "expert_parallel two-level",
                      placements(world)[placement_name], 0.5, True, True))
    cases.append(("one rank capacity 0.5, averaged rank losses", "expert_parallel", placements(world)["one rank"], 0.5, True, True))
    cases.append(("copied capacity 1.25, averaged rank losses", "expert_parallel", placements(world)["copied"], 1.25, True, True))
    for mode in ("data_parallel", "expert_sliced"):
        for capacity in (1.25, 0.5, 0.0):
            cases.append((f"{mode} capacity {capacity}", mode, None, capacity, True, False))
    cases.append(("expert_sliced capacity 0.5, averaged rank losses", "expert_sliced", None, 0.5, True, True))
    cases.append(("copied capacity 1.25, copies not summed (control)", "expert_parallel", placements(world)["copied"], 1.25, False, False))
    for name, mode, placement, capacity, sum_copies, averaged in cases:
        result = run_case(mode, placement, capacity, sum_copies, averaged)
        if dist.get_rank() == 0:
            print(f"RESULT {name}: {result}", flush=True)
    result = two_level_matches_flat()
    if dist.get_rank() == 0:
        print(f"RESULT two-level all-to-all equals flat: {result}", flush=True)
    result = sharded_experts_step_with_foreach()
    if dist.get_rank() == 0:
        print(f"RESULT sharded experts foreach step: {result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main() or 0)  # not sys.exit: see codegen.runtime.exit_status.exit_now
