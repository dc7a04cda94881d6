"""The zoo: models nobody here wrote, planned by the default search, compiled, checked.

Beyond the models the other tests use (examples/*.py, hf:gpt2/llama/bert), each member of the
zoo is planned with the default search (``planner.plan``: CP-SAT then MCMC on every mesh)
on ``cpu:1x2`` or ``cpu:1x4``, compiled, and one training step of the program is checked
against one device (``launch.py --check``'s comparison). The members cover what outside
models bring:

- HuggingFace decoders (mistral, qwen2, gemma, gpt_neox, opt, falcon, phi, bloom) with
  their default batch of 2: on 4 ranks no data-parallel mesh divides it, so the search
  must place them on ``dp=2 x tp=2`` or ``tp=4`` (graph programs); Falcon indexes with a
  list (a tensor constant), OPT's dropout is a float attribute;
- encoders (roberta, distilbert, electra) and seq2seq models (t5, bart, through
  ``AutoModelForSeq2SeqLM`` with decoder inputs and labels; BART's dropout is functional, T5's
  attention has ``dropout_p``);
- image classifiers (vit, convnext, resnet, swin with stochastic depth, and clip, whose vision
  tower is sized through nested config keys ``vision_config.*``);
- tests/zoo_models.py: multi-output ops, tensor constants made in forward, functional and
  attention dropout, a ResNet with batch norm;
- a hand-made plan DTensor cannot execute as written (examples/cnn.py with convolution
  weights split over ``tp``): the compile-time dry run must catch it and the program must
  still match one device;
- Megatron-LM's layout (dp=2 x tp=2) for six members, so weights are split over tp for sure
  (on these tiny models the search often keeps every op whole on tp);
- the ResNet under DDP and FSDP (forced): batch norm must normalise over the whole batch
  (the programs synchronise its statistics over ``dp``), and a DDP program with that taken
  out must fail the check.

- ERNIE-4.5-MoE (its router's bias lives in a child module: FSDP units must not nest), and
  Megatron's tp=2 layout for RoFormer, FNet and BEiT (``TP_ONLY``), found by benchmarks/hf_sweep.py.

- HuggingFace's MobileNet-V1/V2 under ZeRO-1 and MobileNet-V2 and LeViT under Megatron's tp=2
  layout (``IN_FLOAT64``), checked in float64 (``launch.py --check --fp64``): their
  single-device fp32 step is itself 50-180x the fp32 tolerance away from the same step in
  float64, so fp32 cannot judge them; in float64 the programs match one device to 2e-10,
  and a float32 rounding left in the batch-norm synchronisation fails them (13x and 90x).

- CLIP's image classifier under DDP (forced): its pooler's output does not reach the loss, so
  those parameters get no gradient, and the program must tell DDP to look for them (without
  it, the gradients in their bucket are never averaged).

All programs of one world size are checked in ONE torchrun launch (``check_many``). The
search runs at a small effort each (``ZOO_EFFORT``: work, not seconds, so the plans are the
same on a loaded machine as on a quiet one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.tensor import Shard

import planner
from planner.api import prepare_model
from planner.errors import PlannerError
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from search.layouts import batch_input_placements, combine
from search.megatron import megatron_plan
from search.plan_builder import unsimulated_plan
from search.propagation import propagate
from test_dry_run import conv_weights_split_plan
from launch_groups import register_group
from test_parity import Launch, result_of

pytestmark = pytest.mark.distributed

ZOO_MODELS = Path(__file__).resolve().with_name("zoo_models.py")
# Search effort per member: tiny models need little, and the zoo has many members.
ZOO_EFFORT = 0.25

_TEXT = {"vocab_size": 128, "seq_len": 16}  # the hf default batch (2) unless a member sets one
_DECODER = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, **_TEXT}
_ENCODER = {**_DECODER, "max_position_embeddings": 64, "batch_size": 4}
_SEQ2SEQ = {
    "encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "max_position_embeddings": 64, "batch_size": 4, **_TEXT,
}
_IMAGES = {"batch_size": 4, "num_labels": 10}

# name -> (spec source, overrides, world size)
MEMBERS: dict[str, tuple[str, dict, int]] = {
    # decoders, batch 2: tensor-parallel meshes on 4 ranks
    "mistral": ("hf:mistral", {**_DECODER, "num_key_value_heads": 2}, 4),
    "qwen2": ("hf:qwen2", {**_DECODER, "num_key_value_heads": 2}, 4),
    "gemma": ("hf:gemma", {**_DECODER, "num_key_value_heads": 2, "head_dim": 16}, 4),
    "gpt_neox": ("hf:gpt_neox", _DECODER, 4),
    "falcon": ("hf:falcon", {**_TEXT, "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, 4),
    "opt": ("hf:opt", {**_TEXT, "num_hidden_layers": 2, "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4,
                       "word_embed_proj_dim": 64, "max_position_embeddings": 64}, 4),
    "phi": ("hf:phi", _DECODER, 2),
    "bloom": ("hf:bloom", {**_TEXT, "n_layer": 2, "hidden_size": 64, "n_head": 4}, 2),
    # encoders
    "roberta": ("hf:roberta", {**_ENCODER, "pad_token_id": 1}, 4),
    "distilbert": ("hf:distilbert", {**_TEXT, "n_layers": 2, "dim": 64, "hidden_dim": 128, "n_heads": 4,
                                     "max_position_embeddings": 64, "batch_size": 4}, 4),
    "electra": ("hf:electra", {**_ENCODER, "embedding_size": 32}, 2),
    # seq2seq
    "t5": ("hf:t5", {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16,
                     "batch_size": 4, **_TEXT}, 4),
    "bart": ("hf:bart", _SEQ2SEQ, 4),
    # image classifiers
    "vit": ("hf:vit", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": 8, **_IMAGES}, 2),
    "convnext": ("hf:convnext", {"depths": [1, 1], "hidden_sizes": [16, 32], "num_stages": 2, "image_size": 32,
                                 **_IMAGES}, 4),
    "resnet": ("hf:resnet", {"depths": [1, 1], "hidden_sizes": [16, 32], "embedding_size": 16, "image_size": 32,
                             **_IMAGES}, 4),
    "swin": ("hf:swin", {"depths": [1, 1], "num_heads": [2, 4], "embed_dim": 16, "image_size": 32, "patch_size": 4,
                         "window_size": 4, **_IMAGES}, 4),
    # a MoE decoder whose router keeps a bias in a child module: FSDP units must not nest
    "ernie4_5_moe": ("hf:ernie4_5_moe", {**_DECODER, "num_key_value_heads": 2, "moe_intermediate_size": 32,
                                         "moe_num_experts": 4, "moe_k": 2, "batch_size": 4}, 2),
    "clip": ("hf:clip", {"vision_config.hidden_size": 32, "vision_config.num_hidden_layers": 2,
                         "vision_config.num_attention_heads": 4, "vision_config.intermediate_size": 64,
                         "vision_config.image_size": 32, "vision_config.patch_size": 8, "text_config.hidden_size": 32,
                         "text_config.num_hidden_layers": 1, "text_config.num_attention_heads": 2,
                         "text_config.intermediate_size": 64, "text_config.vocab_size": 64, **_IMAGES}, 4),
    # tests/zoo_models.py
    "multi_output": (f"{ZOO_MODELS}:multi_output", {}, 4),
    "tensor_constants": (f"{ZOO_MODELS}:tensor_constants", {}, 4),
    "functional_dropout": (f"{ZOO_MODELS}:functional_dropout", {}, 2),
    "zoo_resnet": (f"{ZOO_MODELS}:resnet", {}, 4),
}
HAND_MADE = "cnn_conv_weights_split"  # world 2, from tests/test_dry_run.py
# The multi-output model with its batch split over tp (world 2), a graph program whatever the
# search picks: max.dim and min.dim give both outputs split, the ops without a rule run whole.
BATCH_SPLIT = "multi_output_batch_split"
# Megatron-LM's layout on dp=2 x tp=2 (world 4) for some members: weights split over tp for
# sure (the search, on these tiny models, often keeps every op whole on tp).
MEGATRON = ("mistral", "falcon", "opt", "t5", "bart", "vit")
# Megatron-LM's layout with tp=2 (world 2) for models whose graph programs once failed:
# RoFormer reads token values in an untraced forward (transformers' padding check), FNet adds
# positions in place (add_, which DTensor cannot run here), BEiT's drop path reads its keep
# probability at run time (0 under --check).
TP_ONLY: dict[str, tuple[str, dict]] = {
    "roformer_tp": ("hf:roformer", {**_ENCODER, "embedding_size": 64}),
    "beit_tp": ("hf:beit", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                            "image_size": 32, "patch_size": 8, "use_mask_token": False, **_IMAGES}),
    "fnet_tp": ("hf:fnet", {key: value for key, value in _ENCODER.items() if key != "num_attention_heads"}),
}
# Models whose fp32 rounding the tolerance cannot judge, checked in float64 (world 2): (model,
# overrides, "zero1" for a ZeRO-1 data-parallel plan or "tp" for Megatron's tp=2 layout). Their
# single-device fp32 step differs from the same step in float64 by 57x (MobileNet-V1), 179x
# (V2) and 51x (LeViT) the fp32 tolerance. Their last batch norms normalise over 4 values per
# channel, and most of MobileNet's channels have a batch variance below batch norm's eps (1e-3).
_MOBILENET = {"image_size": 32, "depth_multiplier": 0.25, **_IMAGES}
IN_FLOAT64: dict[str, tuple[str, dict, str]] = {
    "mobilenet_v1_zero1": ("hf:mobilenet_v1", _MOBILENET, "zero1"),
    "mobilenet_v2_zero1": ("hf:mobilenet_v2", _MOBILENET, "zero1"),
    "mobilenet_v2_tp": ("hf:mobilenet_v2", _MOBILENET, "tp"),
    "levit_tp": ("hf:levit", {"image_size": 64, "hidden_sizes": [64, 128, 192], "num_attention_heads": [4, 8, 12],
                              "depths": [1, 1, 1], "key_dim": [16, 16, 16], "mlp_ratio": [2, 2, 2],
                              "attention_ratio": [2, 2, 2], **_IMAGES}, "tp"),
}
# Data-parallel flavours forced on the ResNet (world 2): batch norm must see the whole batch.
BATCH_NORM_FLAVOURS = {"zoo_resnet_ddp": "ddp", "zoo_resnet_fsdp": "fsdp"}
# The negative control: the DDP program with its batch-norm synchronisation taken out.
UNSYNCHRONISED = "zoo_resnet_ddp_unsynchronised"
# CLIP's image classifier forced to DDP (world 4): parameters without a gradient.
CLIP_DDP = "clip_ddp"
SYNCHRONISE_LINE = "    synchronise_batch_norm(model, dp_mesh.get_group())\n"


@dataclass(frozen=True)
class ZooRun:
    """One world size's members: their plans (or one-line refusals), folders and launch."""

    world: int
    plans: dict[str, planner.Plan]
    refused: dict[str, str]
    folders: dict[str, Path]
    launch: Launch

    def result(self, name: str) -> str:
        return result_of(self.launch, self.folders[name])


