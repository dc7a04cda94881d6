"""The torchrun command lines suggested for a plan (after ``plan`` and ``compile``, and at
the top of the generated ``launch.py``), and whether ``launch.py --check`` can run it.

One node: ``torchrun --nproc_per_node W``. Several: every node runs ``torchrun --nnodes N
--nproc_per_node D`` with the c10d rendezvous at the first node (torchrun's multi-node
form, https://pytorch.org/docs/stable/elastic/run.html); ``$MASTER_ADDR`` stands for that
node's address.

``--check`` runs the whole model on every rank's own device as its reference (see
``codegen.runtime.parity``), so on GPUs a model whose training state alone exceeds one
device cannot be checked: the suggestion is then ``--steps 10``, and the launcher refuses
``--check`` in one line (against the GPU it finds) before it builds anything. On CPUs the
planned memory is a budget, not the host's memory, so ``--check`` is always suggested.
"""

from __future__ import annotations

import shlex

from planner.plans import Plan

# A one-device training step holds each parameter in fp32 with its gradient and AdamW's two
# states (4 + 4 + 8 bytes), before any activation.
REFERENCE_BYTES_PER_PARAMETER = 16
RENDEZVOUS_PORT = 29500


def reference_bytes(plan: Plan) -> int:
    """Bytes the one-device reference of ``--check`` holds before activations."""
    return plan.summary.parameters * REFERENCE_BYTES_PER_PARAMETER


def smallest_device_bytes(plan: Plan) -> int:
    """Memory of the smallest device of the plan's cluster."""
    return min(node.device.memory_bytes for node in plan.cluster.nodes)


def check_fits_one_device(plan: Plan) -> bool:
    """Whether ``--check``'s one-device reference can hold the model's training state on the
    plan's GPUs (always, on a CPU cluster)."""
    return plan.cluster.backend != "nccl" or reference_bytes(plan) <= smallest_device_bytes(plan)


def torchrun_parts(plan: Plan, script: str) -> list[str]:
    """torchrun and its arguments that start ``script`` on the plan's ranks (on every node
    of a multi-node cluster)."""
    cluster = plan.cluster
    if cluster.num_nodes == 1:
        return ["torchrun", "--nproc_per_node", str(plan.world_size), script]
    counts = sorted({node.devices for node in cluster.nodes})
    per_node = str(counts[0]) if len(counts) == 1 else "gpu"  # uneven nodes: torchrun counts each node's GPUs
    return ["torchrun", "--nnodes", str(cluster.num_nodes), "--nproc_per_node", per_node,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"$MASTER_ADDR:{RENDEZVOUS_PORT}", script]


def first_run_flags(plan: Plan) -> list[str]:
    """``--check`` where one device can hold the reference, else a short training run."""
    return ["--check"] if check_fits_one_device(plan) else ["--steps", "10"]


def first_run_command(plan: Plan, script: str) -> str:
    """The command line to run first after compiling ``plan`` (shell-quoted, with
    ``$MASTER_ADDR`` left for the shell to expand), and on multi-node clusters where to run it."""
    parts = torchrun_parts(plan, script) + first_run_flags(plan)
    line = " ".join(part if part.startswith("$MASTER_ADDR") else shlex.quote(part) for part in parts)
    if plan.cluster.num_nodes > 1:
        line += f"   # on each of the {plan.cluster.num_nodes} nodes, MASTER_ADDR = the first node's address"
    return line


def check_refusal(plan: Plan, device_bytes: int) -> str | None:
    """Why ``--check`` cannot run ``plan`` on a GPU of ``device_bytes`` (one line), or None."""
    if reference_bytes(plan) <= device_bytes:
        return None
    gib = 1024**3
    return (f"--check compares against the whole model trained on one device, which needs at least "
            f"{reference_bytes(plan) / gib:.1f} GiB for {plan.summary.parameters:,} parameters (fp32 weights, "
            f"gradients and AdamW states) and this GPU has {device_bytes / gib:.1f} GiB; check a smaller "
            f"configuration of the model, or run --steps N")
