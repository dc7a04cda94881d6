"""Frontier MoE models: the searched plan beside the published layout and the best of a grid
of Megatron-Core MoE configurations simulated on the same cluster.

    python benchmarks/moe_frontier.py --quick             # Mixtral-8x22B on 64 H100s only
    python benchmarks/moe_frontier.py                      # every row (hours on a 2-core machine)
    python benchmarks/moe_frontier.py --rows deepseek-256 --search-timeout 1800

Each model is HuggingFace's implementation built from its configuration on the meta device
(never downloaded): DeepSeek-V3 is ``AutoConfig.for_model("deepseek_v3")`` as it stands (671B);
Mixtral-8x22B sets the published config.json's sizes over its type's defaults (``ROWS``),
gpt-oss-120b is ``AutoConfig.for_model("gpt_oss")`` as it stands (120b's sizes), and
Qwen3-235B-A22B is built by ``benchmarks/qwen3_235b.py`` from its whole published config
(its ``head_dim`` is no field an ``hf:`` spec may set). Per row it prints:

- **search**: ``planner.plan`` in bf16 with ``--moe-dispatch overlapped`` (DeepEP's
  all-to-all and the EP overlap priced, as a team running Megatron-Core or DeepSeek's
  trainer would run them: such plans are simulated, not compiled), its planning time,
  chosen layout, predicted step, MFU and memory on the fullest device. It runs in a child
  process stopped ``--search-timeout`` seconds after it started (a row not planned by then
  says so), beside the grid, or before it with ``--grid-after-search`` (half the peak
  memory: the two processes each hold the traced model and their own simulations).
- **grid**: every configuration of ``search.megatron_moe.grid_configs`` (TP, EP, ETP, PP,
  VPP, DP, recomputation, micro-batch size) built, refused in one line, or pruned by the
  bounds (``search.megatron_moe.MegatronGrid``: EP x DP by the MoE family's dense part,
  pipelines by the search's pipeline builder, TP by the folded MoE builder), simulated on the
  same cluster, and the fastest that fits. Interleaved pipelines with TP have no builder
  (counted as missing), or are tried through the planner's search under their mesh with
  ``--constrained``.
- **published**: the layout the model's authors report, where they do, else NVIDIA's reference
  layout for the model where there is one (cited, ``ROWS``), and, where its degrees can be put
  on the row's cluster, that layout simulated as a grid configuration without and with full
  recomputation (a DualPipe layout's 1F1B twin too; ``published_results``).

The searched plan should be no slower than the grid's best; the verdict says when it is and
why it might be. Budgets count work, so the plans are the same on any machine; the planning
times are this machine's.

Not re-measured since session 13 priced every expert-parallel layer's experts as Transformer
Engine's grouped GEMM with the memory-bound kernels around them (``cost_model.grouped_gemm``,
``cost_model.moe_layers``; the Qwen3 fidelity rows moved +5 to +12 points, slower): the
figures below are session 12's; searched and grid steps would now read otherwise (every
Qwen3 fidelity row read longer), and the search may choose other layouts.

Measured 2026-11-30 at 0b5d41f (the last two rows at 5883f1c, whose cuDNN pricing these plans do
not run; session 12: after the 80 GB presets' capacity became
nvidia-smi's total less a cited reserve, 74.5 -> 78.68 GiB, Megatron-FSDP's experts sharded over
their EDP copies, and the EP overlap priced as Megatron-Core runs it), one row at a time with
``flock /work/locks/heavy.lock /usr/bin/time python benchmarks/moe_frontier.py --rows KEY
--grid-after-search --search-timeout 600`` on 2 CPU cores beside two helpers' lighter work.
"s" is the search's wall time, then the grid's alone:

=============  ====================================  ===================================  =========================
row            search (step, MFU, memory, s)         grid's best (built/fit of all, s)    verdict
=============  ====================================  ===================================  =========================
deepseek-2048  moe dp=2048, fsdp, EP 64 per device   TP1 EP256 PP8 VPP2 DP256 mbs1 full   search 0.651x the grid's
               x 512 copies (deduplicated, copies    recompute, ZeRO-1: 68.11 s, 13.7%,   best (row 500 s, peak
               sharded): 44.32 s, 21.0%, 78.4 GiB    23.6 GiB (152/2826 built, 54 fit;    2.2 GiB)
               (342 s)                               147 s)
deepseek-256   moe pp=32 x dp=2 x tp=4, 1F1B, 512    TP1 EP16 PP16 DP16 mbs1 full         search 0.642x the grid's
               micro-batches, ZeRO-1, EP8 folded     recompute, ZeRO-1: 27.05 s, 17.2%,   best (row 215 s, peak
               over dp x tp: 17.37 s, 26.8%, 78.3    52.6 GiB (93/2064 built, 20 fit;     1.6 GiB)
               GiB (167 s)                           43 s)
mixtral-64     moe pp=16 x dp=2 x tp=2, 1F1B, 128    TP4 EP8 ETP1 PP8 DP2 mbs1 no         search 0.940x the grid's
               micro-batches, ZeRO-1, EP4 folded     recompute, ZeRO-1: 11.85 s, 35.0%,   best (row 119 s, peak
               over dp x tp: 11.14 s, 37.3%, 75.0    68.1 GiB (215/1128 built, 98 fit;    1.5 GiB)
               GiB (66 s)                            46 s)
qwen3-256      moe pp=32 x dp=4 x tp=2, 1F1B, 256    TP1 EP16 PP16 VPP2 DP16 mbs1 full    search 0.626x the grid's
               micro-batches, ZeRO-1, EP8 folded     recompute, ZeRO-1: 18.12 s, 15.3%,   best (row 304 s, peak
               over dp x tp: 11.34 s, 24.4%, 77.7    21.3 GiB (282/2214 built, 143 fit;   2.8 GiB)
               GiB (200 s)                           93 s)
gpt-oss-128    moe pp=4 x dp=8 x tp=4, 1F1B, 64      TP4 EP32 ETP1 PP4 DP8 mbs1 no        search 1.000x the grid's
               micro-batches, ZeRO-1, EP32 folded    recompute, ZeRO-1: 14.08 s, 4.5%,    best: the same plan
               over dp x tp: 14.08 s, 4.5%, 78.5     78.5 GiB (404/1728 built, 197 fit;   (row 118 s, peak
               GiB (62 s)                            49 s)                                1.8 GiB)
=============  ====================================  ===================================  =========================

Against the previous measurement (489acaf, 74.5 GiB devices): every searched plan but gpt-oss's
changed, four of five now holding 75-78.5 GiB of the 78.68 that the old cap forbade; searched
steps deepseek-2048 51.49 -> 44.32 s (dp=2048 FSDP, EP16 -> EP64 per device), deepseek-256
18.39 -> 17.37 s, mixtral-64 11.07 -> 11.14 s (pp8 x dp4 x tp2 -> pp16 x dp2 x tp2: the
expert layers' EP overlap and the grid's best both priced anew), qwen3-256 11.60 s (dp=256
FSDP, experts replicated) -> 11.34 s (a folded pipeline), gpt-oss-128 14.20 -> 14.08 s. The
searched plans' ratio to the grid's best stays below 1 on every row.

Before the autocast pricing (at 387c111 and 54daf65) the same rows read: deepseek-256 17.33 s
against 25.06 s, mixtral-64 10.03 s (the grid's own best plan, TP4 EP8 PP8 DP2) against 10.03
s, qwen3-256 9.99 s against 15.97 s, gpt-oss-128 8.82 s against 9.63 s. gpt-oss moved most
(+61%, grid and search alike), and by its attention, not its residual stream: the searched
plan's report (``python -m planner plan hf:gpt_oss --cluster dgx-h100:16 --set batch_size=512
--set seq_len=4096``, 2026-11-30) gives ``self_attn`` 84.4% of the compute. gpt-oss has
attention sinks, so Hugging Face runs it eagerly (transformers 5.24
``modeling_gpt_oss.eager_attention_forward``): the (s x s) logits plus the additive mask, the
fp32 ``sinks`` parameter concatenated to them, a max and a softmax, at 4,096 tokens and 64
heads; with the model's fp32 weights the mask and the sinks are fp32, so type promotion and
autocast's fp32 softmax make every one of those (s x s) tensors fp32, twice the bf16 bytes
priced before. That is what the compiled program runs, so the +61% stands; a sink-aware flash
kernel (FlashAttention-3's or FlexAttention's) would remove most of it, and no plan field
expresses one yet. deepseek-2048 did not move then: the H800 was not among the
GPU generations ``cost_model.gpu_kernels`` knew, so its kernels kept the roofline and no
autocast term. Since 2026-11-30 the H800 is priced as the GH100 it is
(``gpu_kernels.EXPORT_VARIANTS``): re-measured with the same command beside four helpers' work
(so its times are not this machine's quiet ones), the row went 43.31 -> 51.49 s searched (the
same plan), 58.23 -> 67.34 s for the grid's best, 0.744x -> 0.765x.

Published (or reference) layouts, simulated as grid configurations:

- deepseek-2048, DeepSeek's own (PP16 under DualPipe x EP64 x ZeRO-1 DP128, no TP): with full
  recomputation 43.53 s, MFU 21.4%, 0.98x the searched plan, but 104.6 GiB: it does not fit
  (DualPipe holds every stage's weights twice, and inside a pipeline the planner keeps both
  copies of each expert whole, ``search.megatron_moe``); without recomputation no split of the
  61 layers over 16 stages fits. Its 1F1B twin with full recomputation fits: 72.85 s, MFU
  12.8%, 20.5 GiB, 1.07x the grid's best, 1.64x the searched plan (before session 12's
  capacity: 42.79 s and 110.0 GiB with DualPipe, 72.04 s for the twin). The row was killed for
  memory at 24 GiB before (773dfbe): every ``ExpertPlacement.copied_grid`` held 256 x 2,048 /
  EP (device, share) pairs (58 MiB and 0.9 s at EP1), one per MoE layer (58), kept with every
  simulated plan: 6.5 GiB and 2 min for the flat configurations EP1-128 at one recomputation
  and micro-batch size, six such sets (measured at 49d6dd5 with tracemalloc, one layer's
  placements times 58). A placement now holds one tuple per group of experts, shared by the
  layers.
- mixtral-64, NeMo's recipe without CP and VPP (TP2 PP4 DP8 EP8): 13.52 s, MFU 30.7%, 70.4 GiB
  with full recomputation: 1.14x the grid's best (10.27 s without, 119.4 GiB: does not fit).
- qwen3-256, Megatron Bridge's start without CP (TP4 PP16 DP4 EP8): not built, 94 layers do
  not split evenly over 16 stages for the folded builder (Megatron's even split).
- deepseek-256 (PP16 leaves 16 dp ranks per stage, fewer than EP64) and gpt-oss-128 (none
  published): not evaluated.

Mixtral-8x22B: the grid's best is tensor parallelism beside experts inside a pipeline
(``pp=8 x dp=2 x tp=4``, experts EP8 folded over dp x tp, 1F1B over 256 / 2 = 128
micro-batches), built by the folded MoE family's builder. Until 54daf65 the default search
did not try it (folded HF blocks only under ``--mesh tp=..``, 1F1B over as many micro-batches
as stages) and picked dp=64 FSDP, 10.70 s (1.066x); the pipeline grid now prices folded
tensor-parallel stages (``search.moe_folding.folded_stage_variants``) and finds the grid's
plan or, at 489acaf, a faster one (pp=8 x dp=4 x tp=2, 64 micro-batches).

Refusals per row are printed with their one-line reasons: pipelines whose layers do not
divide over the stages for the folded builder (Megatron's even split), interleaved
pipelines with TP (no builder), and the pruned (memory lower bounds, step-time lower bound
against the best found, dominance among the same degrees).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path

import planner
from planner.api import prepare_model
from planner.constraints import SearchConstraints
from planner.errors import PlannerError
from planner.model_spec import ModelSpec
from search.megatron_moe import GridResult, MegatronGrid, MegatronMoEConfig, best_of, grid_configs

GIB = 2**30


@dataclass(frozen=True)
class Row:
    key: str
    model: str
    spec: str
    sizes: dict  # config.json fields set over the HF type's defaults
    cluster: str
    batch: int
    seq: int
    published: str
    note: str = ""
    quick: bool = False
    overrides: dict = field(default_factory=dict)
    # The published (or reference) layout's degrees as a grid configuration, simulated beside
    # the grid (``published_results``); None where none is published or it cannot be put on
    # this cluster (``published`` says why).
    published_config: MegatronMoEConfig | None = None


# Qwen3-235B-A22B is built by a file factory: its published head_dim (128) is no field of
# transformers' Qwen3MoeConfig, so an hf:qwen3_moe spec refuses it (benchmarks/qwen3_235b.py).
QWEN3_235B_FACTORY = str(Path(__file__).with_name("qwen3_235b.py"))
# mistralai/Mixtral-8x22B-v0.1 config.json.
MIXTRAL_8X22B = {"hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56, "num_attention_heads": 48,
                 "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32768}

DEEPSEEK_PUBLISHED = ("PP16 (DualPipe) x EP64 over 8 nodes x ZeRO-1 DP, no TP, node-limited routing (4 nodes); "
                      "DeepSeek-V3 technical report, arXiv 2412.19437, sections 3.2 and 3.1")
# On 2,048 GPUs: 16 stages of 128 dp ranks under DualPipe, experts EP64 folded over them (2
# copies of each), ZeRO-1, one sequence per micro-batch (128 micro-batches), recomputation none
# or full where DeepSeek recomputes RMSNorm and the MLA up-projections only (section 3.2.3).
DEEPSEEK_2048_PUBLISHED = MegatronMoEConfig(tp=1, ep=64, etp=1, pp=16, vpp=1, dp=128, recompute="none",
                                            micro_batch_size=1, dualpipe=True)
# NVIDIA's reference layouts, not the model authors' (none published a pre-training layout):
# NeMo's Mixtral-8x22B pre-training recipe (NVIDIA/NeMo nemo/collections/llm/recipes/mixtral_8x22b.py,
# trainer(): TP2, sequence parallel, PP4, VPP14, CP2, EP8, micro-batch 1, 16 nodes) and Megatron
# Bridge's starting point for Qwen3-235B-A22B (NVIDIA/skills
# skills/nemo-mbridge-perf-parallelism-strategies/SKILL.md, "MoE models": TP4 PP16 EP8, CP2 for
# pre-training). The grid has no context parallelism and no interleaved builder with TP, so
# Mixtral's is evaluated without CP and VPP (TP2 PP4 DP8 EP8 on 64 GPUs).
MIXTRAL_REFERENCE = ("NeMo's recipe (not Mistral's, who published none): TP2 + SP, PP4 x VPP14, CP2, EP8 on 128 H100s "
                     "(NVIDIA/NeMo recipes/mixtral_8x22b.py); evaluated here without CP and VPP: TP2 PP4 DP8 EP8")
QWEN3_REFERENCE = ("Megatron Bridge's starting point (not Qwen's, who published none): TP4 PP16 EP8, CP2 for "
                   "pre-training (NVIDIA/skills nemo-mbridge-perf-parallelism-strategies); evaluated here without "
                   "CP: TP4 PP16 DP4 EP8")
ROWS = (
    Row("deepseek-2048", "DeepSeek-V3", "hf:deepseek_v3", {}, "hgx-h800:256", 16384, 4096, DEEPSEEK_PUBLISHED,
        published_config=DEEPSEEK_2048_PUBLISHED,
        note="batch 16,384 not the published 15,360, which does not split over the 2,048 dp ranks of the layouts "
             "without a pipeline that the search and the grid try (15,360 splits over PP16's 128)"),
    Row("deepseek-256", "DeepSeek-V3", "hf:deepseek_v3", {}, "dgx-h100:32", 1024, 4096,
        "none published at 256 GPUs (DeepSeek's is " + DEEPSEEK_PUBLISHED.split(";")[0] + " on 2,048 H800s; "
        "not evaluated here: PP16 leaves 16 dp ranks per stage, fewer than EP64 needs)"),
    Row("qwen3-256", "Qwen3-235B-A22B", QWEN3_235B_FACTORY, {}, "dgx-h100:32", 1024, 4096, QWEN3_REFERENCE,
        published_config=MegatronMoEConfig(tp=4, ep=8, etp=1, pp=16, vpp=1, dp=4, recompute="none",
                                           micro_batch_size=1)),
    Row("mixtral-64", "Mixtral-8x22B", "hf:mixtral", MIXTRAL_8X22B, "dgx-h100:8", 256, 4096, MIXTRAL_REFERENCE,
        quick=True, published_config=MegatronMoEConfig(tp=2, ep=8, etp=1, pp=4, vpp=1, dp=8, recompute="none",
                                                       micro_batch_size=1)),
    Row("gpt-oss-128", "gpt-oss-120b", "hf:gpt_oss", {}, "dgx-h100:16", 512, 4096,
        "none published (OpenAI's gpt-oss model card names no training layout)"),
)


def row_spec(row: Row) -> ModelSpec:
    return ModelSpec(row.spec, {**row.sizes, "batch_size": row.batch, "seq_len": row.seq})


def _plan_summary(plan) -> dict:
    estimate = plan.estimate
    return {"name": plan.name, "step_s": estimate.step_time_s, "mfu": estimate.mfu,
            "memory": estimate.memory.total, "fits": estimate.fits, "timings": dict(plan.timings)}


def _search_child(row: Row, queue) -> None:
    try:
        plan = planner.plan(row_spec(row), row.cluster, precision="bf16", progress=False, time_budget_s=None,
                            moe_dispatch="overlapped")
        queue.put(("plan", _plan_summary(plan)))
    except PlannerError as error:  # refused: the search's one-line message
        queue.put(("refused", str(error)))


@dataclass
class SearchRun:
    """``planner.plan`` of a row running in a child process (so the grid runs meanwhile and a
    search past its time can be stopped)."""

    child: object
    queue: object
    started: float

    @classmethod
    def start(cls, row: Row) -> "SearchRun":
        # spawn: a forked child of a process that ran torch ops can hang in its thread pool.
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_search_child, args=(row, queue))
        child.start()
        return cls(child, queue, time.perf_counter())

    def finish(self, timeout_s: float) -> tuple[str, object, float]:
        """(outcome, summary or message, seconds since the start), waiting until ``timeout_s``
        after the start at most."""
        self.child.join(max(0.0, timeout_s - (time.perf_counter() - self.started)))
        elapsed = time.perf_counter() - self.started
        if self.child.is_alive():
            self.child.terminate()
            self.child.join()
            return "timeout", f"not planned within {timeout_s:.0f} s here", elapsed
        if self.queue.empty():
            return "failed", f"the search stopped with exit code {self.child.exitcode}", elapsed
        outcome, value = self.queue.get()
        return outcome, value, elapsed


def constrained_search(row: Row):
    """A planner search under a configuration's mesh (``--constrained``)."""
    def plan_for(config: MegatronMoEConfig):
        mesh = {axis: size for axis, size in (("tp", config.tp), ("pp", config.pp)) if size > 1}
        try:
            return planner.plan(row_spec(row), row.cluster, precision="bf16", progress=False, time_budget_s=None,
                                constraints=SearchConstraints(mesh=mesh))
        except PlannerError:
            return None
    return plan_for