def _zoo_programs(root: Path, world: int) -> tuple:
    """Plan and compile every member of ``world``, checked in the session's launch of that
    size (``tests/launch_groups.py``)."""
    plans, refused, folders = {}, {}, {}
    for name in members(world):
        source, overrides, _ = MEMBERS[name]
        try:
            plans[name] = planner.plan(ModelSpec(source, overrides), f"cpu:1x{world}", effort=ZOO_EFFORT, progress=False)
            folders[name] = planner.compile(plans[name], root / name)
        except PlannerError as error:  # a refusal, one line (checked below)
            refused[name] = str(error)
    if world == 4:
        source, overrides, _ = MEMBERS["clip"]
        plans[CLIP_DDP] = planner.plan(ModelSpec(source, overrides), "cpu:1x4", dp_flavour="ddp", progress=False)
        folders[CLIP_DDP] = planner.compile(plans[CLIP_DDP], root / CLIP_DDP)
        for name in MEGATRON:
            source, overrides, _ = MEMBERS[name]
            graph, spec, model_name, cluster = prepare_model(ModelSpec(source, {"batch_size": 4, **overrides}), "cpu:1x4")
            plans[f"{name}_megatron"] = megatron_plan(graph, cluster, spec, model_name, tp=2, precision="fp32")
            folders[f"{name}_megatron"] = planner.compile(plans[f"{name}_megatron"], root / f"{name}_megatron")
    if world == 2:
        plans[HAND_MADE] = conv_weights_split_plan(world)
        folders[HAND_MADE] = planner.compile(plans[HAND_MADE], root / HAND_MADE)
        for name, (source, overrides) in TP_ONLY.items():
            graph, spec, model_name, cluster = prepare_model(ModelSpec(source, overrides), "cpu:1x2")
            plans[name] = megatron_plan(graph, cluster, spec, model_name, tp=2, precision="fp32")
            folders[name] = planner.compile(plans[name], root / name)
        plans[BATCH_SPLIT] = batch_split_plan(ModelSpec(*MEMBERS["multi_output"][:2]), world)
        folders[BATCH_SPLIT] = planner.compile(plans[BATCH_SPLIT], root / BATCH_SPLIT)
        resnet, overrides, _ = MEMBERS["zoo_resnet"]
        for name, flavour in {**BATCH_NORM_FLAVOURS, UNSYNCHRONISED: "ddp"}.items():
            plans[name] = planner.plan(ModelSpec(resnet, overrides), "cpu:1x2", dp_flavour=flavour, progress=False)
            folders[name] = planner.compile(plans[name], root / name)
        program = folders[UNSYNCHRONISED] / "model_spmd.py"
        source = program.read_text()
        assert SYNCHRONISE_LINE in source, source
        program.write_text(source.replace(SYNCHRONISE_LINE, ""))
        for name, (source, overrides, layout) in IN_FLOAT64.items():
            plans[name] = in_float64_plan(ModelSpec(source, overrides), layout)
            folders[name] = planner.compile(plans[name], root / name)
    in_float64 = [folder for name, folder in folders.items() if name in IN_FLOAT64]
    in_fp32 = [folder for name, folder in folders.items() if name not in IN_FLOAT64]
    return (plans, refused, folders), in_fp32, in_float64


