"""torchrun worker for ``tests/test_hf_expert_parallel.py``: HuggingFace MoE decoders (tiny
Mixtral and Qwen2-MoE) with their experts split by ``codegen.runtime.expert_dispatch``
against the same model on one device, for several placements, in one launch. Rank 0 prints
``RESULT <case>: ok worst <what> <error>`` or ``RESULT <case>: FAILED ...``."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from codegen.runtime.expert_dispatch import ExpertParallelExperts, scale_expert_gradients
from planner.model_spec import ModelSpec, extract_loss
from planner.moe_blocks import find_moe_blocks

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 64, "batch_size": 8, "seq_len": 8}
MODELS = {
    "mixtral": {**TINY, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**TINY, "intermediate_size": 48, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 24,
                  "num_experts": 4, "num_experts_per_tok": 2},
}


def placements(world: int, experts: int) -> dict[str, list]:
    round_robin = [[(e % world, 1.0)] for e in range(experts)]
    # Expert 0 copied on ranks 0 and 1 (0.7 / 0.3 of each rank's choices of it).
    copied = [[(0, 0.7), (1, 0.3)]] + [[(e % world, 1.0)] for e in range(1, experts)]
    return {"round-robin": round_robin, "copied": copied}


def run_case(model_type: str, placement_name: str, scale: bool = True) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, args, kwargs = ModelSpec(f"hf:{model_type}", MODELS[model_type]).build("cpu")
    for param in model.parameters():  # bigger weights than HF's init: routing that matters
        torch.nn.init.normal_(param, std=0.2)
    reference = copy.deepcopy(model)
    ref_loss = extract_loss(reference(*args, **kwargs))
    ref_loss.backward()

    blocks = find_moe_blocks(model)
    layers = {}
    for block in blocks:
        module = model.get_submodule(block.module)
        placement = placements(world, block.experts)[placement_name]
        layers[block.module] = module.experts = ExpertParallelExperts(module.experts, placement)
    batch = kwargs["input_ids"].size(0)
    local = slice(rank * batch // world, (rank + 1) * batch // world)
    loss = extract_loss(model(**{name: value[local] for name, value in kwargs.items()}))
    loss.backward()
    for name, param in model.named_parameters():  # data parallel: the mean over ranks
        if ".experts." not in name:
            dist.all_reduce(param.grad)
            param.grad /= world
    if scale:
        for layer in layers.values():
            scale_expert_gradients(layer)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    errors = {"loss": (mean_loss / world - ref_loss).abs()}
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if ".experts." not in name:
            errors[f"grad of {name}"] = (param.grad - expected[name].grad).abs().max()
    for path, layer in layers.items():
        gathered = layer.full_weights(grads=True)
        for weight in ("gate_up_proj", "down_proj"):
            want = expected[f"{path}.experts.{weight}"]
            errors[f"{path} {weight}"] = (gathered[f"{weight}.weight"] - want.detach()).abs().max()
            errors[f"grad of {path} {weight}"] = (gathered[f"{weight}.grad"] - want.grad).abs().max()
    worst = torch.stack([e.detach().reshape(()).float() for e in errors.values()])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    kind, value = max(zip(errors, worst.tolist()), key=lambda item: item[1])
    copies_used = sum(int(layer.last_expert_counts[0]) for layer in layers.values())
    return f"{'ok' if value < 1e-5 else 'FAILED'} worst {kind} {value:.3e} (expert 0 chosen {copies_used}x here)"


def main() -> None:
    dist.init_process_group("gloo")
    cases = [(m, p, True) for m in MODELS for p in ("round-robin", "copied")]
    cases.append(("mixtral", "copied", False))  # the control: gradients left as sums
    for model_type, placement_name, scale in cases:
        result = run_case(model_type, placement_name, scale)
        if dist.get_rank() == 0:
            suffix = "" if scale else ", gradients not scaled (control)"
            print(f"RESULT {model_type} {placement_name}{suffix}: {result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
