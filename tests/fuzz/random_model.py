"""Random small models for the parity fuzzer, rebuilt from a seed.

``build(seed)`` returns ``(model, inputs)``: a ``RandomModel`` whose structure and sizes
derive from ``seed`` alone (``random.Random(seed)``), and one global batch of random data
(from torch's global generator, which the planner and every rank seed alike). So a plan can
name the model as ``ModelSpec("/abs/path/random_model.py:build", {"seed": n})`` and every
torchrun rank rebuilds exactly the model that was planned.

A model is a stem, a few body steps and a loss head, each drawn from the ops the sharding
rules cover, on an activation of shape ``(batch, tokens, hidden)``:

- stems: token embedding, a linear projection of features, a conv1d over a signal, a conv2d
  over an image (its pixels become the tokens);
- body steps: linear, layer norm, RMS norm, softmax, scaled-dot-product attention (fused or
  written as matmuls), elementwise activations, residual adds, gates, bmm token mixing,
  reductions over the hidden dim, the token dim or every dim, views (transpose, permute,
  split/cat, reshape), conv1d and conv2d over the tokens;
- heads: per-token cross-entropy (sometimes through the embedding table: tied weights),
  per-sample cross-entropy, mean-squared error.

Every loss is a mean over the batch, so averaged data-parallel gradients are exact. Sizes
are tiny (hidden 8-32, a few tokens, batch 4 or 8) and often uneven (hidden 10 or 18, 5
tokens), so splits over 4 ranks are uneven where the rules allow them.

    python tests/fuzz/random_model.py 7      # prints the structure of seed 7 and runs a step
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

WIDTHS = (8, 10, 12, 16, 18, 20, 24, 32)
TOKENS = (3, 4, 5, 6, 7, 8)
BATCHES = (4, 8)
BODY_STEPS = (
    "linear", "layer_norm", "rms_norm", "softmax", "attention", "manual_attention", "activation",
    "residual", "gate", "token_mix", "reduce_hidden", "reduce_tokens", "max_hidden", "transpose",
    "permute", "split_cat", "reshape", "conv1d", "conv2d", "center",
)
STEMS = ("embedding", "linear", "conv1d", "conv2d")
HEADS = ("token_classes", "sample_classes", "regression")
ACTIVATIONS = ("gelu", "silu", "relu", "tanh", "sigmoid")


@dataclass(frozen=True)
class Step:
    """One drawn piece of the model: its kind and its settings (plain values)."""

    kind: str
    settings: dict = field(default_factory=dict)

    def __str__(self) -> str:
        inside = ",".join(f"{key}={value}" for key, value in self.settings.items())
        return f"{self.kind}({inside})" if inside else self.kind


@dataclass(frozen=True)
class Recipe:
    """The structure of one random model: sizes, stem, body steps and head."""

    seed: int
    batch: int
    tokens: int
    stem: Step
    body: tuple[Step, ...]
    head: Step

    @property
    def structure(self) -> str:
        """Sizes and steps, one line: ``batch=4 tokens=5: embedding(...) -> ... -> head(...)``."""
        steps = " -> ".join(map(str, (self.stem, *self.body, self.head)))
        return f"batch={self.batch} tokens={self.tokens}: {steps}"

    def __str__(self) -> str:
        return f"seed {self.seed}: {self.structure}"


def recipe(seed: int) -> Recipe:
    """The structure of model ``seed``: the same seed always gives the same recipe."""
    rng = random.Random(seed)
    batch = rng.choice(BATCHES)
    hidden = rng.choice(WIDTHS)
    stem_kind = rng.choice(STEMS)
    if stem_kind == "conv2d":  # the tokens are the pixels of a side x side image
        side = rng.choice((2, 3))
        tokens = side * side
        stem = Step("conv2d", {"channels": rng.choice((1, 3)), "side": side, "out": hidden})
    else:
        tokens = rng.choice(TOKENS)
        settings = {
            "embedding": lambda: {"vocab": rng.choice((7, 11, 16)), "out": hidden},
            "linear": lambda: {"features": rng.choice((5, 8, 12)), "out": hidden, "bias": rng.random() < 0.5},
            "conv1d": lambda: {"channels": rng.choice((1, 3, 4)), "out": hidden, "kernel": rng.choice((1, 3))},
        }[stem_kind]()
        stem = Step(stem_kind, settings)
    body = []
    for _ in range(rng.randint(1, 5)):
        step = _body_step(rng, rng.choice(BODY_STEPS), hidden, tokens)
        body.append(step)
        hidden = step.settings.get("out", hidden)
    head = rng.choice(HEADS)
    head_settings = {"classes": rng.choice((3, 5, 8))} if head != "regression" else {"outputs": rng.choice((1, 4, 6))}
    if head == "token_classes" and stem_kind == "embedding" and hidden == stem.settings["out"] and rng.random() < 0.5:
        # A language model's tied weights: the head reads the embedding table (vocab classes).
        head_settings = {"classes": stem.settings["vocab"], "tied": True}
    return Recipe(seed, batch, tokens, stem, tuple(body), Step(head, {"hidden": hidden, **head_settings}))


def _body_step(rng: random.Random, kind: str, hidden: int, tokens: int) -> Step:
    """Settings of one body step on an activation of width ``hidden``."""
    if kind == "linear":
        return Step(kind, {"hidden": hidden, "out": rng.choice(WIDTHS), "bias": rng.random() < 0.7})
    if kind == "layer_norm":
        return Step(kind, {"hidden": hidden, "affine": rng.random() < 0.8})
    if kind in ("rms_norm", "residual", "gate"):
        return Step(kind, {"hidden": hidden})
    if kind == "softmax":
        return Step(kind, {"dim": rng.choice((-1, 1)), "log": rng.random() < 0.3})
    if kind in ("attention", "manual_attention"):
        heads = rng.choice([h for h in (1, 2, 4) if hidden % h == 0])
        return Step(kind, {"hidden": hidden, "heads": heads, "causal": rng.random() < 0.5})
    if kind == "activation":
        return Step(kind, {"fn": rng.choice(ACTIVATIONS)})
    if kind == "token_mix":
        return Step(kind, {"use_bmm": rng.random() < 0.5})
    if kind in ("reduce_hidden", "reduce_tokens"):
        return Step(kind, {"how": rng.choice(("sum", "mean"))})
    if kind in ("max_hidden", "center"):
        return Step(kind)
    if kind == "transpose":
        return Step(kind, {"contiguous": rng.random() < 0.5})
    if kind == "permute":
        return Step(kind)
    if kind == "split_cat":
        return Step(kind, {"first": rng.randint(1, hidden - 1)})
    if kind == "reshape":
        halves = [f for f in (2, 4) if hidden % f == 0]
        return Step(kind, {"factor": rng.choice(halves) if halves else 1, "flatten_batch": rng.random() < 0.5})
    if kind == "conv1d":
        return Step(kind, {"hidden": hidden, "out": rng.choice(WIDTHS), "kernel": rng.choice((1, 3)), "bias": rng.random() < 0.5})
    if kind == "conv2d":
        return Step(kind, {"hidden": hidden, "out": rng.choice(WIDTHS), "kernel": rng.choice((1, 3))})
    raise ValueError(f"unknown body step {kind!r}")


# ------------------------------------------------------------------------------ modules


class Stem(nn.Module):
    """The first op: turns the model's input into ``(batch, tokens, hidden)``."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.kind = step.kind
        s = step.settings
        if self.kind == "embedding":
            self.op = nn.Embedding(s["vocab"], s["out"])
        elif self.kind == "linear":
            self.op = nn.Linear(s["features"], s["out"], bias=s["bias"])
        elif self.kind == "conv1d":
            self.op = nn.Conv1d(s["channels"], s["out"], s["kernel"], padding=s["kernel"] // 2)
        else:
            self.op = nn.Conv2d(s["channels"], s["out"], 3, padding=1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.kind in ("embedding", "linear"):
            return self.op(inputs)
        if self.kind == "conv1d":  # (B, C, T) -> (B, H, T) -> (B, T, H)
            return self.op(inputs).transpose(1, 2)
        return self.op(inputs).flatten(2).transpose(1, 2)  # (B, C, S, S) -> (B, S*S, H)


class Body(nn.Module):
    """One body step on ``(batch, tokens, hidden)``."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.kind = step.kind
        self.s = s = step.settings
        if self.kind == "linear":
            self.op = nn.Linear(s["hidden"], s["out"], bias=s["bias"])
        elif self.kind == "layer_norm":
            self.op = nn.LayerNorm(s["hidden"], elementwise_affine=s["affine"])
        elif self.kind == "rms_norm":
            self.op = nn.RMSNorm(s["hidden"])
        elif self.kind in ("attention", "manual_attention"):
            self.qkv = nn.Linear(s["hidden"], 3 * s["hidden"])
            self.proj = nn.Linear(s["hidden"], s["hidden"])
        elif self.kind in ("residual", "gate"):
            self.op = nn.Linear(s["hidden"], s["hidden"])
        elif self.kind == "conv1d":
            self.op = nn.Conv1d(s["hidden"], s["out"], s["kernel"], padding=s["kernel"] // 2, bias=s["bias"])
        elif self.kind == "conv2d":
            self.op = nn.Conv2d(s["hidden"], s["out"], (s["kernel"], 1), padding=(s["kernel"] // 2, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: C901 - one branch per kind
        kind, s = self.kind, self.s
        if kind in ("linear", "layer_norm", "rms_norm"):
            return self.op(x)
        if kind == "softmax":
            return (F.log_softmax if s["log"] else F.softmax)(x, dim=s["dim"])
        if kind in ("attention", "manual_attention"):
            return self._attention(x)
        if kind == "activation":
            return getattr(torch, s["fn"]) (x) if s["fn"] in ("tanh", "sigmoid") else getattr(F, s["fn"])(x)
        if kind == "residual":
            return x + self.op(x)
        if kind == "gate":
            return x * torch.sigmoid(self.op(x))
        if kind == "token_mix":  # (B,T,H) @ (B,H,T) -> (B,T,T) mixes tokens, scaled to stay small
            scores = (torch.bmm(x, x.transpose(1, 2)) if s["use_bmm"] else x @ x.transpose(1, 2)) / x.shape[-1]
            return torch.bmm(scores.softmax(dim=-1), x) if s["use_bmm"] else scores.softmax(dim=-1) @ x
        if kind == "reduce_hidden":
            reduced = x.sum(dim=-1, keepdim=True) if s["how"] == "sum" else x.mean(dim=-1, keepdim=True)
            return x - reduced / 2
        if kind == "reduce_tokens":
            reduced = x.sum(dim=1, keepdim=True) if s["how"] == "sum" else x.mean(dim=1, keepdim=True)
            return x + reduced / 2
        if kind == "max_hidden":
            return x - x.amax(dim=-1, keepdim=True)
        if kind == "center":  # a reduction over every dim, broadcast back
            return x - x.mean()
        if kind == "transpose":  # there and back, with an op in between so the views stay
            flipped = x.transpose(1, 2)
            flipped = flipped.contiguous() * 2 if s["contiguous"] else flipped * 2
            return flipped.transpose(1, 2)
        if kind == "permute":
            return (x.permute(2, 0, 1) * 0.5).permute(1, 2, 0)
        if kind == "split_cat":
            first, second = torch.split(x, [s["first"], x.shape[-1] - s["first"]], dim=-1)
            return torch.cat([second, torch.relu(first)], dim=-1)
        if kind == "reshape":
            batch, tokens, hidden = x.shape
            if s["flatten_batch"]:  # (B*T, H): what a linear on a 2-D view sees
                return torch.tanh(x.reshape(batch * tokens, hidden)).view(batch, tokens, hidden)
            factor = s["factor"]
            split = x.reshape(batch, tokens, factor, hidden // factor)
            return (split * split.flip(2)).reshape(batch, tokens, hidden)
        if kind == "conv1d":
            return self.op(x.transpose(1, 2)).transpose(1, 2)
        if kind == "conv2d":  # (B, H, T, 1): a conv over the tokens
            return self.op(x.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        raise ValueError(f"unknown body step {kind!r}")

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        heads = self.s["heads"]
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        q, k, v = (t.view(batch, tokens, heads, hidden // heads).transpose(1, 2) for t in (q, k, v))
        if self.kind == "attention":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.s["causal"])
        else:
            scores = q @ k.transpose(-2, -1) / (hidden // heads) ** 0.5
            if self.s["causal"]:
                mask = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
            y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, hidden))


class RandomModel(nn.Module):
    """Stem, body steps and a loss head drawn from ``recipe(seed)``; ``forward`` is the loss."""

    def __init__(self, plan: Recipe) -> None:
        super().__init__()
        self.recipe = plan
        self.stem = Stem(plan.stem)
        self.body = nn.ModuleList(Body(step) for step in plan.body)
        head = plan.head.settings
        self.head_kind = plan.head.kind
        self.head = nn.Linear(head["hidden"], head.get("classes", head.get("outputs")))
        if head.get("tied"):
            self.head.weight = self.stem.op.weight

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.stem(inputs)
        for step in self.body:
            x = step(x)
        if self.head_kind == "token_classes":  # mean over every token of the batch
            logits = self.head(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if self.head_kind == "sample_classes":
            return F.cross_entropy(self.head(x.mean(dim=1)), targets)
        return F.mse_loss(self.head(x), targets)


def _inputs(plan: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch for ``plan``: the stem's input and the head's targets."""
    b, t, stem = plan.batch, plan.tokens, plan.stem.settings
    inputs = {
        "embedding": lambda: torch.randint(0, stem.get("vocab", 1), (b, t)),
        "linear": lambda: torch.randn(b, t, stem.get("features", 1)),
        "conv1d": lambda: torch.randn(b, stem.get("channels", 1), t),
        "conv2d": lambda: torch.randn(b, stem.get("channels", 1), stem.get("side", 1), stem.get("side", 1)),
    }[plan.stem.kind]()
    head = plan.head.settings
    if plan.head.kind == "token_classes":
        targets = torch.randint(0, head["classes"], (b, t))
    elif plan.head.kind == "sample_classes":
        targets = torch.randint(0, head["classes"], (b,))
    else:
        targets = torch.randn(b, t, head["outputs"])
    return inputs, targets


def build(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The random model of ``seed`` and one global batch: ``model(*inputs)`` is the loss.

    Args:
        seed: picks the structure and sizes (the same seed, the same model).

    Returns:
        ``(model, (inputs, targets))``; tensors follow the ambient ``torch.device``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    plan = recipe(seed)
    return RandomModel(plan), _inputs(plan)


if __name__ == "__main__":
    chosen = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    print(recipe(chosen))
    torch.manual_seed(0)
    model, batch = build(chosen)
    print(f"loss {model(*batch).item():.4f}")