ZOO_GROUPS = {world: register_group(world, _zoo_programs) for world in (2, 4)}


def _run_zoo(world: int, parity_launches) -> ZooRun:
    (plans, refused, folders), launch = parity_launches.result(ZOO_GROUPS[world])
    return ZooRun(world, plans, refused, folders, launch)


def in_float64_plan(spec: ModelSpec, layout: str) -> planner.Plan:
    """A plan on ``cpu:1x2`` of an ``IN_FLOAT64`` member: ZeRO-1 data parallelism, or Megatron's tp=2."""
    if layout == "zero1":
        return planner.plan(spec, "cpu:1x2", search="dp", dp_flavour="zero1", progress=False)
    graph, spec, model_name, cluster = prepare_model(spec, "cpu:1x2")
    return megatron_plan(graph, cluster, spec, model_name, tp=2, precision="fp32")


def batch_split_plan(spec: ModelSpec, world: int) -> planner.Plan:
    """``spec`` with its batch split over a ``tp`` mesh of ``world`` ranks (a graph program)."""
    graph, spec, model_name, cluster = prepare_model(spec, f"cpu:1x{world}")
    mesh = Mesh((("tp", world),))
    strategies, inputs = combine(graph, mesh, {"tp": propagate(graph, world, batch_input_placements(graph), {})})
    return unsimulated_plan(graph, cluster, spec, model_name, mesh, strategies, inputs, label="soap")


