"""The memory-bound kernels around an MoE layer's expert GEMMs as the planner's compiled
programs run them (``planner.expert_kernels``); Megatron-Core's fused ones are
``cost_model.moe_layers.expert_memory_op_times``.

Each kernel is priced as the simulator prices a memory-bound kernel: its bytes read and
written at ``cost_model.memory_kernels.STREAMING_EFFICIENCY`` of the device's bandwidth (rows
``hidden`` or ``ffn`` elements wide are read and written whole, so the gathers and scatters
by row stream as a contiguous kernel does), plus the device's launch overhead per kernel
(``cost_model.compute.efficiencies``). Backward is what autograd runs for each forward op
(PyTorch's ``tools/autograd/derivatives.yaml``: ``index`` -> ``index_put_`` with accumulation
into zeros, ``index_copy`` -> ``index_select`` of the gradient and ``index_fill`` of a copy of
it, ``index_add`` -> ``index_select``; a tensor used by several ops has their gradients summed).

``torch_bmm`` (``codegen.runtime.moe``, ``moe_modes``; examples/moe.py's routed GELU layers):
the experts module runs one ``bmm``, the GELU over the whole padded buffer, and the second
``bmm``. The buffer's fill and the pick-back of the outputs are ops of the layer around the
experts (examples/moe.py's ``MoE.forward``: ``new_zeros(...).index_copy``, ``cat``,
``index_select``), which the simulator prices as the layer's other traced ops, on each rank's
share (``cost_model.moe_layers``): here only the GELU, one kernel a pass over the padded rows.

``per_expert_loop`` (``codegen.runtime.expert_dispatch.ExpertParallelExperts.forward``;
HuggingFace blocks, whose traced experts module holds the dispatch too, so nothing else prices
it). With ``R`` rows received by the busiest device, ``L`` local experts (``R / L`` rows each),
``S`` rows a device sends (its ``N`` tokens x top-k), model width ``W``, expert width ``F``,
elements:

  forward
    * the sent rows gathered (``hidden[token[order]]``): 2 S W, 1 kernel;
    * the output buffer (``new_zeros``): R W, 1 kernel;
    * per expert: the choice compare and ``nonzero`` (2 kernels, index bytes not counted), the
      expert's rows gathered (2 R/L W), SiLU of the gate half and its product with the up half
      (F + F, then 2 F + F: 5 R/L F, 2 kernels), and ``output = output.index_copy(...)``:
      out of place, a copy of the whole output (2 R W) and the scatter (2 R/L W), 2 kernels;
    * ``output + 0 * ...`` (every rank's backward reaches its weights): 2 R W, 1 kernel;
    * the returned rows times the router's weights: 2 S W, 1 kernel; the combine,
      ``zeros_like(hidden).index_add(...)``: zeros N W, its copy 2 N W, the add 3 S W
      (source read, destination read and written), 3 kernels;
    = 7 S W + 3 N W + (7 + 2 L) R W + 5 R F bytes-elements, 7 + 7 L kernels;
  backward
    * the combine: the source's gradient ``index_select``: 2 S W, 1 kernel; the product with
      the router's weights: gradient x weights (2 S W) and the weights' gradient, a product
      and a row sum (4 S W), 3 kernels; the ``0 * ...`` sum over the output's gradient: R W, 1;
    * per expert: ``index_copy``'s gradients, the source's ``index_select`` (2 R/L W) and a
      copy of the whole gradient with the expert's rows zeroed (2 R W + R/L W), 3 kernels;
      SwiGLU's (two products, 2 x 3 R/L F; SiLU's backward, 3 R/L F; the two halves put
      together, 4 R/L F), 4 kernels; the rows' gather, zeros of the whole received gradient
      (R W) and the accumulating scatter (3 R/L W), 2 kernels; and the L whole-size gradients of
      the received rows summed, L - 1 additions of 3 R W;
    * the sent rows' gather: zeros N W and the accumulating scatter 3 S W, 2 kernels;
    = 11 S W + N W + (4 + 6 L) R W + 13 R F, 6 + 10 L kernels.

The loop's copies of the whole output per expert (forward, and its gradient's in backward)
grow as L x R: with 16 local experts each forward copies the output 16 times.

Not priced: the casts of rows to and from the compute dtype under autocast (rows are priced
at the compute dtype's size throughout), the scalar kernels of ``0 * sum(...)``, the indices'
bytes, the sort and counts before the exchange, and the host synchronisations: ``nonzero``
waits for the device once per local expert, as the split sizes' ``tolist`` does once per
layer (``cost_model.host_syncs`` prices Megatron-Core's syncs, not these).
"""

from __future__ import annotations

from cost_model.compute import efficiencies
from cost_model.memory_kernels import STREAMING_EFFICIENCY
from planner.moe_blocks import MoEBlock


# (forward, backward) kernels of ``torch_bmm``'s GELU: one each way.
BATCHED_GELU_KERNELS = (1, 1)


def expert_loop_kernels(local_experts: int) -> tuple[int, int]:
    """(forward, backward) memory-bound kernels ``per_expert_loop`` launches a pass for
    ``local_experts`` experts (module docstring): 7 around the loop and 7 an expert forward,
    6 and 10 backward."""
    return 7 + 7 * local_experts, 6 + 10 * local_experts


def batched_gelu_times(padded_rows: float, ffn: float, element: int, device) -> tuple[float, float]:
    """(forward, backward) seconds of the GELU between the two ``bmm`` of ``torch_bmm``, over
    ``padded_rows`` rows (every local expert's buffer at its capacity) of ``ffn`` elements:
    forward reads and writes them (2 F a row), backward reads the gradient and the input and
    writes the input's gradient (3 F a row); one kernel each (module docstring)."""
    bandwidth = device.memory_bandwidth * STREAMING_EFFICIENCY
    launch = efficiencies(device)[2]
    return (2 * padded_rows * ffn * element / bandwidth + BATCHED_GELU_KERNELS[0] * launch,
            3 * padded_rows * ffn * element / bandwidth + BATCHED_GELU_KERNELS[1] * launch)


def expert_loop_times(block: MoEBlock, received: float, local_experts: int, held_tokens: float, ffn: float,
                      element: int, device) -> tuple[float, float]:
    """(forward, backward) seconds of ``per_expert_loop``'s memory-bound kernels (module
    docstring) on a device that received ``received`` rows for its ``local_experts`` experts
    of ``ffn`` width each and holds ``held_tokens`` tokens (it sends top-k rows for each)."""
    if local_experts <= 0:
        return 0.0, 0.0
    width, experts = block.hidden, local_experts
    sent = held_tokens * block.top_k
    forward = (7 * sent * width + 3 * held_tokens * width + (7 + 2 * experts) * received * width
               + 5 * received * ffn)
    backward = (11 * sent * width + held_tokens * width + (4 + 6 * experts) * received * width
                + 13 * received * ffn)
    bandwidth = device.memory_bandwidth * STREAMING_EFFICIENCY
    launch = efficiencies(device)[2]
    kernels = expert_loop_kernels(experts)
    return (forward * element / bandwidth + kernels[0] * launch,
            backward * element / bandwidth + kernels[1] * launch)
