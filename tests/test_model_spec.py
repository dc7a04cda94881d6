"""Tests of model specs (planner/model_spec.py) and the example models (examples/*.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.errors import SpecError
from planner.model_loss import extract_loss
from planner.model_spec import ModelSpec, parse_overrides

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_NAMES = ["mlp", "gpt", "cnn"]

TINY_HF = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64},
    "llama": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    },
    "bert": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "vocab_size": 128,
    },
}


def example_spec(name: str, **overrides) -> ModelSpec:
    return ModelSpec(str(EXAMPLES / f"{name}.py"), overrides)


def write_model_file(tmp_path: Path, body: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text("import torch\nfrom torch import nn\n\n" + body)
    return path


# ------------------------------------------------------------------------------ examples


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_builds_on_cpu_and_trains(name):
    torch.manual_seed(0)
    model, args, kwargs = example_spec(name).build("cpu")
    assert kwargs == {}
    assert len(args) == 2
    batch = args[0].shape[0]
    assert all(arg.shape[0] == batch for arg in args), "dim 0 of every input is the batch"
    loss = model(*args)
    assert loss.dim() == 0 and loss.is_floating_point()
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_builds_on_meta_without_allocating(name):
    model, args, _ = example_spec(name).build("meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert all(arg.is_meta for arg in args)
    loss = model(*args)  # shapes propagate on meta
    assert loss.is_meta and loss.dim() == 0


def test_example_loss_is_a_batch_mean():
    # Data-parallel gradient averaging is exact only if the loss is the mean of per-sample
    # losses: the loss of the full batch equals the mean of the two halves' losses.
    for name in EXAMPLE_NAMES:
        torch.manual_seed(0)
        model, args, _ = example_spec(name).build("cpu")
        halves = [tuple(arg.chunk(2)[part] for arg in args) for part in (0, 1)]
        full = model(*args)
        split = (model(*halves[0]) + model(*halves[1])) / 2
        assert full.item() == pytest.approx(split.item(), rel=1e-5), name


def test_example_overrides_apply():
    model, (idx, targets), _ = example_spec("gpt", n_layer=3, n_embd=32, batch_size=2, seq_len=8).build()
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 3
    assert idx.shape == targets.shape == (2, 8)
    assert idx.dtype == targets.dtype == torch.int64
    assert model.wte.weight.shape == (256, 32)

    model, (inputs, targets), _ = example_spec("mlp", layers=5, hidden=7, batch_size=3).build()
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 5
    assert inputs.shape == (3, 32) and targets.shape == (3, 8)

    model, (images, labels), _ = example_spec("cnn", image_size=8, num_classes=4, channels=1).build()
    assert images.shape == (8, 1, 8, 8) and labels.dtype == torch.int64
    assert model(images, labels).dim() == 0


def test_gpt2_small_size_on_meta():
    spec = example_spec(
        "gpt", n_layer=12, n_head=12, n_embd=768, vocab_size=50257, seq_len=1024, tie_weights=True
    )
    model, (idx, _), _ = spec.build("meta")
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small
    assert idx.shape == (8, 1024)


def test_example_rejects_bad_sizes():
    with pytest.raises(SpecError, match="n_head"):
        example_spec("gpt", n_embd=30, n_head=4).build("meta")
    with pytest.raises(SpecError, match="image_size"):
        example_spec("cnn", image_size=10).build("meta")


# ----------------------------------------------------------------------------- overrides


def test_parse_overrides_types():
    parsed = parse_overrides(["n_layer=4", "lr=0.1", "tie=true", "name=x", "off=FALSE", "eps=1e-5", " k = 3 "])
    assert parsed == {"n_layer": 4, "lr": 0.1, "tie": True, "name": "x", "off": False, "eps": 1e-5, "k": 3}
    assert type(parsed["n_layer"]) is int and type(parsed["lr"]) is float
    assert parse_overrides(["x=1", "x=2"]) == {"x": 2}
    assert parse_overrides(["act=nan", "neg=-2"]) == {"act": "nan", "neg": -2}
    assert parse_overrides([]) == {}


def test_parse_overrides_nested_keys_and_lists():
    parsed = parse_overrides(["text_config.hidden_size=64", "depths=[1, 2]", 'names=["a","b"]', "empty=[]"])
    assert parsed == {"text_config.hidden_size": 64, "depths": (1, 2), "names": ("a", "b"), "empty": ()}
    spec = ModelSpec("hf:gpt2", {"depths": [1, 2], "text_config.hidden_size": 64})
    assert spec.overrides["depths"] == (1, 2)  # lists become tuples: hashable, the same from JSON or Python
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert hash(ModelSpec.from_dict(spec.to_dict())) == hash(spec)


@pytest.mark.parametrize(
    "item, message",
    [
        ("n_layer", "no '='"), ("=4", "identifier"), ("a-b=1", "identifier"), ("n=", "empty value"),
        ("a.=1", "identifier"), (".b=1", "identifier"), ("depths=[1,", "JSON"), ("depths=[[1]]", "JSON"),
    ],
)
def test_parse_overrides_rejects_malformed(item, message):
    with pytest.raises(SpecError, match=message):
        parse_overrides([item])


def test_parsed_overrides_reach_the_factory():
    spec = example_spec("mlp", **parse_overrides(["layers=2", "batch_size=4"]))
    model, (inputs, _), _ = spec.build()
    assert inputs.shape[0] == 4
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 2


# ----------------------------------------------------------------------------- the value


def test_dict_round_trip_and_hash():
    spec = ModelSpec("examples/gpt.py:build", {"n_layer": 4, "dropout": 0.1, "tie_weights": True, "tag": "x"})
    data = spec.to_dict()
    assert data == {"source": "examples/gpt.py:build", "overrides": {"n_layer": 4, "dropout": 0.1, "tie_weights": True, "tag": "x"}}
    assert ModelSpec.from_dict(data) == spec
    assert hash(ModelSpec.from_dict(data)) == hash(spec)
    assert ModelSpec.from_dict({"source": "hf:gpt2"}) == ModelSpec("hf:gpt2")


def test_overrides_are_copied_into_a_plain_dict():
    overrides = {"n_layer": 2}
    spec = ModelSpec("examples/gpt.py", overrides)
    overrides["n_layer"] = 9
    assert spec.overrides == {"n_layer": 2} and type(spec.overrides) is dict


@pytest.mark.parametrize(
    "data, message",
    [
        ({"overrides": {}}, "no 'source'"),
        ({"source": "examples/gpt.py", "extra": 1}, "unknown keys"),
        ({"source": "examples/gpt.py", "overrides": {"n": {"a": 1}}}, "int, float, bool, str or a list"),
        ({"source": "examples/gpt.py", "overrides": {"n": [[1]]}}, "int, float, bool, str or a list"),
        ({"source": "examples/gpt.py", "overrides": {"a..b": 1}}, "identifier"),
        ({"source": "examples/gpt.py", "overrides": {"not a name": 1}}, "identifier"),
        ({"source": "model.txt"}, "neither"),
        ({"source": "hf:"}, "no model type"),
        ({"source": ""}, "must be"),
        (["source"], "JSON object"),
    ],
)
def test_invalid_specs_are_rejected(data, message):
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_dict(data)


def test_resolved_makes_file_paths_absolute(tmp_path):
    spec = ModelSpec("examples/gpt.py", {"n_layer": 4})
    resolved = spec.resolved(base_dir=tmp_path)
    assert resolved.source == f"{(tmp_path / 'examples' / 'gpt.py').resolve()}:build"
    assert Path(resolved.path).is_absolute() and resolved.factory == "build"
    assert resolved.overrides == {"n_layer": 4}
    assert ModelSpec("m.py:make").resolved().source == f"{Path.cwd().resolve() / 'm.py'}:make"
    assert ModelSpec("hf:gpt2").resolved() == ModelSpec("hf:gpt2")
    # A resolved spec still builds after changing directory.
    absolute = ModelSpec("examples/mlp.py").resolved(EXAMPLES.parent)
    assert absolute.build("meta")[0] is not None


def test_describe():
    assert ModelSpec("examples/gpt.py", {"n_layer": 4}).describe() == "examples/gpt.py:build (n_layer=4)"
    assert ModelSpec("examples/gpt.py:make").describe() == "examples/gpt.py:make"
    assert ModelSpec("hf:gpt2", {"n_layer": 2, "n_head": 4}).describe() == "hf:gpt2 (n_layer=2, n_head=4)"


def test_source_parts():
    spec = ModelSpec(r"C:\models\gpt.py")  # a drive letter is not a factory
    assert spec.factory == "build" and str(spec.path) == r"C:\models\gpt.py"
    spec = ModelSpec("dir/m.py:make_model")
    assert (str(spec.path), spec.factory, spec.is_hf, spec.model_type) == ("dir/m.py", "make_model", False, None)
    assert ModelSpec("hf:llama").model_type == "llama" and ModelSpec("hf:llama").path is None


# ---------------------------------------------------------------------- file spec errors


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        ModelSpec(str(tmp_path / "absent.py")).build()


def test_syntax_error_names_the_file(tmp_path):
    path = write_model_file(tmp_path, "def build(:\n    pass\n", "broken.py")
    with pytest.raises(SpecError, match=r"broken\.py.*SyntaxError"):
        ModelSpec(str(path)).build()


def test_import_error_names_the_file(tmp_path):
    path = write_model_file(tmp_path, "import no_such_module_xyz\n", "needs_dep.py")
    with pytest.raises(SpecError, match=r"needs_dep\.py.*ModuleNotFoundError"):
        ModelSpec(str(path)).build()


def test_missing_factory_lists_the_callables(tmp_path):
    path = write_model_file(tmp_path, "class Net(nn.Module):\n    pass\n\ndef make_model():\n    pass\n")
    with pytest.raises(SpecError, match=r"no factory 'build'.*Net, make_model") as info:
        ModelSpec(str(path)).build()
    assert "\n" not in str(info.value)
    with pytest.raises(SpecError, match="not a function"):
        write_model_file(tmp_path, "build = 3\n", "number.py")
        ModelSpec(str(tmp_path / "number.py")).build()


def test_unknown_override_is_named(tmp_path):
    with pytest.raises(SpecError, match=r"no override 'n_layers'.*did you mean 'n_layer'"):
        example_spec("gpt", n_layers=4).build("meta")
    path = write_model_file(tmp_path, "def build(size):\n    return nn.Linear(size, 1), (torch.randn(2, size),)\n")
    with pytest.raises(SpecError, match="required"):
        ModelSpec(str(path)).build()


def test_factory_errors_become_spec_errors(tmp_path):
    body = "def build(n=1):\n    raise TypeError('bad internal call')\n"
    path = write_model_file(tmp_path, body)
    with pytest.raises(SpecError, match="failed: TypeError: bad internal call"):
        ModelSpec(str(path), {"n": 2}).build()


@pytest.mark.parametrize(
    "returned, message",
    [
        ("nn.Linear(2, 2)", "returned a Linear"),
        ("(nn.Linear(2, 2),)", "returned a tuple"),
        ("('model', (torch.randn(2, 2),))", "as the model"),
        ("(nn.Linear(2, 2), torch.randn(2, 2))", "as the inputs"),
        ("(nn.Linear(2, 2), (), [])", "triple"),
    ],
)
def test_factory_result_is_checked(tmp_path, returned, message):
    path = write_model_file(tmp_path, f"def build():\n    return {returned}\n")
    with pytest.raises(SpecError, match=message):
        ModelSpec(str(path)).build()


def test_factory_result_forms(tmp_path):
    body = (
        "def as_dict():\n    return nn.Linear(2, 2), {'input': torch.randn(3, 2)}\n"
        "def as_list():\n    return nn.Linear(2, 2), [torch.randn(3, 2)]\n"
        "def as_triple():\n    return nn.Linear(2, 2), (torch.randn(3, 2),), {}\n"
    )
    path = write_model_file(tmp_path, body)
    model, args, kwargs = ModelSpec(f"{path}:as_dict").build()
    assert args == () and set(kwargs) == {"input"}
    assert model(**kwargs).shape == (3, 2)
    _, args, kwargs = ModelSpec(f"{path}:as_list").build()
    assert isinstance(args, tuple) and len(args) == 1 and kwargs == {}
    _, args, kwargs = ModelSpec(f"{path}:as_triple").build()
    assert len(args) == 1 and kwargs == {}


def test_tensor_ignoring_the_device_context_is_rejected(tmp_path):
    body = "def build():\n    return nn.Linear(2, 2), (torch.randn(3, 2, device='cpu'),)\n"
    path = write_model_file(tmp_path, body)
    with pytest.raises(SpecError, match="input 0 on cpu while building on meta"):
        ModelSpec(str(path)).build("meta")
    ModelSpec(str(path)).build("cpu")  # fine where the devices agree


def test_sibling_imports_work(tmp_path):
    (tmp_path / "layers_helper_xyz.py").write_text("from torch import nn\n\ndef head():\n    return nn.Linear(4, 1)\n")
    body = (
        "import layers_helper_xyz\n\n"
        "def build():\n    return layers_helper_xyz.head(), (torch.randn(2, 4),)\n"
    )
    path = write_model_file(tmp_path, body)
    model, _, _ = ModelSpec(str(path)).build()
    assert isinstance(model, nn.Linear)
    assert str(tmp_path) not in sys.path  # only while loading and building


def test_same_file_name_in_two_directories_does_not_collide(tmp_path):
    for width in (3, 5):
        folder = tmp_path / f"w{width}"
        folder.mkdir()
        write_model_file(folder, f"def build():\n    return nn.Linear({width}, 1), (torch.randn(2, {width}),)\n")
    first = ModelSpec(str(tmp_path / "w3" / "model.py")).build()[0]
    second = ModelSpec(str(tmp_path / "w5" / "model.py")).build()[0]
    assert (first.in_features, second.in_features) == (3, 5)


def test_bad_device(tmp_path):
    with pytest.raises(SpecError, match="device"):
        example_spec("mlp").build("not-a-device")


# ----------------------------------------------------------------------------------- hf


@pytest.mark.parametrize("model_type", sorted(TINY_HF))
def test_hf_tiny_models_build_and_give_a_loss(model_type):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    spec = ModelSpec(f"hf:{model_type}", {**TINY_HF[model_type], "batch_size": 3, "seq_len": 16})
    model, args, kwargs = spec.build("cpu")
    assert args == () and set(kwargs) == {"input_ids", "labels"}
    assert kwargs["input_ids"].shape == (3, 16) and kwargs["input_ids"].dtype == torch.int64
    assert torch.equal(kwargs["input_ids"], kwargs["labels"])
    assert model.training and model.config.use_cache is False
    assert model.config._attn_implementation == "sdpa"
    loss = extract_loss(model(**kwargs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()


def test_hf_xlnet_builds_on_meta_with_no_position_limit():
    # XLNet's max_position_embeddings is -1 (relative positions only): any seq_len is fine.
    pytest.importorskip("transformers")
    overrides = {"n_layer": 1, "d_model": 32, "n_head": 2, "d_inner": 64, "vocab_size": 64, "seq_len": 16}
    model, _, kwargs = ModelSpec("hf:xlnet", overrides).build("meta")
    assert model.config.max_position_embeddings == -1 and kwargs["input_ids"].shape == (2, 16)
    # XLNet makes its attention weights with torch.FloatTensor, which ignores the meta device.
    assert {parameter.device.type for parameter in model.parameters()} == {"meta"}


def test_hf_list_overrides_reach_strictly_typed_configs_as_lists():
    # A ModelSpec keeps list overrides as tuples; Zamba's config declares list[str] and
    # refuses a tuple.
    pytest.importorskip("transformers")
    overrides = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "attention_head_dim": 32, "vocab_size": 64, "mamba_d_state": 4,
                 "n_mamba_heads": 2, "use_mamba_kernels": False, "layers_block_type": ["mamba", "hybrid", "hybrid"]}
    model, _, _ = ModelSpec("hf:zamba", overrides).build("meta")
    assert model.config.layers_block_type[1:] == ["hybrid", "hybrid"]  # its name for "mamba" differs


def test_hf_builds_on_meta():
    pytest.importorskip("transformers")
    model, _, kwargs = ModelSpec("hf:llama", TINY_HF["llama"]).build("meta")
    assert all(p.is_meta for p in model.parameters())
    assert kwargs["input_ids"].is_meta
    assert kwargs["input_ids"].shape == (2, 32)  # the defaults


def test_hf_falls_back_to_eager_attention():
    pytest.importorskip("transformers")
    # OpenAI GPT has no SDPA implementation.
    spec = ModelSpec("hf:openai-gpt", {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64})
    model, _, _ = spec.build("meta")
    assert model.config._attn_implementation == "eager"


def test_hf_base_model_gets_a_surrogate_loss():
    pytest.importorskip("transformers")
    # CLIP's text tower has only a base AutoModel: no labels, and the loss is the surrogate.
    config = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "vocab_size": 64}
    model, _, kwargs = ModelSpec("hf:clip_text_model", config).build("cpu")
    assert set(kwargs) == {"input_ids"}
    output = model(**kwargs)
    assert output.get("loss") is None
    loss = extract_loss(output)
    assert loss.dim() == 0
    loss.backward()


def test_hf_errors():
    pytest.importorskip("transformers")
    with pytest.raises(SpecError, match=r"unknown HuggingFace model type 'gtp2'.*gpt2"):
        ModelSpec("hf:gtp2").build("meta")
    with pytest.raises(SpecError, match="known types include"):
        ModelSpec("hf:zzzzzzzz").build("meta")
    with pytest.raises(SpecError, match=r"no config field 'n_layers'.*'n_layer'"):
        ModelSpec("hf:gpt2", {"n_layers": 2}).build("meta")
    with pytest.raises(SpecError, match="invalid config override.*expected int") as info:
        ModelSpec("hf:gpt2", {"n_layer": "two"}).build("meta")
    assert "\n" not in str(info.value)
    with pytest.raises(SpecError, match=r"from_config failed: ValueError: .*divisible"):
        ModelSpec("hf:gpt2", {**TINY_HF["gpt2"], "n_embd": 30}).build("meta")
    with pytest.raises(SpecError, match="seq_len must be a positive integer"):
        ModelSpec("hf:gpt2", {"seq_len": 0}).build("meta")
    with pytest.raises(SpecError, match="max_position_embeddings"):
        ModelSpec("hf:gpt2", {**TINY_HF["gpt2"], "seq_len": 65}).build("meta")


def test_hf_per_layer_field_of_a_heterogeneous_config_is_a_field():
    transformers = pytest.importorskip("transformers")
    if "gemma4_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip("gemma4_text (a heterogeneous config) needs transformers >= 5.24")
    # Gemma 4's head_dim is a per-layer field (its full-attention layers override it): reading
    # it globally raises a RuntimeError, which once escaped the override check as a traceback.
    overrides = {**TINY_HF["llama"], "head_dim": 16, "vocab_size_per_layer_input": 128,
                 "hidden_size_per_layer_input": 16}
    model, _, _ = ModelSpec("hf:gemma4_text", overrides).build("meta")
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 16  # the sliding layer took head_dim=16
    with pytest.raises(SpecError, match=r"no config field 'head_dimm'.*'head_dim'"):
        ModelSpec("hf:gemma4_text", {"head_dimm": 16}).build("meta")


TINY_SEQ2SEQ = {
    "t5": {"num_layers": 1, "num_decoder_layers": 1, "d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16,
           "vocab_size": 64},
    "bart": {"encoder_layers": 1, "decoder_layers": 1, "d_model": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
             "encoder_attention_heads": 2, "decoder_attention_heads": 2, "max_position_embeddings": 32, "vocab_size": 64},
}


@pytest.mark.parametrize("model_type", sorted(TINY_SEQ2SEQ))
def test_hf_seq2seq_models_get_decoder_inputs_and_labels(model_type):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    spec = ModelSpec(f"hf:{model_type}", {**TINY_SEQ2SEQ[model_type], "batch_size": 3, "seq_len": 8, "target_len": 5})
    model, args, kwargs = spec.build("cpu")
    assert type(model).__name__.endswith(("ForConditionalGeneration",))
    assert args == () and set(kwargs) == {"input_ids", "decoder_input_ids", "labels"}
    assert kwargs["input_ids"].shape == (3, 8) and kwargs["labels"].shape == (3, 5)
    # Teacher forcing: the decoder reads the labels shifted right behind its start token.
    assert torch.equal(kwargs["decoder_input_ids"][:, 1:], kwargs["labels"][:, :-1])
    loss = extract_loss(model(**kwargs))
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.grad_fn is not None


TINY_VISION = {
    "vit": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "image_size": 16, "patch_size": 8, "num_labels": 5, "num_channels": 1},
    "resnet": {"depths": [1, 1], "hidden_sizes": [8, 16], "embedding_size": 8, "num_labels": 5, "image_size": 16},
    # Two classes in the Auto mapping (with and without a distillation head): transformers
    # chooses by config.architectures, which a fresh config holds as None.
    "deit": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "image_size": 16, "patch_size": 8, "num_labels": 5},
}


@pytest.mark.parametrize("model_type", sorted(TINY_VISION))
def test_hf_image_classifiers_get_pixels_and_class_labels(model_type):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = ModelSpec(f"hf:{model_type}", {**TINY_VISION[model_type], "batch_size": 4}).build("cpu")
    assert type(model).__name__.endswith("ForImageClassification")
    channels = 1 if model_type == "vit" else 3  # from the config (ResNet's default: 3)
    assert set(kwargs) == {"pixel_values", "labels"} and kwargs["pixel_values"].shape == (4, channels, 16, 16)
    assert kwargs["labels"].shape == (4,) and int(kwargs["labels"].max()) < 5
    loss = extract_loss(model(**kwargs))
    assert loss.dim() == 0 and loss.grad_fn is not None


def test_hf_nested_config_keys_set_sub_config_fields():
    pytest.importorskip("transformers")
    overrides = {
        "text_config.hidden_size": 48, "text_config.num_hidden_layers": 1, "text_config.vocab_size": 64,
        "text_config.intermediate_size": 64, "text_config.num_attention_heads": 2,
        "vision_config.hidden_size": 32, "vision_config.num_hidden_layers": 1, "vision_config.num_attention_heads": 2,
        "vision_config.image_size": 32, "vision_config.patch_size": 8,
    }
    model, _, kwargs = ModelSpec("hf:clip", overrides).build("meta")
    assert model.config.text_config.hidden_size == 48 and model.config.text_config.num_hidden_layers == 1
    assert model.config.vision_config.hidden_size == 32
    # CLIP is an image classifier here; its image size comes from the vision sub-config.
    assert type(model).__name__ == "CLIPForImageClassification" and kwargs["pixel_values"].shape == (2, 3, 32, 32)
    assert model.config.text_config.max_position_embeddings == 77  # the sub-config's default for the rest
    with pytest.raises(SpecError, match=r"no config field 'text_config.hiden_size'.*'hidden_size'"):
        ModelSpec("hf:clip", {"text_config.hiden_size": 48}).build("meta")
    with pytest.raises(SpecError, match=r"no config field 'txt_config'"):
        ModelSpec("hf:clip", {"txt_config.hidden_size": 48}).build("meta")
    with pytest.raises(SpecError, match=r"'n_layer' is not a sub-config"):
        ModelSpec("hf:gpt2", {"n_layer.x": 1}).build("meta")


def test_hf_batch_shape_keys_belong_to_their_task():
    pytest.importorskip("transformers")
    with pytest.raises(SpecError, match="image model: seq_len does not apply"):
        ModelSpec("hf:vit", {**TINY_VISION["vit"], "seq_len": 8}).build("meta")
    with pytest.raises(SpecError, match="not an encoder-decoder model: target_len"):
        ModelSpec("hf:gpt2", {**TINY_HF["gpt2"], "target_len": 8}).build("meta")
    with pytest.raises(SpecError, match="no config field 'image_size'"):
        ModelSpec("hf:gpt2", {**TINY_HF["gpt2"], "image_size": 8}).build("meta")


def test_hf_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(SpecError, match=r"pip install 'soap-planner\[hf\]'"):
        ModelSpec("hf:gpt2").build("meta")


def test_module_does_not_import_transformers():
    import subprocess

    code = "import sys, planner.model_spec; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=EXAMPLES.parent)
    assert result.stdout.strip() == "False"


# ----------------------------------------------------------------------------------- loss


class _WithLoss:
    def __init__(self, loss):
        self.loss = loss


def test_extract_loss_forms():
    scalar = torch.tensor(2.0)
    assert extract_loss(scalar) is scalar
    assert extract_loss({"loss": scalar, "logits": torch.ones(2)}) is scalar
    assert extract_loss(_WithLoss(scalar)) is scalar
    assert extract_loss((scalar, torch.ones(3))) is scalar
    # Surrogate: the mean of the first floating tensor, depth first.
    assert extract_loss(torch.tensor([1.0, 3.0])).item() == 2.0
    assert extract_loss({"loss": None, "hidden": (torch.arange(3), torch.tensor([4.0, 6.0]))}).item() == 5.0
    assert extract_loss([torch.tensor([[2.0]])]).item() == 2.0


def test_extract_loss_without_floating_tensor():
    with pytest.raises(SpecError, match="no floating tensor"):
        extract_loss((torch.arange(3), "text"))
    with pytest.raises(SpecError, match="no floating tensor"):
        extract_loss(None)
