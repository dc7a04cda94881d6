"""Switch off the randomness of a training step, for ``launch.py --check``.

A sharded step and a single-device step draw different random numbers (different shapes,
different generators per rank), so parity can only be checked with randomness off. Dropout
hides in three places, and each is switched off here:

- ``nn.Dropout`` modules (and their kin): ``p`` is set to 0, as ``eval()`` would do for them
  alone; so are stochastic-depth modules (``DropPath``, ``StochasticDepth``: timm's,
  torchvision's and HuggingFace's name them so), whose float drop probability is set to 0;
- functional dropout, ``F.dropout(x, self.p, self.training)`` with ``p`` a float attribute
  (HuggingFace's seq2seq models), and the ATen dropout ops a graph program calls;
- attention's ``dropout_p`` (``F.scaled_dot_product_attention``, and the ATen op).

The last two are calls, not modules: :class:`NoDropout`, a ``TorchFunctionMode``, rewrites
them while it is active (dropout runs with ``training=False``, i.e. as the identity;
attention with ``dropout_p=0``), on plain tensors and on DTensors alike, so the reference
run and the sharded run (eager model, DDP/FSDP, or a generated graph program) are switched
off the same way. Random ops that are not dropout (``torch.rand`` in a forward) cannot be
switched off without changing the model; they are counted and named, so a failed check
says why.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["NoDropout", "RandomnessReport", "switch_off_dropout_modules"]

# Stochastic depth: a module of such a class name drops whole samples with the probability
# held in one of these float attributes.
_DROP_PATH_CLASS = re.compile(r"drop_?path|stochastic_?depth", re.IGNORECASE)
_DROP_PATH_ATTRIBUTES = ("drop_prob", "p", "drop_rate", "drop_path_rate", "prob")

# Dropout functions: identity when called with training=False. Value: the position of their
# ``training`` argument (after input and p) and its keyword.
_DROPOUT_FUNCTIONS: dict[Any, tuple[int, str]] = {
    function: (2, keyword)
    for function, keyword in (
        (F.dropout, "training"),
        (F.dropout1d, "training"),
        (F.dropout2d, "training"),
        (F.dropout3d, "training"),
        (F.alpha_dropout, "training"),
        (F.feature_alpha_dropout, "training"),
        (getattr(torch, "dropout", None), "train"),
        (getattr(torch, "alpha_dropout", None), "train"),
        (getattr(torch, "feature_dropout", None), "train"),
        (getattr(torch, "feature_alpha_dropout", None), "train"),
        (getattr(torch, "native_dropout", None), "train"),
        (torch.ops.aten.dropout.default, "train"),
        (torch.ops.aten.native_dropout.default, "train"),
        (torch.ops.aten.feature_dropout.default, "train"),
        (torch.ops.aten.alpha_dropout.default, "train"),
        (torch.ops.aten.feature_alpha_dropout.default, "train"),
    )
    if function is not None
}
# Attention ops: the position and keyword of their ``dropout_p`` argument.
_ATTENTION_FUNCTIONS: dict[Any, tuple[int, str]] = {
    F.scaled_dot_product_attention: (4, "dropout_p"),
    torch.ops.aten.scaled_dot_product_attention.default: (4, "dropout_p"),
}
# Random ops that are not dropout: counted, not changed.
_RANDOM_NAMES = frozenset(
    {
        "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
        "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
        "log_normal_", "cauchy_", "random_", "poisson", "rrelu",
    }
)


@dataclass
class RandomnessReport:
    """What was switched off, and what could not be."""

    dropout_modules: int = 0
    drop_path_modules: int = 0
    functional_dropout_calls: int = 0
    attention_dropout_calls: int = 0
    other_random_calls: Counter = field(default_factory=Counter)

    def line(self) -> str:
        """One line for ``--check``'s output, e.g. ``--check: switched off randomness: 12
        nn.Dropout modules, 2 functional dropout calls, attention dropout_p in 4 SDPA calls``."""
        parts = []
        if self.dropout_modules:
            parts.append(f"{self.dropout_modules} nn.Dropout module{'s' * (self.dropout_modules != 1)}")
        if self.drop_path_modules:
            parts.append(f"{self.drop_path_modules} drop-path module{'s' * (self.drop_path_modules != 1)}")
        if self.functional_dropout_calls:
            n = self.functional_dropout_calls
            parts.append(f"{n} functional dropout call{'s' * (n != 1)}")
        if self.attention_dropout_calls:
            n = self.attention_dropout_calls
            parts.append(f"attention dropout_p in {n} SDPA call{'s' * (n != 1)}")
        line = f"--check: switched off randomness: {', '.join(parts)}" if parts else "--check: no dropout found to switch off"
        if self.other_random_calls:
            named = ", ".join(f"{name} x{count}" for name, count in sorted(self.other_random_calls.items()))
            line += f"; random ops left on (they cannot be switched off, parity may fail): {named}"
        return line


def switch_off_dropout_modules(model: torch.nn.Module) -> RandomnessReport:
    """Set ``p = 0`` on every dropout module of ``model`` that had ``p > 0``, and the drop
    probability of every stochastic-depth module to 0; returns how many of each."""
    report = RandomnessReport()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p > 0:
                module.p = 0.0
                report.dropout_modules += 1
        elif _DROP_PATH_CLASS.search(type(module).__name__):
            switched = False
            for name in _DROP_PATH_ATTRIBUTES:
                value = getattr(module, name, None)
                if isinstance(value, float) and not isinstance(value, bool) and value > 0:
                    setattr(module, name, 0.0)
                    switched = True
            report.drop_path_modules += switched
    return report


class NoDropout(TorchFunctionMode):
    """While active: dropout calls run as the identity, attention runs with ``dropout_p=0``.

    Args:
        report: where calls that had randomness on are counted (when ``counting``).
        counting: count into ``report`` (the reference run counts; the sharded run, which
            makes the same calls again, does not).
    """

    def __init__(self, report: RandomnessReport | None = None, counting: bool = True) -> None:
        super().__init__()
        self.report = report if report is not None else RandomnessReport()
        self.counting = counting

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - TorchFunctionMode's API
        kwargs = dict(kwargs or {})
        if func in _DROPOUT_FUNCTIONS:
            position, keyword = _DROPOUT_FUNCTIONS[func]
            args, kwargs, was = _replace(args, kwargs, position, keyword, False, default=True)
            if was and self.counting and _probability(args, kwargs) > 0:
                self.report.functional_dropout_calls += 1
        elif func in _ATTENTION_FUNCTIONS:
            position, keyword = _ATTENTION_FUNCTIONS[func]
            args, kwargs, was = _replace(args, kwargs, position, keyword, 0.0, default=0.0)
            if was and self.counting:
                self.report.attention_dropout_calls += 1
        elif self.counting and _random_name(func) is not None:
            self.report.other_random_calls[_random_name(func)] += 1
        return func(*args, **kwargs)


def _replace(args: tuple, kwargs: dict, position: int, keyword: str, value: Any, default: Any) -> tuple[tuple, dict, Any]:
    """``args``/``kwargs`` with the argument at ``position`` (or ``keyword``) set to ``value``;
    also returns what it was (``default`` when not given)."""
    if len(args) > position:
        was = args[position]
        args = (*args[:position], value, *args[position + 1 :])
    else:
        was = kwargs.get(keyword, default)
        kwargs[keyword] = value
    return args, kwargs, was


def _probability(args: tuple, kwargs: dict) -> float:
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    return float(p) if isinstance(p, (int, float)) else 1.0


def _random_name(func: Any) -> str | None:
    name = getattr(func, "__name__", None)
    if isinstance(func, torch._ops.OpOverload):
        name = func._schema.name.split("::")[-1]
    return name if name in _RANDOM_NAMES else None
