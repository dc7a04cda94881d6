"""ACCPAR's own setting (``examples/clusters/accpar-tpu.toml``, row (i) of
``benchmarks/heterogeneous.py``) and what planning VGG on it found, without processes:

- the cluster file loads as 64 TPU-v2 and 64 TPU-v3 chips (2^7 = 128, the public code's 7
  levels of binary partitioning) with the figures it cites: bf16 46 and 123 TFLOP/s, float32
  a sixth of those (six bf16 passes), 16 and 32 GiB at 700 and 900 GB/s, ICI links of 496
  and 656 Gbit/s = 62e9 and 82e9 B/s per direction, the slower one between boards;
- VGG's classifier (Linear -> ReLU -> Linear -> ReLU -> Linear) has two fusable groups that
  share their middle layer. Fusing the second group alone (classifier.3 column, classifier.5
  row) is a valid section, and only the ReLU inside that group runs split: before, the check
  rejected it as "part of the group classifier.1 -> classifier.3" and the pricing split the
  first group's ReLU too, so ``uneven_tp_plan`` failed on VGG at 128 ranks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planner.api import prepare_model
from planner.cluster import Cluster
from planner.device_groups import device_groups
from planner.families.uneven_tp.candidates import replicated_plan
from planner.families.uneven_tp.costs import split_ops
from planner.families.uneven_tp.regions import fusable_groups
from planner.families.uneven_tp.section import LayerSplit, UnevenTpSection
from planner.model_spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
ACCPAR_TPU = REPO / "examples/clusters/accpar-tpu.toml"
MIXED = REPO / "examples/clusters/mixed.toml"


def test_accpar_cluster_states_the_cited_figures() -> None:
    cluster = Cluster.load(ACCPAR_TPU)
    groups = {group.device.name: group for group in device_groups(cluster)}
    assert cluster.world_size == 2**7 and sorted(groups) == ["TPU-v2", "TPU-v3"]
    v2, v3 = groups["TPU-v2"], groups["TPU-v3"]
    assert len(v2.ranks) == len(v3.ranks) == 64
    assert v2.peak_flops("bfloat16") == 46e12 and v3.peak_flops("bfloat16") == 123e12
    # float32 on the MXU: six bf16 passes.
    assert v2.device.peak_flops["float32"] == pytest.approx(46e12 / 6, rel=1e-3)
    assert v3.device.peak_flops["float32"] == pytest.approx(123e12 / 6, rel=1e-3)
    assert v2.device.memory_bytes == 16 * 2**30 and v3.device.memory_bytes == 32 * 2**30
    assert (v2.device.memory_bandwidth, v3.device.memory_bandwidth) == (700e9, 900e9)
    links = {node.device.name: node.intra_link.bandwidth for node in cluster.nodes}
    assert links == {"TPU-v2": 496e9 / 8, "TPU-v3": 656e9 / 8}
    assert cluster.inter_link.bandwidth == 496e9 / 8


def test_vgg_classifier_fuses_its_second_group_alone() -> None:
    spec = ModelSpec(str(REPO / "examples/vgg.py"),
                     {"width": 2, "hidden": 32, "image_size": 32, "batch_size": 4, "num_classes": 8})
    graph, spec, name, cluster = prepare_model(spec, Cluster.load(MIXED))
    groups = fusable_groups(graph)
    assert [group.modules for group in groups] == [("classifier.1", "classifier.3"),
                                                   ("classifier.3", "classifier.5")]
    base = replicated_plan(graph, cluster, spec, name, "fp32")
    shares = (12, 12, 4, 4)  # of classifier.3's 32 output features
    section = UnevenTpSection((LayerSplit("classifier.1", "row", (6, 6, 2, 2)),  # of its 16 inputs
                               LayerSplit("classifier.3", "column", shares, fused=True),
                               LayerSplit("classifier.5", "row", shares, fused=True)))
    plan = dataclasses.replace(base, sections={"uneven-tp": section})  # the section's check passes
    assert split_ops(graph, plan.sections["uneven-tp"]) == {name: (shares, 32) for name in groups[1].between}
    assert set(groups[0].between).isdisjoint(split_ops(graph, section))
    with pytest.raises(ValueError, match="fuses part of the group classifier.1 -> classifier.3"):
        dataclasses.replace(base, sections={"uneven-tp": UnevenTpSection(
            (LayerSplit("classifier.1", "column", shares, fused=True),
             LayerSplit("classifier.3", "column", shares, fused=True),
             LayerSplit("classifier.5", "row", shares, fused=True)))})
