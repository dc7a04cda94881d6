"""What a compiled program says it does is what it does.

``model_spmd.py`` is written to be reviewed: its comments and docstrings name the wrapper
(DDP, FSDP2's ``fully_shard``, ZeRO-1's optimizer) and the collectives (all-reduce,
all-gather, reduce-scatter, all-to-all, broadcast) that each part runs. A reviewer trusts
those words, so a comment naming a wrapper or a collective that the code never calls is a
wrong program description (the MoE program once said "DDP averages their gradients" of a
model wrapped in ``fully_shard``). The program's header names its plan exactly as
``Plan.name`` does (a sequence-parallel Megatron plan once lost "sequence parallel" there).

One plan of each family is compiled (no process is started: only the source is written):
data parallel (ddp, zero1, zero2, fsdp), Megatron tensor parallelism with ZeRO-1 on dp and
with sequence parallelism (graph programs), a pipeline, SUMMA, MoE layers in each mode, and HSDP.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize

import pytest

from codegen.emit import render_model_spmd
from moe_plans import moe_plan
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.data_parallel import data_parallel_plan
from planner.families.gradient_compression.section import HalfReduceSection, PowerSgdSection, TopKSection
from planner.families.hsdp.section import HsdpSection
from planner.families.uneven_tp.candidates import uneven_tp_plan
from planner.strategy import Mesh
from search.megatron import megatron_plan
from search.moe_folding import folded_plan
from summa_plans import GPT, GPT_SMALL, summa_plan
from test_parity import REPO

WORLD = 4
FAMILIES = (
    "ddp", "zero1", "zero2", "fsdp", "megatron dp x tp, zero1", "megatron tp, sequence parallel", "pipeline pp x dp",
    "summa 2d", "moe expert parallel, ddp", "moe replicated experts, fsdp", "moe sliced experts, zero1",
    "moe copied experts, zero2", "hsdp 2 x 2", "moe folded dp x tp, EP2 x EDP2", "moe folded dp x tp, EP2 x ETP2",
    "powersgd", "top-k", "half-reduce", "uneven-tp",
)
GPT_SPEC = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8, "n_layer": 2})

# A word in a comment -> the names in the program's code (called, imported or read) that
# do what the word says. A word is backed when the program uses one of its names:
# - the wrappers by their own class or function;
# - a collective by every wrapper or runtime piece that runs it: DDP all-reduces gradients
#   and broadcasts the initial weights; FSDP2 (also through ``shard_over_copies``, which
#   applies it to copied experts) all-gathers weights and reduce-scatters gradients;
#   ``_to`` redistributes a DTensor (all-gather, reduce-scatter or all-reduce, as the plan's
#   placements say) and ``SpmdModule``'s gradient hooks reduce partial gradients; the MoE
#   layers exchange tokens all-to-all and all-gather the per-expert counts; SUMMA's linears
#   broadcast blocks (2-D, 2.5-D) or gather and reduce-scatter them (3-D); ZeRO-1's
#   optimizer (``ShardedStatesOptimizer``) all-gathers the updated weights; synchronised batch norm all-reduces
#   its statistics; FSDP2 on HSDP's 2-D mesh (``hybrid_mesh``) all-reduces the gradient shards
#   across its replicate groups; a compressed program's hook (``register_compression``) runs
#   its all-reduces (PowerSGD's factors, 16-bit buckets) or top-k's all-gather inside DDP.
# Patterns of acronyms match case-sensitively (``\bDDP\b``), collectives in any case.
_DDP = "DistributedDataParallel"
_FSDP = ("fully_shard", "shard_over_copies")
_MOE = ("ExpertParallelMoE", "DataParallelMoE", "ExpertSlicedMoE", "ExpertParallelExperts", "TwoLevelExchange",
        "FoldedExpertParallelMoE")
# Folded MoE programs' tensor-parallel layers (codegen.runtime.tensor_parallel_layers): row-parallel
# linears, heads and the vocabulary-parallel embedding all-reduce; FoldedMoE all-gathers its
# tokens' outputs over tp and all-reduces the router's gradient there; ETP's sliced experts
# gather their buffers and reduce-scatter the partial outputs.
_FOLDED_TP = ("HeadParallelSelfAttention", "RowParallelLinear", "VocabParallelEmbedding", "ColumnParallelLinear",
              "FoldedMoE")
_GRAPH = ("_to", "SpmdModule")
_SUMMA = ("summa_linear",)
# Uneven tensor parallelism's linears (planner.families.uneven_tp.runtime.split_linears):
# all-gather-v of the uneven slices (one all_to_all_single with uneven split sizes) and
# all-reduces of partial sums and gradients.
_UNEVEN_TP = ("split_linears",)
BACKING: dict[str, tuple[str, ...]] = {
    r"\bDDP\b|DistributedDataParallel": (_DDP,),
    r"fully_shard|\bFSDP2?\b": _FSDP,
    r"\bZeRO-1\b": ("ShardedStatesOptimizer",),
    r"(?i:all-reduce|all_reduce|allreduce)": (_DDP, *_GRAPH, *_SUMMA, "synchronise_batch_norm", "hybrid_mesh",
                                              *_FOLDED_TP, *_UNEVEN_TP),
    r"(?i:all-gather|all_gather)": (*_FSDP, *_GRAPH, *_MOE, *_SUMMA, "ShardedStatesOptimizer", *_FOLDED_TP,
                                    "register_compression", *_UNEVEN_TP),
    r"(?i:reduce-scatter|reduce_scatter)": (*_FSDP, *_GRAPH, *_SUMMA, "ExpertSlicedMoE", "expert_tensor_groups"),
    r"(?i:all-to-all|all_to_all)": (*_MOE, *_UNEVEN_TP),
    r"(?i:broadcast)": (_DDP, *_SUMMA),
}


def _family_plans() -> dict[str, object]:
    graph, spec, name, cluster = prepare_model(GPT_SPEC, f"cpu:1x{WORLD}")
    plans = {flavour: data_parallel_plan(graph, cluster, spec, name, flavour) for flavour in ("ddp", "zero1", "zero2", "fsdp")}
    plans["megatron dp x tp, zero1"] = megatron_plan(graph, cluster, spec, name, tp=2, dp_flavour="zero1", precision="fp32")
    plans["megatron tp, sequence parallel"] = megatron_plan(
        graph, cluster, spec, name, tp=WORLD, sequence_parallel=True, precision="fp32")
    plans["pipeline pp x dp"] = megatron_plan(graph, cluster, spec, name, pp=2, dp=2, micro_batch=2, precision="fp32")
    plans["summa 2d"] = summa_plan(ModelSpec(GPT, GPT_SMALL), "2d")
    plans["moe expert parallel, ddp"] = moe_plan(WORLD, "expert_parallel", "round-robin")
    plans["moe replicated experts, fsdp"] = moe_plan(WORLD, "data_parallel", flavour="fsdp")
    plans["moe sliced experts, zero1"] = moe_plan(WORLD, "expert_sliced", flavour="zero1")
    plans["moe copied experts, zero2"] = moe_plan(WORLD, "expert_parallel", "grid", flavour="zero2", sharded_copies=True)
    graph, spec, name, cluster = prepare_model(GPT_SPEC, "cpu:2x2")
    fsdp = data_parallel_plan(graph, cluster, spec, name, "fsdp")
    plans["hsdp 2 x 2"] = dataclasses.replace(fsdp, sections={"hsdp": HsdpSection(2)})
    graph, spec, name, cluster = prepare_model(ModelSpec(str(REPO / "examples/moe.py"), {}), f"cpu:1x{WORLD}")
    folded = Mesh((("dp", 2), ("tp", 2)))
    plans["moe folded dp x tp, EP2 x EDP2"] = folded_plan(graph, cluster, spec, name, folded, ep=2)
    plans["moe folded dp x tp, EP2 x ETP2"] = folded_plan(graph, cluster, spec, name, folded, ep=2, etp=2)
    for key, section in (("powersgd", PowerSgdSection(2)), ("top-k", TopKSection(0.01)),
                         ("half-reduce", HalfReduceSection("fp16"))):
        plans[key] = dataclasses.replace(plans["ddp"], sections={key: section})
    graph, spec, name, cluster = prepare_model(GPT_SPEC, str(REPO / "examples/clusters/mixed.toml"))
    plans["uneven-tp"] = uneven_tp_plan(graph, cluster, spec, name, "fp32")
    return plans


@pytest.fixture(scope="module")
def programs() -> dict[str, tuple[object, str]]:
    """Family -> (its plan, the source of its ``model_spmd.py``)."""
    return {family: (plan, render_model_spmd(plan)) for family, plan in _family_plans().items()}


def comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of ``source``."""
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node, clean=False):
            found.append((getattr(node, "lineno", 1), ast.get_docstring(node, clean=False)))
    return found


