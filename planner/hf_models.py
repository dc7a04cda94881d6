"""``hf:<model_type>`` specs: a HuggingFace model built offline from its config, and one batch.

The model comes from ``transformers.AutoConfig.for_model(model_type, **overrides)`` (never
downloaded) and the Auto class that fits the config's task, tried in this order:

- encoder-decoder configs (t5, bart, ...): ``AutoModelForSeq2SeqLM`` with ``input_ids``,
  ``labels`` (``target_len`` tokens, default ``seq_len``) and ``decoder_input_ids`` (the
  labels shifted right behind the decoder's start token);
- decoders and encoders (gpt2, llama, bert, ...): ``AutoModelForMaskedLM``, else
  ``AutoModelForCausalLM``, with ``input_ids`` and ``labels`` (the same tokens; causal
  heads shift them);
- image classifiers (vit, convnext, resnet, ...): ``AutoModelForImageClassification`` with
  ``pixel_values`` (``num_channels`` x ``image_size`` x ``image_size``, from the config) and
  class ``labels`` below ``num_labels``;
- anything else: ``AutoModel`` with ``input_ids`` (its loss is a surrogate, see
  ``planner.model_loss.extract_loss``).

Encoders such as BERT are in both LM mappings (their causal head is a decoder variant that
warns without ``is_decoder``); for them the masked LM, their usual objective, comes first.

Overrides set config fields, except the batch's shape: ``batch_size``, ``seq_len``,
``target_len`` (seq2seq labels; default ``seq_len``) and ``image_size`` (when the config has
no such field, e.g. ResNet), and ``attn_implementation`` (default ``"sdpa"`` when the model
supports it, else ``"eager"``). A dotted key sets a field of a sub-config
(``text_config.hidden_size=64``): the sub-config is rebuilt from its class with the given
fields, its defaults for the rest.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from planner.errors import SpecError
from planner.messages import did_you_mean, exception_line, settings_text

__all__ = ["HF_DEFAULT_BATCH_SIZE", "HF_DEFAULT_SEQ_LEN", "build_hf"]

# Shape of the random input_ids of an hf: spec when the user sets neither; small enough
# that a CPU forward of a tiny config takes milliseconds, long enough to exercise attention.
HF_DEFAULT_BATCH_SIZE = 2
HF_DEFAULT_SEQ_LEN = 32
# Side of the square images of a vision model whose config names no image size (ResNet):
# what such models are pretrained on.
HF_DEFAULT_IMAGE_SIZE = 224
# Offered when an hf: model type is unknown and nothing is spelled like it.
_POPULAR_HF_TYPES = ("gpt2", "llama", "mistral", "qwen2", "bert", "roberta", "t5", "vit", "gpt_neox")

SEQ2SEQ, CAUSAL, MASKED, IMAGE, BASE = "seq2seq", "causal", "masked", "image", "base"


def build_hf(model_type: str, overrides: dict[str, Any], device: torch.device) -> tuple[nn.Module, tuple, dict]:
    """Build ``hf:<model_type>`` with ``overrides`` under ``torch.device(device)``.

    Returns:
        ``(model, (), kwargs)``: the model in training mode and one global batch of keyword
        inputs with labels (see the module docstring).

    Raises:
        SpecError: transformers is missing, the type is unknown, an override is not a field,
            the config is invalid, or the batch does not fit the model.
    """
    try:
        import transformers
    except ImportError as exc:
        raise SpecError(f"hf:{model_type} needs the transformers package; pip install 'soap-planner[hf]'") from exc
    _check_known(model_type)
    where = f"hf:{model_type}"
    overrides = dict(overrides)
    batch_size = _positive_int(overrides.pop("batch_size", HF_DEFAULT_BATCH_SIZE), "batch_size", where)
    shape = {key: overrides.pop(key) for key in ("seq_len", "target_len") if key in overrides}
    attn_implementation = overrides.pop("attn_implementation", None)

    with _quiet_transformers(transformers):
        default = _default_config(transformers, model_type, where)
        if "image_size" in overrides and not hasattr(default, "image_size"):
            shape["image_size"] = overrides.pop("image_size")  # a batch shape for this config
        config = _hf_config(transformers, model_type, default, overrides, where)
        if hasattr(config, "use_cache"):
            # Training never reuses past keys/values; a cache only costs memory and graph nodes.
            config.use_cache = False
        task = hf_task(config)
        if task is None:
            raise SpecError(
                f"{where} has no seq2seq, causal-LM, masked-LM, image-classification or base AutoModel class; "
                f"hf: specs need one of them, use a file spec with your own factory instead"
            )
        model = _hf_model(_AUTO_CLASSES[task](transformers), config, attn_implementation, device, where)
    if torch.device(device).type == "meta":
        # Legacy constructors ignore the default device (XLNet's nn.Parameter(torch.FloatTensor(
        # ...))): such weights land on the CPU, and a meta forward then mixes devices.
        model.to("meta")
    model.train()  # a training planner: dropout and friends as in training
    with torch.device(device):
        kwargs = _inputs(task, config, batch_size, shape, where)
    return model, (), kwargs


def hf_task(config: Any) -> str | None:
    """Which task (and so which Auto class) an hf: spec builds for ``config``, or None."""
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False) and model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return SEQ2SEQ
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return MASKED
    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return CAUSAL
    if model_type in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return IMAGE
    if model_type in auto.MODEL_MAPPING_NAMES:
        return BASE
    return None


_AUTO_CLASSES = {
    SEQ2SEQ: lambda transformers: transformers.AutoModelForSeq2SeqLM,
    CAUSAL: lambda transformers: transformers.AutoModelForCausalLM,
    MASKED: lambda transformers: transformers.AutoModelForMaskedLM,
    IMAGE: lambda transformers: transformers.AutoModelForImageClassification,
    BASE: lambda transformers: transformers.AutoModel,
}


def _check_known(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    known = list(CONFIG_MAPPING_NAMES)
    close = difflib.get_close_matches(model_type, known, n=5)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    else:
        hint = "known types include " + ", ".join(name for name in _POPULAR_HF_TYPES if name in CONFIG_MAPPING_NAMES)
    raise SpecError(
        f"unknown HuggingFace model type {model_type!r}; {hint} "
        f"(all {len(known)} are keys of transformers' CONFIG_MAPPING_NAMES)"
    )


# ---------------------------------------------------------------------------- config


def _default_config(transformers: Any, model_type: str, where: str) -> Any:
    try:
        return transformers.AutoConfig.for_model(model_type)
    except Exception as exc:
        raise SpecError(f"{where}: transformers cannot create its default config: {exception_line(exc)}") from exc


def _hf_config(transformers: Any, model_type: str, default: Any, overrides: dict[str, Any], where: str) -> Any:
    """The config with ``overrides``; dotted keys rebuild the sub-config they name."""
    flat, nested = _split_dotted(overrides)
    # Configs swallow unknown keyword arguments silently, so a typo (n_layers for n_layer)
    # would build the default-size model; check names against the default config.
    for key in [*flat, *nested]:
        _check_field(default, key, where, key)
    for head, fields in nested.items():
        flat[head] = _sub_config(getattr(default, head), fields, f"{where} {head}", head)
    try:
        return transformers.AutoConfig.for_model(model_type, **_as_lists(flat))
    except Exception as exc:
        raise SpecError(f"{where}: invalid config override ({settings_text(overrides)}): {exception_line(exc)}") from exc


def _as_lists(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with tuples (how a ModelSpec keeps list overrides, hashable) as lists: the
    strictly typed configs of transformers 5 (Zamba's ``layers_block_type: list[str]``)
    refuse a tuple where they declare a list."""

    def as_list(value: Any) -> Any:
        return [as_list(item) for item in value] if isinstance(value, tuple) else value

    return {key: as_list(value) for key, value in fields.items()}