def grid(row: Row, constrained: bool) -> tuple[list[GridResult], list[GridResult], float]:
    """The row's grid results, its published layout's (``published_results``) and the seconds
    both took."""
    started = time.perf_counter()
    graph, spec, name, cluster = prepare_model(row_spec(row), row.cluster)
    megatron = MegatronGrid(graph, cluster, spec, name, "bf16")
    results = megatron.results(grid_configs(graph, cluster), constrained_search(row) if constrained else None)
    published = published_results(megatron, row.published_config, results)
    return results, published, time.perf_counter() - started


def published_results(megatron: MegatronGrid, config: MegatronMoEConfig | None,
                      results: list[GridResult]) -> list[GridResult]:
    """The published layout's degrees without and with full recomputation (and, for a DualPipe
    layout, its 1F1B twin likewise), each taken from the grid where it was simulated there,
    else built now (the grid may have pruned it; DualPipe is never in it)."""
    if config is None:
        return []
    done = {result.config: result for result in results if result.plan is not None}
    schedules = (True, False) if config.dualpipe else (False,)
    variants = [dataclasses.replace(config, recompute=mode, dualpipe=dualpipe)
                for dualpipe in schedules for mode in ("none", "full")]
    return [done.get(variant) or megatron.build(variant) for variant in variants]


