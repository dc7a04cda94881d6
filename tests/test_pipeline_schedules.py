"""The simulator's interleaved 1F1B order (``cost_model.schedules.interleaved``) against the
order torch's ``ScheduleInterleaved1F1B`` runs, which compiled interleaved programs use
(``codegen.pipeline_schedules``): every rank's forward and backward steps, micro-batch and
chunk, in the same order when micro-batches divide by pp (what plans have)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import ScheduleInterleaved1F1B

from cost_model.schedules import interleaved


def _torch_order(pp: int, chunks: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s compute actions in torch's interleaved schedule, as (kind, micro-batch,
    chunk). The schedule's own order computation, without building stages or process groups
    (it reads only these fields; torch is pinned, so the method is stable here)."""
    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, chunks, micro_batches
    schedule.number_of_rounds = max(1, micro_batches // pp)
    schedule.microbatches_per_round = micro_batches // schedule.number_of_rounds
    schedule.rank = rank
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    actions = [a for a in schedule._calculate_single_rank_operations(rank) if a is not None]
    return [(kinds[a.computation_type.name], a.microbatch_index, a.stage_index // pp) for a in actions]


@pytest.mark.parametrize(("pp", "chunks", "micro_batches"), [(2, 2, 4), (2, 2, 2), (4, 2, 8), (2, 3, 4), (4, 4, 8), (4, 2, 4)])
def test_simulated_interleaved_order_is_torchs(pp: int, chunks: int, micro_batches: int) -> None:
    for rank in range(pp):
        assert interleaved(rank, pp, micro_batches, chunks) == _torch_order(pp, chunks, micro_batches, rank), f"rank {rank}"


def _most_in_flight(order: list[tuple[str, int, int]]) -> int:
    """The most forward passes whose backward has not yet run, over a rank's order."""
    held = most = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


@pytest.mark.parametrize(("micro_batches", "rank", "in_flight"), [
    # Llama 3 405B's layout (benchmarks/fidelity_runs.py: pp 16, 8 one-layer chunks per rank).
    # 8,192 GPUs, 32 micro-batches: warm-up 2 (pp - rank - 1) + (chunks - 1) pp (Megatron-LM's
    # forward_backward_pipelining_with_interleaving; torch's _get_warmup_ops), then one more
    # forward before the first backward: rank 0 30 + 112 + 1 = 143, rank 1 28 + 112 + 1 = 141,
    # the last rank 0 + 112 + 1 = 113.
    (32, 0, 143), (32, 1, 141), (32, 15, 113),
    # 16,384 GPUs, 16 micro-batches, 16 x 8 = 128 passes: ranks 0-7, whose warm-up is at least
    # 2 x 8 + 112 = 128, run every forward before their first backward (128); rank 8 holds
    # 14 + 112 + 1 = 127, rank 15 113 as at 32 micro-batches.
    (16, 0, 128), (16, 1, 128), (16, 7, 128), (16, 8, 127), (16, 15, 113),
])
def test_llama3_405b_passes_in_flight_are_torchs(micro_batches: int, rank: int, in_flight: int) -> None:
    """The passes a rank holds activations for at once: the simulator's order (what
    ``cost_model.step_memory`` walks) and torch's agree, at the counts worked out by hand."""
    ours = interleaved(rank, 16, micro_batches, 8)
    assert _most_in_flight(ours) == in_flight
    assert ours == _torch_order(16, 8, micro_batches, rank)
