"""The ``layer-separation`` family (Stanza): where a CNN is cut, its section, its price, the
search choosing it on slow networks only, and its program matching one device.

The parity tests run ``launch.py --check`` on 4 gloo processes for a tiny VGG, split 3 + 1
and 2 + 2 (one launch each).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import planner
from cost_model.collectives import collective_time
from cost_model.simulator import Simulator
from planner.errors import PlanFileError
from planner.families.layer_separation.candidates import head_rank_counts
from planner.families.layer_separation.costs import activation_send_seconds
from planner.families.layer_separation.section import LayerSeparationSection
from planner.families.layer_separation.trunk import find_trunk
from planner.model_spec import ModelSpec
from planner.report import render_report
from torchrun_run import torchrun

REPO = Path(__file__).resolve().parents[1]
VGG = str(REPO / "examples/vgg.py")
# width 2: channels 2, 4, 8, 16, 16; 32 pixels -> 1 x 1 after five poolings; head 16 -> 16 -> 16 -> 10.
TINY = ModelSpec(VGG, {"width": 2, "hidden": 16, "image_size": 32, "batch_size": 12, "num_classes": 10})
TEN_GIGABIT = str(REPO / "examples/clusters/ethernet-10g.toml")
ONLY = {"families": ["layer-separation"]}


@pytest.fixture(scope="module")
def split_plan() -> planner.Plan:
    """The tiny VGG on 4 CPU processes, ``--family layer-separation``."""
    return planner.plan(TINY, "cpu:1x4", constraints=ONLY, precision="fp32")


# ------------------------------------------------------------------------------ the cut


def test_the_trunk_is_the_module_of_every_convolution(split_plan) -> None:
    trunk = find_trunk(split_plan.graph)
    assert trunk.path == "features"
    # The cut: 16 channels x 1 x 1 pixels of fp32 per sample = 64 bytes.
    assert trunk.cut_bytes_per_sample == 16 * 1 * 1 * 4
    mlp = planner.plan(ModelSpec(str(REPO / "examples/mlp.py"), {}), "cpu:1x2", precision="fp32", search="dp")
    assert find_trunk(mlp.graph) is None  # no convolution: no layer separation


def test_the_splits_leave_every_head_rank_the_same_trunk_ranks() -> None:
    # 8 ranks, batch 168: 7 + 1, 6 + 2, 4 + 4 (5 + 3 leaves 5 trunk ranks for 3 heads).
    assert head_rank_counts(8, 168) == [1, 2, 4]
    assert head_rank_counts(4, 12) == [1, 2]
    assert head_rank_counts(4, 8) == [2]  # 8 samples do not split over 3 trunk ranks


# ------------------------------------------------------------------------------ the section


def test_the_section_round_trips_and_refuses_bad_input_in_one_line(split_plan, tmp_path) -> None:
    saved = tmp_path / "s.json"
    split_plan.save(saved)
    loaded = planner.load_plan(saved)
    assert loaded.sections["layer-separation"] == split_plan.sections["layer-separation"]
    for data, why in (([], "must be a JSON object"), ({"trunk": "features"}, "head_ranks' is missing"),
                      ({"trunk": "features", "head_ranks": 1, "x": 2}, "unknown key 'x'"),
                      ({"trunk": "a; import os", "head_ranks": 1}, "must be a module path"),
                      ({"trunk": "features", "head_ranks": 0}, "must be a positive integer")):
        with pytest.raises(PlanFileError) as error:
            LayerSeparationSection.from_json(data, "plan file 's.json'")
        assert why in str(error.value) and len(str(error.value).splitlines()) == 1, str(error.value)
    with pytest.raises(ValueError, match="leaving 1 trunk ranks, which is not a multiple of 3"):
        dataclasses.replace(split_plan, sections={"layer-separation": LayerSeparationSection("features", 3)})
    with pytest.raises(ValueError, match="'nothing', which holds no parameter of the model"):
        dataclasses.replace(split_plan, sections={"layer-separation": LayerSeparationSection("nothing", 1)})


# ------------------------------------------------------------------------------ the price


def test_the_sends_and_the_trunk_reduction_worked_by_hand(split_plan) -> None:
    assert split_plan.sections["layer-separation"] == LayerSeparationSection("features", 1)
    cluster = split_plan.cluster
    # The head rank receives all 12 samples (H = 1) x 64 bytes over the cpu preset's
    # intra-node link (2e9 B/s, 50 us): 768 / 2e9 + 50e-6 s.
    assert activation_send_seconds(cluster, 3, 1, 12, 64) == pytest.approx(768 / 2e9 + 50e-6)
    # The trunk's gradients (fp32) all-reduced over ranks 0-2 in one bucket (under 1 MiB);
    # one head rank: its gradients are never reduced.
    trunk = sum(meta.numel for name, meta in split_plan.graph.parameters.items() if name.startswith("features."))
    events = {event.name: event.duration_s for event in Simulator(split_plan, split_plan.graph).run().timeline
              if event.name.startswith("all-reduce")}
    assert [name for name in events if "trunk" in name] and not [name for name in events if "head" in name]
    assert sum(value for name, value in events.items() if "trunk" in name) == pytest.approx(
        collective_time("all_reduce", trunk * 4, cluster, [0, 1, 2]), rel=1e-12)


def test_the_search_chooses_it_on_10_gigabit_ethernet_and_says_why() -> None:
    # Among the exact (uncompressed) families layer separation wins on 10 Gb/s; with every
    # family, lossy compression wins, and says it beat the layer-separated plan (at the
    # example's default batch, 8, whose only split of 8 ranks is 4 + 4).
    every = planner.plan(ModelSpec(VGG, {}), TEN_GIGABIT)
    assert set(every.sections) & {"powersgd", "top-k"}, every.name
    assert "best uncompressed ddp (dp=8; layer separation: 4 trunk + 4 head)" in " ".join(every.search_summary.split())
    every_report = " ".join(render_report(every).split())
    assert f"Why: gradient compression pays: best compressed {every.name} " in every_report
    # Stanza's split, 7 trunk ranks for 1 head rank, needs a batch that 7 divides.
    exact = ["ddp", "zero1", "zero2", "fsdp", "layer-separation"]
    chosen = planner.plan(ModelSpec(VGG, {"batch_size": 168}), TEN_GIGABIT, constraints={"families": exact})
    assert chosen.sections["layer-separation"] == LayerSeparationSection("features", 1)
    best_other = min(a.step_time_s for a in chosen.runners_up if "layer separation" not in a.name)
    assert chosen.estimate.step_time_s < best_other
    report = render_report(chosen)
    words = " ".join(report.split())
    assert "Predicted gain over the best plan without it" in words
    assert "batch global 168, 24 per trunk rank, 168 per head rank" in words


def test_the_search_does_not_choose_it_on_nvlink() -> None:
    # VGG-16 on one DGX A100 (NVLink, 8 GPUs): DDP's all-reduce is cheap, and 1/8 of the
    # convolutions per rank beats 1/7.
    chosen = planner.plan(ModelSpec(VGG, {}), "dgx-a100-80g:1")
    assert "layer-separation" not in chosen.sections


# ------------------------------------------------------------------------------ the program


@pytest.mark.distributed
@pytest.mark.parametrize("heads", [1, 2])
def test_the_program_matches_one_device(split_plan, heads, tmp_path) -> None:
    plan = dataclasses.replace(split_plan, sections={"layer-separation": LayerSeparationSection("features", heads)})
    folder = planner.compile(plan, tmp_path / "out")
    source = (folder / "model_spmd.py").read_text()
    assert f"TRUNK = 'features'\nTRUNK_RANKS = {4 - heads}\nHEAD_RANKS = {heads}\n" in source
    assert "parity ok" in torchrun(4, str(folder / "launch.py"), "--check")


@pytest.mark.distributed
def test_checkpoints_are_refused_in_one_line(split_plan, tmp_path) -> None:
    # Refused before the process group starts, so one process shows it.
    folder = planner.compile(split_plan, tmp_path / "out")
    output = torchrun(1, str(folder / "launch.py"), "--steps", "1", "--checkpoint-dir", str(tmp_path / "c"), fails=True)
    assert "error: checkpoints are not written yet for layer separation: a trunk rank holds a stale copy" in output
    assert not (tmp_path / "c").exists()
