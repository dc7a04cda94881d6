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
