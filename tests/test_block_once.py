"""Programs that write each repeated block once (``codegen.block_fold``) train like one device.

Graph and pipeline programs write a block alike to another as one function called per layer
with the layer's parameter prefix. One torchrun launch (world 2) checks, against one device
(outputs, loss, every gradient, every updated parameter):

- a 4-layer GPT under Megatron tensor parallelism: one function, four calls;
- a 3-layer tiny HuggingFace Llama under Megatron with sequence parallelism and full
  recomputation: its first layer reduce-scatters the embedding's partial sums, which the
  program does before calling the block function, so all three layers share it, each called
  under ``checkpoint``;
- a 5-layer GPT whose plan differs between layers: Megatron layout on blocks 0-1, random
  placements on block 2, the batch split over ``tp`` (weights replicated) on blocks 3-4.
  Blocks 0-1 share one function, 3-4 another; block 2, alike to no other, is written out;
- a 4-layer GPT in a two-stage pipeline: both stages call the one function.
"""

from __future__ import annotations

import dataclasses
import random
import re
import runpy
from pathlib import Path

import pytest

import planner
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.layouts import batch_input_placements, combine
from search.megatron import megatron_plan
from search.propagation import propagate
from launch_groups import register_group
from test_parity import REPO, result_of
from test_spmd_parity import RANDOM_SEED, random_placements

pytestmark = pytest.mark.distributed

WORLD = 2
TINY_LLAMA = {
    "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "batch_size": 4, "seq_len": 16,
}


def _gpt(layers: int):
    return prepare_model(ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8, "n_layer": layers}), f"cpu:1x{WORLD}")


def mixed_plan() -> planner.Plan:
    """GPT, 5 blocks: Megatron's placements on blocks 0-1 and outside the blocks, random ones
    on block 2, the batch split over tp on blocks 3-4 (every weight whole)."""
    graph, spec, name, cluster = _gpt(5)
    plan = megatron_plan(graph, cluster, spec, name, tp=WORLD, precision="fp32")
    batch, _ = combine(graph, plan.mesh, {"tp": propagate(graph, WORLD, batch_input_placements(graph), {})})
    drawn = random_placements(plan, graph, random.Random(RANDOM_SEED)).strategies
    by_block = {2: {s.node: s for s in drawn}, 3: {s.node: s for s in batch}, 4: {s.node: s for s in batch}}
    strategies = tuple(by_block.get((graph.node(s.node).block or ("", -1))[1], {}).get(s.node, s) for s in plan.strategies)
    return dataclasses.replace(plan, strategies=strategies)


def plans() -> dict[str, planner.Plan]:
    graph, spec, name, cluster = _gpt(4)
    gpt4 = megatron_plan(graph, cluster, spec, name, tp=WORLD, precision="fp32")
    pipeline = megatron_plan(graph, cluster, spec, name, pp=WORLD, micro_batch=2, precision="fp32")
    graph, spec, name, cluster = prepare_model(ModelSpec("hf:llama", TINY_LLAMA), f"cpu:1x{WORLD}")
    llama = megatron_plan(graph, cluster, spec, name, tp=WORLD, sequence_parallel=True, precision="fp32")
    return {
        "gpt4": gpt4,
        "llama3-recompute": dataclasses.replace(llama, recompute="full"),
        "gpt5-mixed": mixed_plan(),
        "gpt4-pipeline": pipeline,
    }


def _programs(root, world):
    folders = {case: planner.compile(plan, root / case) for case, plan in plans().items()}
    return folders, list(folders.values())


PROGRAMS = register_group(WORLD, _programs)  # checked in the session's launch (launch_groups.py)


@pytest.fixture(scope="module")
def compiled(parity_launches):
    return parity_launches.result(PROGRAMS)


def _source(folder: Path) -> str:
    return (folder / "model_spmd.py").read_text()


def _calls(source: str) -> dict[str, list[str]]:
    """Block function -> the prefixes it is called with, in order."""
    found: dict[str, list[str]] = {}
    for function, prefix in re.findall(r"(?:= |checkpoint\()(\w+_block\w*)(?:\(self|, self), '([\w.]+)'", source):
        found.setdefault(function, []).append(prefix)
    return found


@pytest.mark.parametrize("case", ["gpt4", "llama3-recompute", "gpt5-mixed", "gpt4-pipeline"])
def test_block_once_program_equals_single_device(compiled, case: str) -> None:
    folders, launch = compiled
    assert result_of(launch, folders[case]).startswith("ok "), result_of(launch, folders[case])