def members(world: int) -> list[str]:
    return [name for name, (_, _, member_world) in MEMBERS.items() if member_world == world]


@pytest.fixture(scope="module")
def zoo2(parity_launches) -> ZooRun:
    return _run_zoo(2, parity_launches)


@pytest.fixture(scope="module")
def zoo4(parity_launches) -> ZooRun:
    return _run_zoo(4, parity_launches)


CASES = [(world, name) for world in (2, 4) for name in members(world)]


@pytest.mark.parametrize(("world", "name"), CASES, ids=[f"{name}-world{world}" for world, name in CASES])
def test_member_plans_compiles_and_trains_like_one_device(request, world, name):
    zoo: ZooRun = request.getfixturevalue(f"zoo{world}")
    assert name not in zoo.refused, f"{name} was refused: {zoo.refused[name]}"
    result = zoo.result(name)
    assert result.startswith("ok parity ok: "), f"{name} ({zoo.plans[name].name}) at world size {world}: {result}"


@pytest.mark.parametrize("world", (2, 4))
def test_every_refusal_is_one_line(request, world):
    zoo: ZooRun = request.getfixturevalue(f"zoo{world}")
    for name, message in zoo.refused.items():
        assert "\n" not in message and message, f"{name}: {message!r}"


def test_a_convolution_dtensor_gets_wrong_still_trains_like_one_device(zoo2):
    assert zoo2.result(HAND_MADE).startswith("ok parity ok: "), zoo2.result(HAND_MADE)


@pytest.mark.parametrize("name", sorted(BATCH_NORM_FLAVOURS))
def test_data_parallel_batch_norm_trains_like_one_device(zoo2, name):
    assert "synchronise_batch_norm(model" in (zoo2.folders[name] / "model_spmd.py").read_text()
    assert zoo2.result(name).startswith("ok parity ok: "), zoo2.result(name)


def test_batch_norm_left_per_rank_is_caught(zoo2):
    """Without the synchronisation each rank normalises its half of the batch alone."""
    result = zoo2.result(UNSYNCHRONISED)
    assert result.startswith("FAILED parity FAILED: worst tensor "), result


