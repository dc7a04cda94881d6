"""``launch.py --data`` checked on every batch: the ranks agree on each step's batch (a digest
of its bytes, NaN-safe and order-sensitive), a data function that fails, ends on some ranks
only or yields nothing is one line on every rank, and ids outside what the model's embedding
or loss can take are refused before any rank indexes with them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from codegen.index_inputs import index_inputs, index_inputs_source
from codegen.runtime.user_data import DataFeed, check_index_ranges, load_data_function, skip_batches, tensor_digest
from planner.errors import LaunchError
from planner.trace import trace
from tests.test_parity import run_ranks

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "data_feed_worker.py"


class TokenModel(torch.nn.Module):
    """Token ids into an embedding; shifted labels into a loss that ignores -1."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 10)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(input_ids))
        return F.cross_entropy(logits[:, :-1].reshape(-1, 10), labels[:, 1:].reshape(-1), ignore_index=-1)


def test_digest_is_nan_safe_and_order_sensitive() -> None:
    rows = torch.randn(4, 3)
    rows[1, 2] = float("nan")
    assert tensor_digest(rows) == tensor_digest(rows.clone())  # identical batches holding a NaN are identical
    shuffled = rows[torch.tensor([1, 0, 2, 3])]
    # The same rows in another order: every sum over the batch agrees (what a checksum of
    # sums compared), the digest does not.
    assert torch.equal(torch.nan_to_num(shuffled).sum(0), torch.nan_to_num(rows).sum(0))
    assert tensor_digest(shuffled) != tensor_digest(rows)
    assert tensor_digest(rows.to(torch.float64)) != tensor_digest(rows)  # same values, other bytes
    assert tensor_digest(rows.t()) == tensor_digest(rows.t().contiguous())  # memory layout does not matter


def test_index_inputs_follow_views_to_embedding_and_loss() -> None:
    ids, labels = torch.randint(0, 50, (4, 6)), torch.randint(0, 10, (4, 6))
    graph = trace(TokenModel(), (ids, labels), {})
    ranges = index_inputs(graph)
    assert ranges == {
        "input_ids": (50, (), "embedding 'emb' (50 rows)"),
        "labels": (10, (-1,), "the loss (10 classes, ignore_index -1)"),  # through slice and reshape
    }
    namespace: dict = {}
    exec(index_inputs_source(graph), namespace)  # the literal model_spmd.py gets
    assert namespace["INDEX_INPUTS"] == ranges


def test_index_ranges_refuse_the_first_value_outside() -> None:
    ranges = {"input_ids": (50, (), "embedding 'emb' (50 rows)"), "labels": (10, (-1,), "the loss (10 classes)")}
    names = ["input_ids", "labels"]
    ids, labels = torch.randint(0, 50, (4, 6)), torch.randint(0, 10, (4, 6))
    labels[0, :2] = -1  # ignored positions are fine
    check_index_ranges((ids, labels), {}, names, ranges, step=1)
    ids[2, 3] = 50
    with pytest.raises(LaunchError, match=r"input 'input_ids' at step 7 holds 50, but embedding 'emb' \(50 rows\) "
                                          r"takes values in \[0, 50\); fix the data"):
        check_index_ranges((ids, labels), {}, names, ranges, step=7)
    ids[2, 3], labels[1, 1] = 0, -2
    with pytest.raises(LaunchError, match=r"input 'labels' at step 1 holds -2, .* takes values in \[0, 10\) or -1;"):
        check_index_ranges((ids,), {"labels": labels}, names, ranges, step=1)