def test_alike_blocks_share_one_function(compiled) -> None:
    folders, _ = compiled
    gpt4 = _source(folders["gpt4"])
    assert _calls(gpt4) == {"blocks_block": ["blocks.0.", "blocks.1.", "blocks.2.", "blocks.3."]}
    assert gpt4.count("def blocks_block(") == 1 and "params['blocks.2.attn.c_attn.weight']" not in gpt4
    # PARAMETERS writes the four blocks' placements once too (codegen.repeated_tables), and
    # still names every parameter of the model with the plan's placements.
    assert "for index in range(0, 4)" in gpt4 and "'blocks.2.attn.c_attn.weight'" not in gpt4
    table = runpy.run_path(str(folders["gpt4"] / "model_spmd.py"))["PARAMETERS"]
    assert set(table) == set(_gpt(4)[0].parameters) and len(table) == 2 + 4 * 12 + 3
    assert str(table["blocks.3.mlp.c_fc.weight"]) == "(Shard(dim=0),)" and str(table["blocks.3.ln_1.weight"]) == "(Replicate(),)"
    pipeline = _source(folders["gpt4-pipeline"])
    assert _calls(pipeline) == {"blocks_block": ["blocks.0.", "blocks.1.", "blocks.2.", "blocks.3."]}
    stage0, stage1 = pipeline.split("class GPTStage1")[0], pipeline.split("class GPTStage1")[1].split("def blocks_block(")[0]
    assert stage0.count("blocks_block(self, ") == 2 and stage1.count("blocks_block(self, ") == 2


def test_first_layer_redistributes_its_input_before_the_call(compiled) -> None:
    folders, _ = compiled
    llama = _source(folders["llama3-recompute"])
    assert _calls(llama) == {"model_layers_block": ["model.layers.0.", "model.layers.1.", "model.layers.2."]}
    assert llama.count("= checkpoint(model_layers_block, self, ") == 3 and "def _model_layers_" not in llama
    before = llama.split("= checkpoint(model_layers_block, self, 'model.layers.0.'")[0]
    assert re.search(r"# reduce-scatter over tp: .*\n\s+(\w+) = _to\(\w+, TP_S1\).*\n.*\s= checkpoint\(model_layers_block, self, 'model\.layers\.0\.', \1, ", llama), before[-2000:]


def test_blocks_unlike_the_others_stay_written_out(compiled) -> None:
    folders, _ = compiled
    mixed = _source(folders["gpt5-mixed"])
    assert _calls(mixed) == {"blocks_block_0": ["blocks.0.", "blocks.1."], "blocks_block_3": ["blocks.3.", "blocks.4."]}
    assert "p_blocks_2_attn_c_attn_weight = params['blocks.2.attn.c_attn.weight']" in mixed


def test_blocks_fold_only_when_their_code_is_the_same_up_to_names() -> None:
    """On hand-written forward lines (no processes): blocks 0-1 differ only in value and
    parameter names and fold into one function; block 2 redistributes inside the block to
    another placement and stays written out; block 3 takes the same code as 0-1 but reads
    a parameter of another block, so it is not alike either."""
    from codegen.block_fold import BlockFolder

    pad = " " * 8

    def block(index: int, source: str, target: str, weight: str, extra: str = "") -> list[str]:
        return [pad + line for line in ([extra] if extra else []) + [
            f"{target}_lin = aten.linear.default({source}, {weight})  # note",
            f"{target} = aten.relu.default({target}_lin)",
        ]]

    runs = [
        (None, [pad + "x = self.input(x, TP_R, (2, 4))"]),
        (("blocks", 0), block(0, "x", "h0", "p_blocks_0_w")),
        (("blocks", 1), block(1, "h0", "h1", "p_blocks_1_w")),
        (("blocks", 2), [pad + "h1_tp_s0 = aten.relu.default(h1)"] + block(2, "h1_tp_s0", "h2", "p_blocks_2_w")),
        (("blocks", 3), block(3, "h2", "h3", "p_blocks_0_w")),
        (None, [pad + "return h3"]),
    ]
    placeholders = {f"p_blocks_{i}_w": ("param", f"blocks.{i}.w") for i in range(4)}
    prelude = {name: f"{pad}{name} = params[{qualified!r}]  # (4, 4)" for name, (_, qualified) in placeholders.items()}
    known = {"x", "h0", "h0_lin", "h1", "h1_lin", "h1_tp_s0", "h2", "h2_lin", "h3", "h3_lin", *placeholders}
    folder = BlockFolder(placeholders, prelude, known, set())
    folded = folder.fold([runs], [set()], ["none"])[0]
    body = "\n".join(line for _, lines in folded for line in lines)
    assert "h0 = blocks_block(self, 'blocks.0.', x)" in body and "h1 = blocks_block(self, 'blocks.1.', h0)" in body
    assert "h2_lin = aten.linear.default(h1_tp_s0, p_blocks_2_w)" in body  # written out
    assert "h3_lin = aten.linear.default(h2, p_blocks_0_w)" in body  # written out
    source = folder.source()
    assert "def blocks_block(self, prefix: str, x):" in source
    assert "    p_w = params[prefix + 'w']  # (4, 4)" in source and "h0_lin = aten.linear.default(x, p_w)  # note" in source
    assert source.rstrip().endswith("return h0")
    assert folder.moved == {"p_blocks_0_w", "p_blocks_1_w"}
