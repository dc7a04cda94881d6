"""Model specs: how to (re)build a model and one global batch of example inputs.

A plan must be able to rebuild its model anywhere: on a laptop under ``torch.device("meta")``
while planning, and inside every ``torchrun`` rank of the generated program. So a plan does
not store the model, it stores a :class:`ModelSpec`, a small JSON-able value with two forms:

``path/to/file.py[:factory]``
    A Python file with a factory (default ``build``) taking plain keyword arguments and
    returning ``(model, inputs)``: an ``nn.Module`` and a tuple/list of positional inputs or
    a dict of keyword inputs (a ``(model, args, kwargs)`` triple is accepted too). The
    inputs are one step's *global* batch, with the batch on dim 0 of every tensor.
    ``examples/gpt.py`` is the model to copy from.

``hf:<model_type>``
    A HuggingFace ``transformers`` model built from its default config
    (``AutoConfig.for_model``), never downloaded: a seq2seq, causal/masked LM or image
    classifier with a batch and labels to match (:mod:`planner.hf_models`). Overrides set
    config fields (``text_config.hidden_size=64`` a sub-config's), except the batch's shape
    (``batch_size``, ``seq_len``, ``target_len``, ``image_size``) and ``attn_implementation``.

Overrides (``--set key=value`` on the CLI, see :func:`parse_overrides`) are keyword arguments
of the factory, or config fields for ``hf:``. Every user mistake raises
:class:`planner.errors.SpecError` with a one-line message naming the problem and the fix.

This module imports nothing from ``planner`` but :mod:`planner.errors` and
:mod:`planner.messages` (generated programs import it inside ``torchrun`` without the rest of
the planner), and imports ``transformers`` only when an ``hf:`` spec is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import json
import os
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from planner.errors import SpecError, one_line
from planner.messages import did_you_mean, exception_line, settings_text, value_kind

OverrideScalar = Union[int, float, bool, str]
# A value, or a list of values (a tuple once checked, e.g. a vision config's depths).
OverrideValue = Union[OverrideScalar, tuple[OverrideScalar, ...]]

HF_PREFIX = "hf:"
DEFAULT_FACTORY = "build"


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to build it: a JSON-able value.

    Attributes:
        source: ``"path/to/file.py:factory"`` (``":factory"`` optional, default ``build``)
            or ``"hf:<model_type>"``.
        overrides: keyword arguments of the factory (or config fields for ``hf:``), stored
            as a plain dict of int/float/bool/str values.
    """

    source: str
    overrides: Mapping[str, OverrideValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise SpecError(
                f"model source must be 'path/to/file.py[:factory]' or 'hf:<model_type>', got {self.source!r}"
            )
        if "\x00" in self.source:  # no file name holds one; the OS refuses it with a ValueError
            raise SpecError(f"model source {self.source!r} contains a NUL character; point it at a Python file")
        if not isinstance(self.overrides, Mapping):
            raise SpecError(
                f"model overrides must be a mapping of name to value, got {type(self.overrides).__name__}"
            )
        # Frozen, so the canonical plain-dict copy (JSON-able, detached from the caller's
        # mapping) has to be written through object.__setattr__.
        object.__setattr__(self, "overrides", _checked_overrides(self.overrides))
        if self.is_hf:
            if not self.model_type:
                raise SpecError(
                    f"model source {self.source!r} names no model type; "
                    f"write it as 'hf:<model_type>', e.g. 'hf:gpt2'"
                )
        else:
            path, _ = _split_file_source(self.source)
            if not path.endswith(".py"):
                raise SpecError(
                    f"model source {self.source!r} is neither 'path/to/file.py[:factory]' nor 'hf:<model_type>'; "
                    f""
                    f"point it at a Python file, e.g. 'examples/gpt.py:build'"
                )

    def __hash__(self) -> int:
        # The dataclass hash would hash the overrides dict and fail; hash its items instead.
        return hash((self.source, tuple(sorted(self.overrides.items()))))

    # ----------------------------------------------------------------- parts of the source

    @property
    def is_hf(self) -> bool:
        """Whether this is an ``hf:<model_type>`` spec (else a file spec)."""
        return self.source.startswith(HF_PREFIX)

    @property
    def model_type(self) -> str | None:
        """The HuggingFace model type of an ``hf:`` spec, else None."""
        return self.source[len(HF_PREFIX) :].strip() if self.is_hf else None

    @property
    def path(self) -> Path | None:
        """The Python file of a file spec (as written, maybe relative), else None."""
        return None if self.is_hf else Path(_split_file_source(self.source)[0])

    @property
    def factory(self) -> str | None:
        """The factory name of a file spec (default ``build``), else None."""
        return None if self.is_hf else _split_file_source(self.source)[1]

    # ----------------------------------------------------------------------- build

    def build(self, device: str | torch.device = "cpu") -> tuple[nn.Module, tuple, dict]:
        """Build the model and one global batch of example inputs.

        Everything is created under ``with torch.device(device)``, so ``device="meta"``
        allocates no memory. Callers seed the RNG (``torch.manual_seed``) before calling:
        weights and inputs come from the global generator.

        Args:
            device: where to create parameters, buffers and inputs.

        Returns:
            ``(model, args, kwargs)``: ``model(*args, **kwargs)`` runs one training step's
            forward; :func:`extract_loss` turns its output into the loss.

        Raises:
            SpecError: the file, factory, overrides, model type or result is wrong.
        """
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise SpecError(
                f"cannot build {self.describe()} on device {device!r}: {exception_line(exc)}; "
                f"use a device such as 'cpu', 'meta' or 'cuda:0'"
            ) from exc
        if self.is_hf:
            from planner.hf_models import build_hf  # imports transformers: only for hf: specs

            return build_hf(self.model_type, dict(self.overrides), target)
        return _build_file(self, target)

    # ----------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form, ``{"source": ..., "overrides": {...}}``."""
        return {"source": self.source, "overrides": dict(self.overrides)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Rebuild a spec from :meth:`to_dict`'s output.

        Raises:
            SpecError: ``data`` is not a mapping, lacks ``source`` or has unknown keys.
        """
        if not isinstance(data, Mapping):
            raise SpecError(f"a model spec must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"source", "overrides"})
        if unknown:
            raise SpecError(
                f"model spec has unknown keys {unknown}; it takes only 'source' and 'overrides'"
            )
        if "source" not in data:
            raise SpecError("model spec has no 'source'; add e.g. \"source\": \"examples/gpt.py:build\"")
        return cls(source=data["source"], overrides=data.get("overrides") or {})

    def resolved(self, base_dir: str | os.PathLike | None = None) -> ModelSpec:
        """This spec with its file made absolute, so a plan saved elsewhere still finds it.

        Args:
            base_dir: directory a relative path is relative to (default: the current one).

        Returns:
            A spec whose source is ``"/abs/path/file.py:factory"``; ``hf:`` specs unchanged.
        """
        if self.is_hf:
            return self
        path, factory = _split_file_source(self.source)
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        absolute = (base / Path(path).expanduser()).resolve()
        return ModelSpec(source=f"{absolute}:{factory}", overrides=dict(self.overrides))

    def describe(self) -> str:
        """A short human-readable form, e.g. ``"examples/gpt.py:build (n_layer=4)"``."""
        head = self.source if self.is_hf else "{}:{}".format(*_split_file_source(self.source))
        if not self.overrides:
            return head
        settings = ", ".join(f"{key}={value}" for key, value in self.overrides.items())
        return f"{head} ({settings})"


def announce_import(spec: ModelSpec | None, why: str) -> None:
    """Say on stderr which model file is about to be imported, and why (``compile``,
    ``simulate`` and every compiled program import the file a plan names: running a plan
    someone else wrote runs that file, so the user sees its absolute path first). ``hf:``
    specs import no file of the plan's and say nothing."""
    if spec is None or spec.is_hf:
        return
    print(one_line(f"importing model file {Path(spec.path).expanduser().resolve()} ({why})"), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- overrides


def parse_overrides(items: Iterable[str]) -> dict[str, OverrideValue]:
    """Parse ``key=value`` strings (the CLI's ``--set``) into typed overrides.

    Values become int (``4``), float (``0.1``, ``1e-3``), bool (``true``/``false``, any
    case), a tuple of those (``[1, 1]``, JSON list syntax) or else stay str (``name=x``).
    A key is a Python identifier, or several joined by dots (``text_config.hidden_size``:
    a field of an ``hf:`` config's sub-config). A key given twice keeps its last value, as
    command-line options usually do.

    Args:
        items: strings such as ``["n_layer=4", "lr=0.1", "tie=true", "name=x"]``.

    Returns:
        ``{"n_layer": 4, "lr": 0.1, "tie": True, "name": "x"}``.

    Raises:
        SpecError: an item has no ``=``, an empty key or value, a key that is not a
            (dotted) Python identifier, or a list that is not a JSON list of numbers,
            booleans and strings.
    """
    overrides: dict[str, OverrideValue] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not sep:
            raise SpecError(f"override {item!r} has no '='; write it as key=value, e.g. n_layer=4")
        if not is_override_key(key):
            raise SpecError(
                f"override {item!r} has key {key!r}, which is not a Python identifier (or dotted ones, "
                f"e.g. text_config.hidden_size); write it as key=value, e.g. n_layer=4"
            )
        if not text:
            raise SpecError(f"override {item!r} has an empty value; write it as {key}=<value>")
        overrides[key] = _parse_value(text, key)
    return overrides


def is_override_key(key: Any) -> bool:
    """Whether ``key`` names an override: an identifier, or identifiers joined by dots."""
    return isinstance(key, str) and all(part.isidentifier() for part in key.split("."))


def _parse_value(text: str, key: str = "key") -> OverrideValue:
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(_is_scalar(item) for item in items):
            raise SpecError(
                f"override {key}={text} is not a list of numbers, booleans and strings; "
                f'write it in JSON, e.g. {key}=[1,1] or {key}=["a","b"]'
            )
        return tuple(items)
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    # Only things that look like numbers become floats: float() would also accept "nan",
    # "inf" and "infinity", which are more likely names than numbers here.
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
        return float(text)
    return text


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _checked_overrides(overrides: Mapping[str, Any]) -> dict[str, OverrideValue]:
    checked: dict[str, OverrideValue] = {}
    for key, value in overrides.items():
        if not is_override_key(key):
            raise SpecError(
                f"override name {key!r} is not a Python identifier (or dotted ones); "
                f"use names such as n_layer or text_config.hidden_size"
            )
        if isinstance(value, (list, tuple)) and all(_is_scalar(item) for item in value):
            value = tuple(value)  # hashable, and the same whether it came from JSON or Python
        elif not _is_scalar(value):
            raise SpecError(
                f"override {key}={value!r} is a {type(value).__name__}; "
                f"overrides must be int, float, bool, str or a list of those"
            )
        checked[key] = value
    return checked


# --------------------------------------------------------------------------- file specs


def _split_file_source(source: str) -> tuple[str, str]:
    """Split ``"path.py:factory"`` into path and factory (default ``build``).

    Only a trailing ``:identifier`` is a factory, so a Windows drive (``C:\\m.py``) stays
    part of the path.
    """
    path, sep, factory = source.rpartition(":")
    if sep and path and factory.isidentifier():
        return path, factory
    return source, DEFAULT_FACTORY


# Loaded model files by (absolute path, mtime, size): building the same spec twice reuses
# the module (its classes stay identical), while an edited file is loaded again.
_MODULE_CACHE: dict[tuple[str, int, int], types.ModuleType] = {}


def _build_file(spec: ModelSpec, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    path = Path(spec.path).expanduser()
    where = f"{spec.path}:{spec.factory}"
    if not path.is_file():
        raise SpecError(
            f"model file {str(spec.path)!r} does not exist (relative to {os.getcwd()}); "
            f"pass the path of a Python file, e.g. examples/gpt.py"
        )
    path = path.resolve()
    # The directory stays on sys.path while the factory runs too: factories may import
    # sibling modules lazily.
    with _on_sys_path(path.parent):
        module = _load_module(path)
        factory = getattr(module, spec.factory, None)
        if factory is None:
            raise SpecError(
                f"{spec.path} has no factory {spec.factory!r}; it defines {_callables_of(module)}; "
                f"name one as 'file.py:<factory>'"
            )
        if not callable(factory):
            raise SpecError(
                f"{where} is a {type(factory).__name__}, not a function; point the spec at a factory function"
            )
        _check_accepts(factory, spec.overrides, where)
        with torch.device(device):
            try:
                result = factory(**spec.overrides)
            except SpecError:
                raise
            except Exception as exc:
                raise SpecError(
                    f"building {where} with {settings_text(spec.overrides)} failed: {exception_line(exc)} "
                    f"(fix the factory or the overrides)"
                ) from exc
    model, args, kwargs = _normalise_result(result, where)
    _check_device(model, args, kwargs, device, where)
    return model, args, kwargs


@contextlib.contextmanager
def _on_sys_path(directory: Path) -> Iterator[None]:
    entry = str(directory)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _load_module(path: Path) -> types.ModuleType:
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key in _MODULE_CACHE:
        return _MODULE_CACHE[key]
    # A name unique per file (two files named model.py must not collide) and stable per
    # file, so reloading an edited file replaces its old module.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_soap_model_{stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"cannot load {path} as a Python module; give the model file a .py name")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it: dataclasses and pickling look classes up by module
    # name, and inspect.getsource (readable generated code) finds the file through it.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise SpecError(f"cannot load model file {path}: {exception_line(exc)}; fix the file") from exc
    _MODULE_CACHE[key] = module
    return module


def _callables_of(module: types.ModuleType) -> str:
    names = [
        name
        for name, value in vars(module).items()
        if callable(value)
        and not name.startswith("_")
        and getattr(value, "__module__", None) == module.__name__
    ]
    return ", ".join(names) if names else "no public functions or classes"


def _check_accepts(factory: Any, overrides: Mapping[str, OverrideValue], where: str) -> None:
    """Reject overrides the factory cannot take, naming them, before calling it.

    Checking the signature first tells an unknown override apart from a TypeError raised
    by a bug inside the factory.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature: let the call decide
    parameters = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = [
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    if not takes_any:
        for key in overrides:
            if key not in named:
                raise SpecError(
                    f"{where} takes no override {key!r}{did_you_mean(key, named)}; "
                    f"it takes {', '.join(named) or 'none'}"
                )
    try:
        signature.bind(**overrides)
    except TypeError as exc:
        raise SpecError(
            f"{where} cannot be called with {settings_text(overrides)}: {exc}; "
            f"give its required arguments as overrides or defaults"
        ) from exc


def _normalise_result(result: Any, where: str) -> tuple[nn.Module, tuple, dict]:
    expected = "(nn.Module, tuple | list | dict)"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise SpecError(
            f"{where} returned {value_kind(result)}; a factory must return {expected}, e.g. `return model, (x, y)`"
        )
    model = result[0]
    if not isinstance(model, nn.Module):
        raise SpecError(
            f"{where} returned {value_kind(model)} as the model; "
            f"return an nn.Module first, as {expected}"
        )
    if len(result) == 3:
        args, kwargs = result[1], result[2]
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
            raise SpecError(
                f"{where} returned ({value_kind(model)}, {value_kind(args)}, {value_kind(kwargs)}); "
                f"a triple must be (nn.Module, tuple, dict)"
            )
    elif isinstance(result[1], dict):
        args, kwargs = (), result[1]
    elif isinstance(result[1], (tuple, list)):
        args, kwargs = result[1], {}
    else:
        raise SpecError(
            f"{where} returned {value_kind(result[1])} as the inputs; "
            f"return them as a tuple, e.g. `return model, (x,)`"
        )
    bad_keys = [key for key in kwargs if not isinstance(key, str)]
    if bad_keys:
        raise SpecError(
            f"{where} returned keyword inputs with non-string keys {bad_keys!r}; "
            f"use argument names"
        )
    return model, tuple(args), dict(kwargs)


# True inside parameters_on_meta(): a parameter on meta is then expected, not a factory's mistake.
_BUILDING_PARAMETERS_ON_META = False


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within this block, every parameter a module registers is moved to the meta device
    (buffers stay where they are built). Modules allocate a parameter with ``torch.empty``
    before registering it; that memory is never written, so it costs no resident pages, and
    their ``reset_parameters`` then runs on meta (no work). Generated programs build this way
    and then materialise only their shards (``codegen.runtime.materialize``)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    global _BUILDING_PARAMETERS_ON_META
    nn.Module.register_parameter = register_on_meta
    _BUILDING_PARAMETERS_ON_META = True
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        _BUILDING_PARAMETERS_ON_META = False


def _check_device(model: nn.Module, args: tuple, kwargs: dict, device: torch.device, where: str) -> None:
    """Check that the factory honoured ``torch.device(device)``.

    A tensor created with an explicit ``device="cpu"`` would allocate real memory while
    planning on meta, and land on the wrong device inside torchrun.
    """
    named: list[tuple[str, Any]] = [*model.named_parameters(), *model.named_buffers()]
    named += [(f"input {index}", value) for index, value in enumerate(args)]
    named += [(f"input {key!r}", value) for key, value in kwargs.items()]
    for name, value in named:
        if _BUILDING_PARAMETERS_ON_META and isinstance(value, nn.Parameter) and value.device.type == "meta":
            continue
        if isinstance(value, torch.Tensor) and value.device.type != device.type:
            raise SpecError(
                f"{where} created {name} on {value.device} while building on {device}; create tensors "
                f"with factory functions and no explicit device= so they follow torch.device(...)"
            )
