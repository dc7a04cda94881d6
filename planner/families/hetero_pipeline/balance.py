"""Blocks cut into pipeline stages that run on different devices (vocabulary layer: pure
arithmetic), as Metis (Um et al., ATC'24, section 4) balances layers over device groups of
different types.

Stage ``s`` runs on its own device, so block ``k`` costs ``block_s[s][k]`` seconds per
micro-batch there: a fast stage does the same block sooner, and a balanced split gives it
more blocks. The ops before the first block run on stage 0 (``head_s``), those after the
last on the last stage (``tail_s``). Every stage takes at least one block, consecutive, in
model order. The split minimises the slowest stage (the 1F1B steady state's period)::

    best[s][j] = min over i < j of max(best[s-1][i], head(s) + sum_k=i..j-1 block_s[s][k] + tail(s))
                 where fits(s, i, j)
    best[-1][0] = 0;  answer best[S-1][K], cuts recovered from the argmins

It is exact: a stage's time depends only on its own blocks and device, so the best split of
the first ``j`` blocks over the first ``s + 1`` stages extends a best split of the first
``i`` over ``s`` (``tests/test_hetero_pipeline.py`` checks it against every split).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["balanced_stages", "stage_seconds"]


def stage_seconds(block_s: Sequence[Sequence[float]], head_s: float, tail_s: float,
                  counts: Sequence[int]) -> tuple[float, ...]:
    """Each stage's seconds per micro-batch when stage ``s`` holds ``counts[s]`` blocks."""
    seconds, start, last = [], 0, len(counts) - 1
    for stage, count in enumerate(counts):
        total = sum(block_s[stage][start:start + count]) + (head_s if stage == 0 else 0.0)
        seconds.append(total + (tail_s if stage == last else 0.0))
        start += count
    return tuple(seconds)


def balanced_stages(block_s: Sequence[Sequence[float]], head_s: float, tail_s: float,
                    fits: Callable[[int, int, int], bool] | None = None) -> tuple[tuple[int, ...], float] | None:
    """``(blocks per stage, slowest stage's seconds)`` minimising the slowest stage (module
    docstring), or None when no split fits or there are fewer blocks than stages.

    Args:
        block_s: ``block_s[s][k]``, block ``k``'s seconds per micro-batch on stage ``s``'s device.
        head_s, tail_s: seconds of the ops before the first block (stage 0's) and after the
            last (the last stage's), each on its stage's device.
        fits: ``fits(s, i, j)``: whether blocks ``i..j-1`` fit in stage ``s``'s memory
            (None: every split fits).
    """
    stages = len(block_s)
    blocks = len(block_s[0]) if stages else 0
    if stages == 0 or blocks < stages or any(len(row) != blocks for row in block_s):
        return None
    prefix = [[0.0] for _ in range(stages)]
    for stage in range(stages):
        for seconds in block_s[stage]:
            prefix[stage].append(prefix[stage][-1] + seconds)
    infinity = float("inf")
    # best[s][j]: the slowest of stages 0..s holding blocks 0..j-1; cut[s][j]: stage s's first block.
    best = [[infinity] * (blocks + 1) for _ in range(stages)]
    cut = [[-1] * (blocks + 1) for _ in range(stages)]
    for stage in range(stages):
        extra = (head_s if stage == 0 else 0.0) + (tail_s if stage == stages - 1 else 0.0)
        # Stage s holds blocks i..j-1 with s <= i (one block per earlier stage) and j <= K - (S-1-s).
        for end in range(stage + 1, blocks - (stages - 1 - stage) + 1):
            starts = [0] if stage == 0 else range(stage, end)
            for start in starts:
                before = 0.0 if stage == 0 else best[stage - 1][start]
                if before == infinity or (fits is not None and not fits(stage, start, end)):
                    continue
                slowest = max(before, prefix[stage][end] - prefix[stage][start] + extra)
                if slowest < best[stage][end]:  # strict: ties keep the earliest cut
                    best[stage][end], cut[stage][end] = slowest, start
    if best[stages - 1][blocks] == infinity:
        return None
    counts, end = [], blocks
    for stage in range(stages - 1, -1, -1):
        start = cut[stage][end]
        counts.append(end - start)
        end = start
    return tuple(reversed(counts)), best[stages - 1][blocks]