def code_names(source: str) -> set[str]:
    """Every name the code of ``source`` reads, calls or imports (comments and strings aside)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.rpartition(".")[2])
    return names


def unbacked_words(source: str) -> list[str]:
    """``line N: 'word' in: comment`` for each comment naming a wrapper or collective that
    none of the code's names does (``BACKING``)."""
    used = code_names(source)
    wrong = []
    for line, text in comments(source):
        for pattern, backing in BACKING.items():
            word = re.search(pattern, text)
            if word and not used.intersection(backing):
                wrong.append(f"line {line}: {word.group(0)!r} in: {' '.join(text.split())[:160]}")
    return wrong


def test_every_family_is_compiled(programs) -> None:
    """The families the other tests read: each compiled, each a different program."""
    assert tuple(programs) == FAMILIES and len({source for _, source in programs.values()}) == len(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_comments_name_what_the_code_calls(programs, family: str) -> None:
    plan, source = programs[family]
    assert unbacked_words(source) == [], f"{plan.name}: comments name what the code does not call"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_header_names_the_plan_as_plan_name_does(programs, family: str) -> None:
    plan, source = programs[family]
    assert f"# Plan: {plan.name}\n" in source


def test_sequence_parallelism_is_named_only_where_it_runs(programs) -> None:
    """"sequence parallel" in a program's comments: its plan splits the residual stream on
    the sequence (Plan.name says so), and the sequence-parallel plan's program says it."""
    for family, (plan, source) in programs.items():
        said = any("sequence parallel" in text for _, text in comments(source))
        assert said == ("sequence parallel" in plan.name), family
    assert "sequence parallel" in programs["megatron tp, sequence parallel"][0].name


def test_the_checker_finds_a_wrapper_the_code_does_not_call() -> None:
    """Negative control: the wrong MoE comment (DDP named in an FSDP2 program) is found, and
    a collective that nothing in the code runs is found."""
    fsdp_program = "from torch.distributed.fsdp import fully_shard\n# DDP averages their gradients.\nfully_shard(model)\n"
    assert unbacked_words(fsdp_program) == ["line 2: 'DDP' in: # DDP averages their gradients."]
    plain = "import torch\n\n\ndef step(x):\n    \"\"\"Tokens move with an all-to-all.\"\"\"\n    return x\n"
    assert unbacked_words(plain) == ["line 4: 'all-to-all' in: Tokens move with an all-to-all."]
