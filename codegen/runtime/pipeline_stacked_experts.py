"""HuggingFace MoE blocks inside pipeline stages: their stacked experts split over the stage's ranks.

A HuggingFace MoE block (Mixtral, Qwen3-MoE, DeepSeek-V3, ...) routes with its own ops: the
router, top-k and weighting stay in the stage's traced ops as DTensor ops, and only the
block's ``experts(tokens, top_k_index, top_k_weights)`` is replaced
(``codegen.pipeline_moe_emit``) by one call, ``self.moe_experts(router, tokens, index,
weights)``, that runs ``codegen.runtime.expert_dispatch.ExpertParallelExperts`` over the
stage's ranks (the ``dp`` axis, or every rank of ``dp x tp`` for a folded plan):

- the three inputs are split by rows over every axis of the stage (each rank of a folded
  stage takes ``1 / (dp x tp)`` of the micro-batch's tokens; DTensor slices and gathers them,
  with autograd), the choices are sent to the experts' holders and back, and the output is
  a DTensor of the same rows, gathered over tp (``Shard(0)`` over dp, replicated over tp:
  the placements the writer declares for it);
- routing is dropless and per token, so where a token is computed does not change it: the
  micro-batch's outputs are one device's;
- every rank back-propagates the same loss (the micro-batch's, as DTensors compute it), so
  an expert's gradient arriving through the all-to-all's backward is whole for the tokens
  it saw: a copied expert's copies are summed over their holders after the schedule, and
  every expert gradient is divided by the number of micro-batches, as the pipeline divides
  the stage's DTensor gradients.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from codegen.runtime.expert_dispatch import ExpertParallelExperts
from codegen.runtime.moe import sum_copies

__all__ = ["StageStackedExperts"]


class StageStackedExperts(nn.Module):
    """A HuggingFace MoE block's stacked experts in a pipeline stage (module docstring).

    Args:
        experts: the model's stacked-experts module (``gate_up_proj``, ``down_proj``, ``act_fn``).
        placement: ``placement[e]`` lists (stage rank, share) for expert e.
        top_k: experts per token.
        group: the stage's ranks (dp, or dp x tp flattened in mesh order).
        mesh: the stage mesh.
        path: the MoE block's module path in the model.
        names: (router, expert in, expert out) relative to the block.
    """

    def __init__(self, experts: nn.Module, placement, top_k: int, group, mesh: DeviceMesh, path: str,
                 names: Sequence[str]) -> None:
        super().__init__()
        self.layer = ExpertParallelExperts(experts, placement, top_k, group, rank_losses_averaged=False)
        self.mesh, self.path = mesh, path
        self.router_name = names[0]
        self.expert_names = tuple(names[1:])  # "experts.gate_up_proj", "experts.down_proj" (and gpt-oss's biases)

    def forward(self, router: DTensor, tokens: DTensor, index: DTensor, weights: DTensor) -> DTensor:
        """The experts' weighted sum per token, rows as ``tokens`` (``router`` only named the block)."""
        rows = (Shard(0),) * self.mesh.ndim
        local = [value.redistribute(self.mesh, rows).to_local() for value in (tokens, index, weights)]
        output = self.layer(*local)
        output = DTensor.from_local(output, self.mesh, rows, run_check=False, shape=tokens.shape, stride=tokens.stride())
        return output.redistribute(self.mesh, (Shard(0),) + (Replicate(),) * (self.mesh.ndim - 1))

    def finish_gradients(self, micro_batches: int) -> None:
        """After the schedule: copies' gradients summed over their holders, all divided by
        the micro-batches."""
        layer = self.layer
        copied = any(len(copies) > 1 for copies in layer.replicas)
        for weight in layer.rank_local_parameters():
            if weight.grad is None:
                continue
            if copied:
                weight.grad = sum_copies(weight.grad, layer.replicas, layer.local_experts, layer.group)
            if micro_batches > 1:
                weight.grad.div_(micro_batches)

    def full_experts(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Each expert weight whole, by its qualified name in the model: (value, gradient or
        None). Collective over the stage's ranks (``launch.py --check``)."""
        found = self.layer.full_parameters()
        return {f"{self.path}.{name}": found[name.rsplit(".", 1)[-1]] for name in self.expert_names}
