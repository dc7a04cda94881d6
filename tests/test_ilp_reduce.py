"""The exact reductions of the CP-SAT model (``search.ilp_reduce``) keep its optimum.

Random small models (nodes with a few candidates, edges with random pair costs, memory
caps) are solved by enumeration before and after the reductions: the optima agree, and
the removed nodes' candidates chosen by ``expand`` give the whole model that optimum.
"""

from __future__ import annotations

import copy
import itertools
import random

import pytest

from search.ilp_reduce import Edge, IlpData, expand, reduce_model


def _random_model(rng: random.Random) -> IlpData:
    names = [f"n{i}" for i in range(rng.randint(2, 6))]
    sizes = {name: rng.randint(1, 3) for name in names}
    costs = {name: [rng.randint(0, 20) for _ in range(sizes[name])] for name in names}
    # Some nodes hold the same memory whatever they choose (removable), others not.
    memory_kb = {
        name: [rng.randint(1, 9)] * sizes[name] if rng.random() < 0.6 else [rng.randint(1, 9) for _ in range(sizes[name])]
        for name in names
    }
    edges = []
    for index, consumer in enumerate(names[1:], start=1):
        for producer in rng.sample(names[:index], k=min(index, rng.choice([1, 1, 1, 2]))):
            src = [rng.choice("ab") for _ in range(sizes[producer])]
            dst = [rng.choice("abc") for _ in range(sizes[consumer])]
            cost = {(p, q): 0 if p == q else rng.randint(0, 15) for p in set(src) for q in set(dst)}
            edges.append(Edge(producer, consumer, f"{producer}->{consumer}", src, dst, cost))
    pinned = {name for name in names if rng.random() < 0.15}
    return IlpData(costs, memory_kb, edges, pinned)


def _objective(data: IlpData, choice: dict[str, int]) -> int:
    total = data.offset_ns + sum(data.costs[name][choice[name]] for name in data.costs)
    return total + sum(edge.pair_cost(choice[edge.producer], choice[edge.consumer]) for edge in data.edges)


def _memory(data: IlpData, choice: dict[str, int]) -> int:
    return data.offset_kb + sum(data.memory_kb[name][choice[name]] for name in data.costs)


def _best(data: IlpData, cap: int | None) -> tuple[int, dict[str, int]] | None:
    names = list(data.costs)
    found = None
    for combo in itertools.product(*(range(len(data.costs[name])) for name in names)):
        choice = dict(zip(names, combo))
        if cap is not None and _memory(data, choice) > cap:
            continue
        value = _objective(data, choice)
        if found is None or value < found[0]:
            found = (value, choice)
    return found


@pytest.mark.parametrize("seed", range(300))
def test_the_reduced_model_has_the_same_optimum(seed):
    rng = random.Random(seed)
    whole = _random_model(rng)
    reduced = reduce_model(copy.deepcopy(whole))
    assert set(reduced.costs) <= set(whole.costs)
    memories = sorted({_memory(whole, dict(zip(whole.costs, combo)))
                       for combo in itertools.product(*(range(len(c)) for c in whole.costs.values()))})
    for cap in (None, memories[0], memories[len(memories) // 2]):
        expected = _best(whole, cap)
        got = _best(reduced, cap)
        assert (expected is None) == (got is None)
        if expected is None:
            continue
        assert got[0] == expected[0], (seed, cap)
        choice = expand(reduced, got[1])
        assert _objective(whole, choice) == expected[0]
        assert cap is None or _memory(whole, choice) <= cap


def test_the_random_models_do_get_reduced():
    removed = [len(reduce_model(_random_model(random.Random(seed))).removed) for seed in range(300)]
    assert sum(1 for count in removed if count) > 200 and max(removed) >= 3


def test_a_chain_of_views_collapses_into_one_edge():
    # u -> v -> w, v a view that follows its input: v leaves the model, u -> w stays, and the
    # merged edge charges what the two edges and v would have.
    same = {(p, q): 0 if p == q else 10 for p in "ab" for q in "ab"}
    data = IlpData(
        costs={"u": [0, 1], "v": [1, 1], "w": [0, 0]},
        memory_kb={"u": [5, 3], "v": [0, 0], "w": [2, 2]},
        edges=[Edge("u", "v", "u->v", ["a", "b"], ["a", "b"], same), Edge("v", "w", "v->w", ["a", "b"], ["a", "b"], same)],
        pinned={"u"},
    )
    reduce_model(data)
    assert set(data.costs) == {"u"}  # w became a leaf once v was gone, and was folded into u
    assert data.costs["u"] == [1, 1 + 1]  # v's cost 1 on either; w reads what v writes for free
    assert expand(data, {"u": 1}) == {"u": 1, "w": 1, "v": 1}
