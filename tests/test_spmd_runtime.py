"""Pure helpers of the graph programs' runtime (``codegen.runtime.spmd``)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from codegen.runtime.spmd import keep_whole


@pytest.mark.parametrize(
    ("held", "wanted", "expected"),
    [
        # Partial sums read where the plan says partial averages: they stay sums (DTensor
        # refuses P(sum) -> P(avg); a reader of partial values takes either).
        ((Partial("sum"),), (Partial("avg"),), (Partial("sum"),)),
        ((Partial("avg"),), (Partial("sum"),), (Partial("avg"),)),
        # A whole value read as partial stays whole (DTensor makes partial values only inside ops).
        ((Replicate(),), (Partial("avg"),), (Replicate(),)),
        # A split value read as partial is gathered whole (Shard -> Partial has no collective).
        ((Shard(0),), (Partial(),), (Replicate(),)),
        # Anything else is what the plan asks, axis by axis.
        ((Shard(0), Partial()), (Replicate(), Shard(1)), (Replicate(), Shard(1))),
    ],
)
def test_keep_whole_never_asks_dtensor_for_partial_values(held, wanted, expected):
    assert keep_whole(held, wanted) == expected