def _split_dotted(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``{"a": 1, "b.c": 2, "b.d.e": 3}`` -> ``({"a": 1}, {"b": {"c": 2, "d.e": 3}})``: the
    fields of this config, and the overrides of each sub-config by its name."""
    flat = {key: value for key, value in overrides.items() if "." not in key}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "." in key:
            head, rest = key.split(".", 1)
            nested.setdefault(head, {})[rest] = value
    return flat, nested


def _check_field(config: Any, key: str, where: str, full_key: str) -> None:
    if not _has_field(config, key):
        fields = sorted(set(config.to_dict()) | set(getattr(config, "attribute_map", {})))
        raise SpecError(f"{where} has no config field {full_key!r}{did_you_mean(key, fields)}; check the name")


def _has_field(config: Any, key: str) -> bool:
    """Whether ``config`` has the field ``key``, per-layer fields of heterogeneous configs included.

    transformers 5.24's heterogeneous configs (Gemma 4's ``head_dim``, which its full-attention
    layers override) raise ``AmbiguousGlobalPerLayerAttributeError``, a ``RuntimeError``, when
    such a field is read globally, so ``hasattr`` raises instead of answering; the field is
    there all the same, and setting it globally is what an override means.
    """
    try:
        return hasattr(config, key)
    except RuntimeError:
        return key in (getattr(config, "per_layer_attributes", None) or ())


def _sub_config(default: Any, fields: dict[str, Any], where: str, prefix: str) -> Any:
    """A sub-config of ``default``'s class with ``fields`` set (dotted ones recursively)."""
    from transformers import PretrainedConfig

    if not isinstance(default, PretrainedConfig):
        raise SpecError(
            f"{where.split(' ')[0]}: '{prefix}' is not a sub-config (its value is of type {type(default).__name__}), so "
            f"'{prefix}.<field>' cannot be set; set '{prefix}' itself"
        )
    flat, nested = _split_dotted(fields)
    for key in [*flat, *nested]:
        _check_field(default, key, where.split(" ")[0], f"{prefix}.{key}")
    for head, inner in nested.items():
        flat[head] = _sub_config(getattr(default, head), inner, where, f"{prefix}.{head}")
    try:
        return type(default)(**_as_lists(flat))
    except Exception as exc:
        raise SpecError(f"{where}: invalid config override ({settings_text(fields)}): {exception_line(exc)}") from exc


