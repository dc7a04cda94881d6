"""Activation recomputation as Megatron-LM defines it, per segment (a repeated block).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys
2023), section 4 and table 2; Megatron-LM ``--recompute-granularity``:

  * ``full``: a transformer layer keeps only its input (the checkpoint) and runs its whole
    forward again in backward, tensor-parallel collectives included (Megatron's
    ``--recompute-method uniform`` with one layer per checkpoint: the layer's forward,
    all-reduces and all, is recomputed).
  * ``selective``: the layer keeps everything but the core-attention tensors that grow with
    the square of the sequence (QKᵀ scores, softmax, its dropout mask, the attention over V:
    the ``5as/t`` of table 2) and recomputes only those ops' forward; no collective is
    recomputed (core attention runs on heads split over tensor parallelism).
  * ``full_keep_a2a`` (``planner.strategy.KEEP_A2A``): ``full`` for blocks with MoE layers,
    keeping what crossed the network. The block keeps its input and, per MoE layer, the
    outputs of its exchanges (the dispatch all-to-all's rows at the experts, the combine's
    rows back at their tokens, the routing counts: ``Segment.kept_exchange_bytes``, the
    layer's dispatch buffers of one micro-batch, ``cost_model.moe_layers.
    dispatch_buffer_bytes``); backward recomputes the whole forward but those exchanges
    (``Segment.kept_exchange_s``), which hand back what they kept. DeepSeek-V3 (technical
    report, arXiv 2412.19437, section 3.2.3) recomputes only cheap ops (RMSNorm, MLA
    up-projections), so nothing it recomputes communicates; Megatron-Core's selective
    ``--recompute-modules`` such as ``moe_act``, ``layernorm`` and ``mla_up_proj`` recompute
    ops around the token dispatcher, not the dispatcher. A block without MoE layer prices as
    ``full``.
  * ``norms_moe_act`` (``planner.strategy.NORMS_MOE_ACT``): Megatron-Core's
    ``--recompute-granularity selective --recompute-modules layernorm moe_act``
    (NVIDIA/Megatron-LM megatron/core/transformer/transformer_config.py, ``recompute_modules``:
    "layernorm": recompute the input_layernorm and pre_mlp_layernorm; "moe_act": the MoE MLP
    activation function; both by output-discarding checkpointing, which keeps a module's input
    and frees its output once the next op has used it). The block's own norms keep only their
    inputs (``Segment.norm_bytes`` dropped, ``norm_input_bytes`` kept where nothing else kept
    them) and the experts' activation function keeps only its input (``moe_act_bytes``
    dropped); backward runs both forwards again (``norm_forward_s``, ``moe_act_forward_s``).
    Nothing recomputed communicates. What is alive while recomputing is counted as the sum
    of both (an upper bound: Megatron frees each after its own backward).
  * ``none``: nothing is recomputed.

Ops around the blocks (embedding, final norm, head) are never checkpointed, as Megatron and
the compiled programs do. ``Segment.score_bytes`` / ``score_forward_s`` mark the ops whose
output is ``(…, s, s)``: the core attention that selective recomputation drops.
"""

from __future__ import annotations

from cost_model.segments import Segment
from planner.strategy import KEEP_A2A, NORMS_MOE_ACT, WHOLE_BLOCK_RECOMPUTE


def backward_time(segment: Segment, recompute: str) -> float:
    """Compute seconds of ``segment``'s backward for one micro-batch, recomputation included."""
    if not segment.block:
        return segment.backward_s
    if recompute in WHOLE_BLOCK_RECOMPUTE:
        return segment.backward_s + segment.forward_s
    if recompute == "selective":
        return segment.backward_s + segment.score_forward_s
    if recompute == NORMS_MOE_ACT:
        return segment.backward_s + segment.norm_forward_s + segment.moe_act_forward_s
    return segment.backward_s


def backward_comm(segment: Segment, recompute: str) -> float:
    """Communication seconds of ``segment``'s backward; a fully recomputed block runs its
    forward collectives again, but under ``full_keep_a2a`` not its MoE layers' exchanges."""
    if segment.block and recompute == "full":
        return segment.backward_comm_s + segment.forward_comm_s
    if segment.block and recompute == KEEP_A2A:
        return segment.backward_comm_s + segment.forward_comm_s - segment.kept_exchange_s
    return segment.backward_comm_s


def activation_bytes(segment: Segment, recompute: str) -> tuple[float, float]:
    """(bytes a micro-batch keeps for backward, bytes alive only while it recomputes)."""
    if not segment.block:
        return segment.saved_bytes, 0.0
    if recompute == "full":
        return segment.checkpoint_bytes, segment.saved_bytes
    if recompute == KEEP_A2A:
        return segment.checkpoint_bytes + segment.kept_exchange_bytes, segment.saved_bytes
    if recompute == "selective":
        return segment.saved_bytes - segment.score_bytes, segment.score_bytes
    if recompute == NORMS_MOE_ACT:
        dropped = segment.norm_bytes + segment.moe_act_bytes
        return segment.saved_bytes - dropped + segment.norm_input_bytes, dropped
    return segment.saved_bytes, 0.0