@pytest.mark.parametrize(
    "reference, message",
    [
        ("plan.json:batches", "--data: '{tmp}/plan.json' is not a Python file; give a .py file"),
        ("syntax.py:batches", "--data: {tmp}/syntax.py fails to import: SyntaxError: "),
        ("exits.py:batches", "--data: {tmp}/exits.py fails to import: SystemExit: 3; fix the file"),
        ("data.py:1st", "--data takes path/to/module.py:function, got '{tmp}/data.py:1st'"),
        ("missing.py:batches", "--data: no file '{tmp}/missing.py'"),
    ],
)
def test_data_files_that_cannot_serve_are_one_line(tmp_path: Path, reference: str, message: str) -> None:
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "syntax.py").write_text("def batches(batch_size)\n    pass\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(LaunchError) as raised:
        load_data_function(f"{tmp_path}/{reference}")
    assert str(raised.value).startswith(message.format(tmp=tmp_path)), str(raised.value)


@pytest.fixture()
def one_rank():
    assert not dist.is_initialized(), "a process group is already up in this test process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


ONE_RANK_DATA = """
import torch

def three(batch_size):
    for step in range(3):
        yield torch.full((batch_size, 2), float(step))

def nothing(batch_size):
    return iter(())

def fails_at_two(batch_size):
    yield torch.zeros(batch_size, 2)
    raise RuntimeError("shard 7 is missing")

def refuses_the_call(batch_size):
    raise ValueError(f"no split for batch {batch_size}")

def not_iterable(batch_size):
    return 5

def on_meta(batch_size):
    yield torch.zeros(batch_size, 2, device="meta")

def exits(batch_size):
    yield torch.zeros(batch_size, 2)
    raise SystemExit(0)
"""


@pytest.mark.parametrize(
    "case, outcome",
    [
        ("three", "ok 3"),
        ("nothing", "--data: nothing(4) yielded no batches"),
        ("fails_at_two", "--data: fails_at_two(4) raised RuntimeError: shard 7 is missing while yielding the batch of step 2"),
        ("refuses_the_call", "--data: refuses_the_call(4) raised ValueError: no split for batch 4; fix the data function"),
        ("not_iterable", "--data: not_iterable(4) returned an object of type int, not an iterable"),
        ("on_meta", "--data: the batch of step 1 cannot be read as plain tensors (NotImplementedError: "),
        ("exits", "--data: exits(4) raised SystemExit: 0 while yielding the batch of step 2"),  # not a silent exit 0
    ],
)
def test_data_failures_are_one_line(tmp_path: Path, one_rank, case: str, outcome: str) -> None:
    (tmp_path / "data.py").write_text(ONE_RANK_DATA)
    feed = DataFeed(f"{tmp_path / 'data.py'}:{case}", 4, (torch.zeros(4, 2),), {}, torch.device("cpu"))
    try:
        while feed.next() is not None:
            pass
        got = f"ok {feed.fetched}"
    except LaunchError as error:
        got = str(error)
    assert got.startswith(outcome) and "\n" not in got, got


def test_resuming_past_the_end_of_the_data_is_one_line(tmp_path: Path, one_rank) -> None:
    (tmp_path / "data.py").write_text(ONE_RANK_DATA)
    feed = DataFeed(f"{tmp_path / 'data.py'}:three", 4, (torch.zeros(4, 2),), {}, torch.device("cpu"))
    skip_batches(feed.next, 2)  # a checkpoint of step 2: its two batches are skipped
    assert torch.equal(feed.next()[0][0], torch.full((4, 2), 2.0)) and feed.next() is None
    again = DataFeed(f"{tmp_path / 'data.py'}:three", 4, (torch.zeros(4, 2),), {}, torch.device("cpu"))
    with pytest.raises(LaunchError, match="--data ended after 3 batches, before step 5 where the checkpoint resumes"):
        skip_batches(again.next, 5)


WORLD_DATA = """
import os
import torch

RANK = int(os.environ["RANK"])


def _batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, generator=generator), torch.randint(0, 10, (4, 5), generator=generator)


def same_with_nan(batch_size):
    for step in range(3):
        x, ids = _batch(step)
        x[0, 0] = float("nan")
        yield x, ids


def diverge_at_step_2(batch_size):
    yield _batch(0)
    yield _batch(1 + RANK)
    yield _batch(5)


def rows_shuffled_by_rank(batch_size):
    x, ids = _batch(0)
    order = torch.arange(4).roll(RANK)
    yield x[order], ids[order]


def raises_on_rank_1(batch_size):
    yield _batch(0)
    if RANK == 1:
        raise OSError("shard 7 is missing")
    yield _batch(1)


def ends_early_on_rank_1(batch_size):
    yield _batch(0)
    if RANK == 0:
        yield _batch(1)


def id_out_of_range(batch_size):
    yield _batch(0)
    x, ids = _batch(1)
    ids[2, 3] = 10
    yield x, ids


def wrong_shape_on_rank_1(batch_size):
    x, ids = _batch(0)
    yield (x, ids) if RANK == 0 else (x, ids[:, :4])
"""

WORLD_CASES = {
    "same_with_nan": "ok 3",
    "diverge_at_step_2": "error --data gave the ranks different batches at step 2: input 'x' on rank(s) 1 differs from rank 0's",
    "rows_shuffled_by_rank": "error --data gave the ranks different batches at step 1: input 'x' on rank(s) 1",
    "raises_on_rank_1": "error --data: raises_on_rank_1(4) raised OSError: shard 7 is missing while yielding the batch of "
                        "step 2; fix the data function (on rank(s) 1)",
    "ends_early_on_rank_1": "error --data ended after 1 batches on rank(s) 1 but not on the others",
    "id_out_of_range": "error --data: input 'ids' at step 2 holds 10, but embedding 'emb' (10 rows) takes values in [0, 10)",
    "wrong_shape_on_rank_1": "error --data: input 'ids' at step 1 is (4, 4) torch.int64, but the plan was made for (4, 5) torch.int64",
}


@pytest.mark.distributed
def test_ranks_agree_on_every_batch(tmp_path: Path) -> None:
    """Every case in one launch at 2 ranks: each ends on every rank alike (no rank left in
    a collective) with the verdict rank 0 prints."""
    (tmp_path / "data.py").write_text(WORLD_DATA)
    launch = run_ranks(2, WORKER, [str(tmp_path / "data.py"), *WORLD_CASES], REPO, 180)
    assert launch.returncode == 0, launch.describe()
    results = dict(line.removeprefix("RESULT ").split(" ", 1) for line in launch.stdout.splitlines() if line.startswith("RESULT "))
    assert set(results) == set(WORLD_CASES), launch.describe()
    for case, expected in WORLD_CASES.items():
        assert results[case].startswith(expected), f"{case}: {results[case]}"
    assert "(on rank(s) 1)" in results["wrong_shape_on_rank_1"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