@pytest.mark.parametrize("name", sorted(IN_FLOAT64))
def test_batch_norm_models_train_like_one_device_in_float64(zoo2, name):
    source = (zoo2.folders[name] / "model_spmd.py").read_text()
    if IN_FLOAT64[name][2] == "zero1":
        assert "ShardedStatesOptimizer(" in source and "synchronise_batch_norm(model" in source, source
    else:
        assert "(SpmdModule)" in source and _splits_weights(zoo2.plans[name]), zoo2.plans[name].name
    result = zoo2.result(name)
    assert result.startswith("ok parity ok: ") and "compared in float64" in result, f"{name}: {result}"


def _splits_weights(plan: planner.Plan) -> bool:
    return any(isinstance(p, Shard) for s in plan.strategies for ps in s.params.values() for p in ps)


def test_multi_output_ops_with_split_outputs_train_like_one_device(zoo2):
    source = (zoo2.folders[BATCH_SPLIT] / "model_spmd.py").read_text()
    # max.dim's indices stay split like its values (one placement per output).
    assert re.search(r"= max_[0-9a-f]{6}\[1\]  # \(8, 1\) -> \(4, 1\) per rank: S\(0\) on tp \(int64\)", source), source
    assert zoo2.result(BATCH_SPLIT).startswith("ok parity ok: "), zoo2.result(BATCH_SPLIT)


RANDOMNESS = {
    "functional_dropout": "switched off randomness: 1 nn.Dropout module, 1 functional dropout call, "
                          "attention dropout_p in 1 SDPA call",
    "bart": r"switched off randomness: \d+ functional dropout calls",
    "opt": r"switched off randomness: \d+ functional dropout calls",
    "t5": r"switched off randomness: \d+ nn.Dropout modules, attention dropout_p in \d+ SDPA calls",
    "swin": r"switched off randomness: 1 drop-path module",
}


@pytest.mark.parametrize("name", sorted(RANDOMNESS))
def test_check_says_which_randomness_it_switched_off(request, name):
    zoo: ZooRun = request.getfixturevalue(f"zoo{MEMBERS[name][2]}")
    assert re.search(RANDOMNESS[name], zoo.result(name)), f"{name}: {zoo.result(name)}"


def test_the_decoders_on_four_ranks_are_tensor_parallel_graph_programs(zoo4):
    """With a batch of 2 on 4 ranks the search cannot pick data parallelism alone: the
    decoders' searched plans are on a mesh with tp and compile to graph programs."""
    decoders = [name for name in ("mistral", "qwen2", "gemma", "gpt_neox", "falcon", "opt") if name in zoo4.plans]
    assert decoders, zoo4.refused
    for name in decoders:
        assert "tp" in zoo4.plans[name].mesh.names, f"{name}: {zoo4.plans[name].name}"
        assert "(SpmdModule)" in (zoo4.folders[name] / "model_spmd.py").read_text(), name


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_layouts_split_weights_and_train_like_one_device(zoo4, name):
    plan = zoo4.plans[f"{name}_megatron"]
    split = [p for s in plan.strategies for placements in s.params.values() for p in placements if isinstance(p, Shard)]
    assert split, f"{name}: Megatron's layout splits no weight"
    result = zoo4.result(f"{name}_megatron")
    assert result.startswith("ok parity ok: "), f"{name} ({plan.name}): {result}"


@pytest.mark.parametrize("name", sorted(TP_ONLY))
def test_tensor_parallel_graph_programs_of_outside_models_train_like_one_device(zoo2, name):
    assert "(SpmdModule)" in (zoo2.folders[name] / "model_spmd.py").read_text(), name
    assert zoo2.result(name).startswith("ok parity ok: "), f"{name}: {zoo2.result(name)}"


def test_falcon_writes_its_index_constants_into_the_program(zoo4):
    source = (zoo4.folders["falcon"] / "model_spmd.py").read_text()
    assert len(re.findall(r"c_\w*lifted_tensor_\d+ = torch\.tensor\(\[-?\d+\], dtype=torch\.int64", source)) == 4, source


def test_ddp_finds_the_parameters_that_get_no_gradient(zoo4):
    source = (zoo4.folders[CLIP_DDP] / "model_spmd.py").read_text()
    assert "find_unused_parameters=True," in source and "vision_model.post_layernorm.weight" in source, source
    assert zoo4.result(CLIP_DDP).startswith("ok parity ok: "), zoo4.result(CLIP_DDP)