def _figures(step_s: float, mfu: float, memory: float, fits: bool) -> str:
    return f"{step_s:.2f} s/step, MFU {mfu:.1%}, {memory / GIB:.1f} GiB{'' if fits else ' (does not fit)'}"


def report_published(published: list[GridResult]) -> None:
    """Print each simulated variant of the published layout: its figures, or why it is not built."""
    for result in published:
        if result.plan is None:
            print(f"      {result.config.describe()}: not built: {result.missing}")
        else:
            estimate = result.plan.estimate
            print(f"      {result.config.describe()}, ZeRO-1: "
                  f"{_figures(estimate.step_time_s, estimate.mfu, estimate.memory.total, estimate.fits)}")


def report_grid(row: Row, results: list[GridResult], published: list[GridResult], grid_s: float) -> GridResult | None:
    """Print the row's heading, its published layout and its grid; returns the grid's best."""
    print(f"\n== {row.model} on {row.cluster}, batch {row.batch:,} x {row.seq:,} ==", flush=True)
    if row.note:
        print(f"   note: {row.note}")
    print(f"   published: {row.published}")
    report_published(published)
    built = [r for r in results if r.plan is not None]
    missing: dict[str, int] = {}
    for r in results:
        if r.plan is None:
            missing[r.missing] = missing.get(r.missing, 0) + 1
    best = best_of(results)
    print(f"   Megatron-Core grid ({grid_s:.0f} s here): {len(built)} of {len(results)} configurations simulated, "
          f"{sum(1 for r in built if r.plan.estimate.fits)} fit")
    for why, count in sorted(missing.items()):
        print(f"      {count} {why}")
    if best is None:
        print("      best: none fits", flush=True)
    else:
        estimate = best.plan.estimate
        print(f"      best: {best.config.describe()}, ZeRO-1: "
              f"{_figures(estimate.step_time_s, estimate.mfu, estimate.memory.total, True)}", flush=True)
    return best


