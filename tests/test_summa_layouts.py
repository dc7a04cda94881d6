"""The block layouts of ``codegen.runtime.summa`` without processes: over every grid position,
the blocks of an activation, a weight and a vector tile the full tensor exactly once, and the
3-D output layout of one matmul is the input layout of the next (the roles swapped). Shapes
that do not split say so."""

from __future__ import annotations

import itertools

import pytest
import torch

from codegen.runtime.summa import (
    SummaGroups,
    ThreeD,
    split_input_3d,
    split_output_3d,
    split_rows_2d,
    split_vector_2d,
    split_weight_2d,
    split_weight_3d,
    summa_matmul,
)


def positions(q: int, d: int):
    """A SummaGroups per grid position; no process groups (splitting needs none)."""
    for i, j, k in itertools.product(range(q), range(q), range(d)):
        yield SummaGroups(q, d, i, j, k, row=None, col=None, depth=None)


def indexed(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel()).reshape(shape)


@pytest.mark.parametrize("q,d", [(2, 1), (2, 2), (3, 1), (2, 3)])
def test_2d_blocks_tile_activations_and_weights(q, d):
    rows, cols = 2 * d * q, 2 * q
    activation, weight, vector = indexed(rows, cols), indexed(2 * q, 3 * q), indexed(2 * q)
    cover = torch.zeros(activation.numel(), dtype=torch.long)
    for grid in positions(q, d):
        block = split_rows_2d(activation, grid)
        assert block.shape == (2, 2)
        # Row chunk k q + i of d q (2 rows each), column chunk j of q (2 columns each).
        assert block[0, 0].item() == (grid.k * q + grid.i) * 2 * cols + grid.j * 2
        cover += torch.bincount(block.reshape(-1), minlength=activation.numel())
    assert torch.all(cover == 1)  # every element on exactly one rank
    weight_cover = torch.zeros(weight.numel(), dtype=torch.long)
    for grid in positions(q, 1):
        weight_cover += torch.bincount(split_weight_2d(weight, grid).reshape(-1), minlength=weight.numel())
        assert split_vector_2d(vector, grid).tolist() == vector.chunk(q)[grid.j].tolist()
    assert torch.all(weight_cover == 1)


def test_3d_shards_tile_once_and_chain():
    q = 2
    activation, weight = indexed(16, 8), indexed(8, 4)
    first, second = ThreeD(), ThreeD().swapped()
    for roles in (first, second):
        for split, full in ((lambda t, g, roles=roles: split_input_3d(t, g, roles), activation),
                            (lambda t, g, roles=roles: split_output_3d(t, g, roles), activation),
                            (lambda t, g, roles=roles: split_weight_3d(t, g, roles), weight)):
            cover = torch.zeros(full.numel(), dtype=torch.long)
            for grid in positions(q, q):
                cover += torch.bincount(split(full, grid).reshape(-1), minlength=full.numel())
            assert torch.all(cover == 1)
    for grid in positions(q, q):
        # The first matmul's output shard is the second's input shard, on every rank.
        assert torch.equal(split_output_3d(activation, grid, first), split_input_3d(activation, grid, second))
        # ... and the second's output returns to the first's input layout (residual add local).
        assert torch.equal(split_output_3d(activation, grid, second), split_input_3d(activation, grid, first))
        assert split_input_3d(activation, grid).shape == (16 // q ** 2, 8 // q)
        assert split_weight_3d(weight, grid).shape == (8 // q ** 2, 4 // q)


def test_shapes_that_do_not_split_say_so():
    grid = SummaGroups(2, 1, 0, 0, 0, row=None, col=None, depth=None)
    with pytest.raises(ValueError, match="does not split into 2 equal blocks"):
        split_rows_2d(torch.zeros(5, 4), grid)
    with pytest.raises(ValueError, match="summa_matmul takes blocks"):
        summa_matmul(torch.zeros(2, 3), torch.zeros(4, 2), grid)
