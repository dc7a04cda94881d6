"""Column (d) of ``benchmarks/against_megatron.py``: the hand-written configurations it
simulates, checked on a case worked by hand."""

from __future__ import annotations

from benchmarks.against_megatron import hand_written_configurations


def test_the_hand_written_configurations_on_a_small_cluster_worked_by_hand():
    # 6 blocks, 4 nodes of 4 devices, a batch of 8: tp = 4, pp in (1, 2, 4).
    found = hand_written_configurations(blocks=6, world=16, per_node=4, batch=8)
    assert all(c["tp"] == 4 and c["sequence_parallel"] for c in found)
    by_pp = {pp: [c for c in found if c["pp"] == pp] for pp in (1, 2, 4)}
    assert sum(map(len, by_pp.values())) == len(found)
    # pp = 1: dp = 4, the local batch of 2 at once (accumulation is tried later); 2 flavours x
    # 3 recomputations.
    assert len(by_pp[1]) == 6 and {c["micro_batch"] for c in by_pp[1]} == {2}
    # pp = 2: dp = 2, 4 samples per rank in micro-batches of 1 or 2 (4 or 2 micro-batches, both
    # a multiple of pp, so interleaving applies), 1F1B or 2 virtual stages (4 would need 8
    # blocks): 2 x 2 x 2 x 3 = 24. Four virtual stages of 6 blocks: the end ones a block short.
    assert len(by_pp[2]) == 24
    assert {(c["schedule"], c["virtual_stages"]) for c in by_pp[2]} == {("1f1b", 1), ("interleaved", 2)}
    assert {c["layers_per_stage"] and tuple(c["layers_per_stage"]) for c in by_pp[2] if c["schedule"] == "interleaved"} == {
        (1, 2, 2, 1)
    }
    assert all(c["layers_per_stage"] is None for c in by_pp[2] if c["schedule"] == "1f1b")  # 3 blocks a stage
    # pp = 4: dp = 1 (no flavour to choose), 8 micro-batches of 1 or 4 of 2, 1F1B only (two
    # virtual stages would need 8 blocks): 2 x 3 = 6, the blocks split (1, 2, 2, 1).
    assert len(by_pp[4]) == 6 and {c["dp_flavour"] for c in by_pp[4]} == {"zero1"}
    assert {tuple(c["layers_per_stage"]) for c in by_pp[4]} == {(1, 2, 2, 1)}
    # A batch that the data-parallel degree does not divide leaves that depth out.
    assert {c["pp"] for c in hand_written_configurations(blocks=6, world=16, per_node=4, batch=2)} == {2, 4}