# ----------------------------------------------------------------------------- model


def _hf_model(auto_class: Any, config: Any, attn_implementation: Any, device: torch.device, where: str) -> nn.Module:
    # SDPA is the attention the planner has rules and costs for; models that lack it raise
    # ValueError and are built with the eager implementation instead.
    choices = [attn_implementation] if attn_implementation is not None else ["sdpa", "eager"]
    if getattr(config, "architectures", []) is None:
        # Where the Auto mapping offers several classes (DeiT, LeViT: with and without a
        # distillation head), transformers iterates config.architectures, which a fresh config
        # holds as None; an empty list makes it take the mapping's first class, as intended.
        config.architectures = []
    failure: Exception | None = None
    for choice in choices:
        try:
            with torch.device(device):
                return auto_class.from_config(config, attn_implementation=choice)
        except ValueError as exc:
            failure = exc
        except Exception as exc:
            failure = exc
            break  # not an attention problem: a different implementation will not help
    # Every model has the eager implementation, so when it fails too the config is at fault.
    chosen = f" with attn_implementation={attn_implementation!r}" if attn_implementation is not None else ""
    raise SpecError(
        f"{where}: {auto_class.__name__}.from_config failed{chosen}: {exception_line(failure)}; check the config overrides"
    ) from failure


# ---------------------------------------------------------------------------- inputs