def report_search(search, best: GridResult | None) -> None:
    """Print the searched plan and how it compares with the grid's best."""
    outcome, value, elapsed = search
    if outcome != "plan":
        print(f"   search ({elapsed:.0f} s here): {outcome}: {value}", flush=True)
        return
    print(f"   search ({elapsed:.0f} s here): {value['name']}")
    print(f"      {_figures(value['step_s'], value['mfu'], value['memory'], value['fits'])}")
    if best is None:
        print("   verdict: no grid configuration fits to compare with", flush=True)
        return
    ratio = value["step_s"] / best.plan.estimate.step_time_s
    if not value["fits"]:
        print("   verdict: the searched plan does not fit", flush=True)
    elif ratio <= 1.0 + 1e-9:
        print(f"   verdict: searched plan no slower than the grid's best ({ratio:.3f}x)", flush=True)
    else:
        print(f"   verdict: searched plan SLOWER than the grid's best ({ratio:.3f}x): the grid's "
              f"{best.config.describe()} is outside what the search tries, or its search stopped early", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the rows marked quick (Mixtral-8x22B on 64 H100s)")
    parser.add_argument("--rows", nargs="*", choices=[row.key for row in ROWS], help="rows to run (default all)")
    parser.add_argument("--search-timeout", type=float, default=1200.0, help="seconds per row's search (default 1200)")
    parser.add_argument("--constrained", action="store_true",
                        help="plan interleaved grid configurations with TP through the search under their mesh (slow)")
    parser.add_argument("--grid-after-search", action="store_true",
                        help="build the grid once the search has finished, not beside it (half the peak memory, "
                             "and each part's time measured alone)")
    options = parser.parse_args()
    rows = [row for row in ROWS if (not options.quick or row.quick) and (not options.rows or row.key in options.rows)]
    for row in rows:
        search = SearchRun.start(row)  # beside the grid: both are this row's
        if options.grid_after_search:
            searched = search.finish(options.search_timeout)
        try:
            results, published, grid_s = grid(row, options.constrained)
        except PlannerError as error:  # the model cannot be built or traced: its one-line message
            print(f"\n== {row.model} on {row.cluster}: {error}")
            search.finish(0.0)
            continue
        best = report_grid(row, results, published, grid_s)
        report_search(searched if options.grid_after_search else search.finish(options.search_timeout), best)


if __name__ == "__main__":
    main()
