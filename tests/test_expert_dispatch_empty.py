"""A rank whose experts receive no token still joins every backward all-to-all.

``codegen.runtime.expert_dispatch.ExpertParallelExperts`` sends each token's rows to the
holders of its experts and runs their experts there. When a rank receives no rows (its
experts were chosen by no token of the micro-batch, common at one sample per micro-batch),
its output used to depend on its weights only: its backward never reached the dispatch's
all-to-all, which returns the gradients of the rows this rank *sent*, while every other rank
of the group waited in it. Compiled tiny DeepSeek-V3 (pp2 x dp2 x tp2, EP4, 4 micro-batches)
hung at ``--check`` that way. Here rank 1 of a fake world of two holds expert 1, every token
chooses expert 0, and the exchanges are replaced by local stand-ins that record whether their
backward ran.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from codegen.runtime import expert_dispatch


class _Experts(torch.nn.Module):
    """HF's stacked SwiGLU experts, as the dispatcher reads them."""

    def __init__(self, experts: int = 2, hidden: int = 4, ffn: int = 3) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * ffn, hidden))
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, ffn))
        self.act_fn = torch.nn.functional.silu


class _Recorded(torch.autograd.Function):
    """Stand-in for an all-to-all of rows: forward returns ``rows_out`` (what this rank
    receives), backward records that it ran (the collective every rank must join)."""

    @staticmethod
    def forward(ctx, rows, rows_out, log, name):
        ctx.log, ctx.name, ctx.sent = log, name, rows.shape
        return rows_out

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.name)
        return grad.new_zeros(ctx.sent), None, None, None


@pytest.fixture
def rank1_of_two():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


def test_a_rank_that_receives_no_rows_still_runs_the_dispatch_backward(rank1_of_two, monkeypatch):
    log: list[str] = []
    calls = iter(["dispatch", "combine"])

    def rows_exchange(rows, receive_sizes, send_sizes, group):
        name = next(calls)
        received = rows.new_zeros(sum(receive_sizes), *rows.shape[1:])  # nothing comes to rank 1
        return _Recorded.apply(rows, received, log, name)

    # Rank 1 sends its 3 tokens' rows to rank 0 (expert 0) and receives none.
    monkeypatch.setattr(expert_dispatch, "exchange_counts", lambda counts, group: torch.zeros_like(counts))
    monkeypatch.setattr(expert_dispatch, "all_to_all_rows", rows_exchange)
    monkeypatch.setattr(expert_dispatch, "all_to_all_values",
                        lambda rows, receive_sizes, send_sizes, group: rows.new_zeros(sum(receive_sizes)))
    layer = expert_dispatch.ExpertParallelExperts(_Experts(), [[(0, 1.0)], [(1, 1.0)]], top_k=1,
                                                  rank_losses_averaged=False)
    assert layer.local_experts == [1]
    hidden = torch.randn(3, 4, requires_grad=True)
    out = layer(hidden, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    out.sum().backward()
    assert log == ["combine", "dispatch"], f"backward all-to-alls run on the rank that received nothing: {log}"