def _inputs(task: str, config: Any, batch_size: int, shape: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """One global batch for ``task`` (under the caller's ``torch.device``)."""
    if task == IMAGE:
        for key in ("seq_len", "target_len"):
            if key in shape:
                raise SpecError(f"{where} is an image model: {key} does not apply; set image_size (and batch_size)")
        return _image_inputs(config, batch_size, shape, where)
    if "image_size" in shape:
        raise SpecError(f"{where} has no config field 'image_size'; it is not an image model")
    seq_len = _positive_int(shape.get("seq_len", HF_DEFAULT_SEQ_LEN), "seq_len", where)
    _check_positions(config, "seq_len", seq_len, where)
    vocab_size = _hf_vocab_size(config, where)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    if task == SEQ2SEQ:
        target_len = _positive_int(shape.get("target_len", seq_len), "target_len", where)
        _check_positions(config, "target_len", target_len, where)
        decoder_vocab = getattr(config, "decoder_vocab_size", None)
        labels = torch.randint(0, min(vocab_size, decoder_vocab or vocab_size), (batch_size, target_len))
        # Teacher forcing: the decoder reads the labels shifted right behind a start token
        # (what the models do themselves from labels, where their config allows it).
        start = _decoder_start(config, vocab_size, where)
        decoder_input_ids = torch.cat([torch.full((batch_size, 1), start, dtype=labels.dtype), labels[:, :-1]], dim=1)
        return {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids, "labels": labels}
    if "target_len" in shape:
        raise SpecError(f"{where} is not an encoder-decoder model: target_len does not apply; set seq_len")
    if task == BASE:
        return {"input_ids": input_ids}
    # Labels equal to the inputs give the LM heads a loss (causal heads shift them
    # internally). A copy, not the same tensor, so tracing sees two distinct inputs.
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _image_inputs(config: Any, batch_size: int, shape: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    size = shape.get("image_size", _vision_field(config, "image_size", HF_DEFAULT_IMAGE_SIZE))
    if isinstance(size, (list, tuple)) and len(size) == 2:
        height, width = (_positive_int(side, "image_size", where) for side in size)
    else:
        height = width = _positive_int(size, "image_size", where)
    channels = _positive_int(_vision_field(config, "num_channels", 3), "num_channels", where)
    num_labels = _positive_int(getattr(config, "num_labels", 2), "num_labels", where)
    return {
        "pixel_values": torch.randn(batch_size, channels, height, width),
        "labels": torch.randint(0, num_labels, (batch_size,)),
    }


def _vision_field(config: Any, name: str, default: Any) -> Any:
    """A field of the config, or of its vision sub-config (CLIP, SigLIP), or ``default``."""
    for holder in (config, getattr(config, "vision_config", None)):
        value = getattr(holder, name, None) if holder is not None else None
        if value is not None:
            return value
    return default


def _check_positions(config: Any, name: str, length: int, where: str) -> None:
    max_positions = getattr(config, "max_position_embeddings", None)
    # XLNet's -1 means no limit (relative positions only): only a positive value bounds the length.
    if isinstance(max_positions, int) and 0 < max_positions < length:
        raise SpecError(
            f"{where}: {name}={length} exceeds the model's max_position_embeddings={max_positions}; "
            f"lower {name} or raise max_position_embeddings"
        )


def _decoder_start(config: Any, vocab_size: int, where: str) -> int:
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None)
    start = 0 if start is None else start
    if not isinstance(start, int) or not 0 <= start < vocab_size:
        raise SpecError(
            f"{where}: the decoder start token {start!r} is outside the vocabulary of {vocab_size}; "
            f"set decoder_start_token_id (and pad_token_id) below vocab_size"
        )
    return start


def _hf_vocab_size(config: Any, where: str) -> int:
    vocab_size = getattr(config, "vocab_size", None)
    if not isinstance(vocab_size, int) and hasattr(config, "get_text_config"):
        vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise SpecError(
            f"{where} has no vocab_size to draw input_ids from; hf: specs support text, seq2seq and "
            f"image-classification models, use a file spec for others"
        )
    return vocab_size


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    # Tiny configs trip warnings that are noise here (e.g. GPT-2's bos_token_id 50256 lies
    # outside a 128-token vocabulary); errors still show.
    logging = transformers.utils.logging
    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)


def _positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: {name} must be a positive integer, got {value!r}; e.g. --set {name}=8")
    return value
