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

The last two are calls, not modules. :class:`NoDropout`, a ``TorchFunctionMode``, rewrites
them while it is active (dropout runs with ``training=False``, i.e. as the identity;
attention with ``dropout_p=0``), on plain tensors and on DTensors alike, and while the
reference step runs it finds the float attribute each probability came from (the module
calling it holds it: ``self.dropout``, ``module.attention_dropout``). Those attributes are
then set to 0 in the model the sharded step runs, and graph programs read them at run time
(``DROPOUT_MODULES``), so no rewriting is left to do there. That matters: a mode is not
active when backward recomputes a checkpointed block, so a rewritten forward and its
recomputation would differ. Random ops that are not dropout (``torch.rand`` in a forward)
cannot be switched off without changing the model; they are counted and named, so a failed
check says why.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["NoDropout", "RandomnessReport", "switch_off_dropout_attributes", "switch_off_dropout_modules"]

# Frames above a dropout call searched for the module whose attribute holds its probability
# (HuggingFace: the attention module -> sdpa_attention_forward(module, ...) -> the call).
_FRAMES_SEARCHED = 8
_DROPOUT_ATTRIBUTE = re.compile(r"drop|^p$")
_ATTENTION_NAME = re.compile(r"attn|attention")

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
    dropout_attributes: int = 0
    functional_dropout_calls: int = 0
    attention_dropout_calls: int = 0
    other_random_calls: Counter = field(default_factory=Counter)
    # Random ops the sharded step ran that the reference step did not: a graph program
    # replays the traced random ops whatever the modules' probabilities are now (drop path's
    # torch.rand; its keep probability, though, is read at run time, codegen.graph_facts).
    program_only_random_ops: tuple[str, ...] = ()

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
        if self.dropout_attributes:
            n = self.dropout_attributes
            parts.append(f"{n} float dropout attribute{'s' * (n != 1)} set to 0")
        line = f"--check: switched off randomness: {', '.join(parts)}" if parts else "--check: no dropout found to switch off"
        if self.other_random_calls:
            named = ", ".join(f"{name} x{count}" for name, count in sorted(self.other_random_calls.items()))
            line += f"; random ops left on (they cannot be switched off, parity may fail): {named}"
        if self.program_only_random_ops:
            line += (
                f"; random ops only the sharded program ran (a graph program replays the traced random ops: drop "
                f"path reads its probability at run time, other randomness cannot be switched off, parity may fail): "
                f"{', '.join(self.program_only_random_ops)}"
            )
        return line

    def note_program_random_ops(self, program_run: "RandomnessReport") -> None:
        """Record the random ops of the sharded step (``program_run``, a ``NoDropout(counting=False)``
        report) that the reference step did not run."""
        self.program_only_random_ops = tuple(sorted(set(program_run.other_random_calls) - set(self.other_random_calls)))


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
        counting: count switched-off dropout into ``report`` and find the attributes the
            probabilities came from (the reference run does; the sharded run, which makes the
            same calls, does not). Other random ops are counted either way, so the sharded
            run's can be compared with the reference's (``note_program_random_ops``).
    """

    def __init__(self, report: RandomnessReport | None = None, counting: bool = True) -> None:
        super().__init__()
        self.report = report if report is not None else RandomnessReport()
        self.counting = counting
        self._attributes: dict[tuple[int, str], torch.nn.Module] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - TorchFunctionMode's API
        kwargs = dict(kwargs or {})
        if func in _DROPOUT_FUNCTIONS:
            position, keyword = _DROPOUT_FUNCTIONS[func]
            p = _probability(args, kwargs)
            if p > 0 and _argument(args, kwargs, position, keyword, True):
                args, kwargs = _replace(args, kwargs, position, keyword, False)
                if self.counting:
                    self.report.functional_dropout_calls += 1
                    self._find_attribute(p, attention=False)
        elif func in _ATTENTION_FUNCTIONS:
            position, keyword = _ATTENTION_FUNCTIONS[func]
            p = _argument(args, kwargs, position, keyword, 0.0)
            if isinstance(p, (int, float)) and p > 0:
                args, kwargs = _replace(args, kwargs, position, keyword, 0.0)
                if self.counting:
                    self.report.attention_dropout_calls += 1
                    self._find_attribute(p, attention=True)
        elif _random_name(func) is not None:  # cheap: counted in the sharded run too (note_program_random_ops)
            self.report.other_random_calls[_random_name(func)] += 1
        return func(*args, **kwargs)

    def _find_attribute(self, p: float, attention: bool) -> None:
        """Remember the float attribute ``p`` was read from: one of a module found as ``self``
        or ``module`` in the frames that led to this call, whose name says dropout (or is
        ``p``); for attention, names that say attention first, for other dropout the others."""
        frame = sys._getframe(2)
        for _ in range(_FRAMES_SEARCHED):
            if frame is None:
                return
            for local in ("self", "module"):
                module = frame.f_locals.get(local)
                if not isinstance(module, torch.nn.Module):
                    continue
                names = [
                    name
                    for name, held in vars(module).items()
                    if isinstance(held, float) and math.isclose(held, p) and _DROPOUT_ATTRIBUTE.search(name)
                ]
                if names:
                    name = min(names, key=lambda name: (bool(_ATTENTION_NAME.search(name)) != attention, name))
                    self._attributes[(id(module), name)] = module
                    return
            frame = frame.f_back

    def attributes_in(self, model: torch.nn.Module) -> list[tuple[str, str]]:
        """``(module path, attribute)`` of every probability attribute found, for the modules
        of ``model`` (the reference run's model)."""
        paths = {id(module): path for path, module in model.named_modules()}
        return sorted((paths[key[0]], key[1]) for key in self._attributes if key[0] in paths)


def switch_off_dropout_attributes(model: torch.nn.Module, attributes: list[tuple[str, str]], report: RandomnessReport) -> None:
    """Set each ``(module path, attribute)`` of ``model`` to 0.0 (the probabilities
    ``NoDropout`` found), counting them into ``report``."""
    for path, name in attributes:
        module = model.get_submodule(path)
        if isinstance(getattr(module, name, None), float) and getattr(module, name) > 0:
            setattr(module, name, 0.0)
            report.dropout_attributes += 1


def _argument(args: tuple, kwargs: dict, position: int, keyword: str, default: Any) -> Any:
    return args[position] if len(args) > position else kwargs.get(keyword, default)


def _replace(args: tuple, kwargs: dict, position: int, keyword: str, value: Any) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the argument at ``position`` (or ``keyword``) set to ``value``."""
    if len(args) > position:
        return (*args[:position], value, *args[position + 1 :]), kwargs
    return args, {**kwargs, keyword: value}


def _probability(args: tuple, kwargs: dict) -> float:
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    return float(p) if isinstance(p, (int, float)) else 1.0


def _random_name(func: Any) -> str | None:
    name = getattr(func, "__name__", None)
    if isinstance(func, torch._ops.OpOverload):
        name = func._schema.name.split("::")[-1]
    return name if name in _RANDOM_NAMES else None
