"""Routing statistics files and synthetic routings (``planner.routing``): the schema is
checked field by field, since the file is shared between people."""

from __future__ import annotations

import json

import pytest

from planner.routing import (
    RoutingError,
    RoutingStats,
    load_routing,
    routing_from_dict,
    synthetic,
    uniform_layer,
    zipf_layer,
)

LAYERS = {"blocks.0.moe": (4, 2), "blocks.1.moe": (4, 2)}


def valid() -> dict:
    return {
        "format": "soap-planner-routing", "version": 1, "source": "recorded over 10 steps",
        "layers": {"blocks.0.moe": {"experts": 4, "top_k": 2, "token_share": [0.4, 0.3, 0.2, 0.1]}},
    }


def test_zipf_shares_follow_the_exponent():
    layer = zipf_layer(4, 1.0, top_k=2)
    # 1, 1/2, 1/3, 1/4 normalised by 25/12.
    assert layer.token_share == pytest.approx((12 / 25, 6 / 25, 4 / 25, 3 / 25))
    assert layer.imbalance() == pytest.approx(4 * 12 / 25)
    assert uniform_layer(4).imbalance() == pytest.approx(1.0)
    assert zipf_layer(8, 0.0).token_share == uniform_layer(8).token_share


def test_synthetic_routing_covers_every_layer():
    stats = synthetic("zipf:1.2", LAYERS)
    assert set(stats.layers) == set(LAYERS) and "zipf with exponent 1.2" in stats.source
    assert synthetic("uniform", LAYERS).layer("blocks.0.moe", 4, 2).token_share == (0.25,) * 4
    with pytest.raises(RoutingError, match="use 'uniform' or 'zipf:ALPHA'"):
        synthetic("zipf:-1", LAYERS)


def test_a_file_round_trips_and_a_missing_layer_is_uniform(tmp_path):
    stats = routing_from_dict(valid())
    path = tmp_path / "routing.json"
    stats.save(path)
    loaded = load_routing(path)
    assert loaded == stats and loaded.source == "recorded over 10 steps"
    assert loaded.layer("blocks.1.moe", 4, 2).token_share == (0.25,) * 4
    with pytest.raises(RoutingError, match="give layer 'blocks.0.moe' 4 experts but the model has 8"):
        loaded.layer("blocks.0.moe", 8, 2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="plan"), "field 'format' must be"),
        (lambda d: d.update(version=7), "field 'version' is 7"),
        (lambda d: d.update(layers={}), "field 'layers' must be an object"),
        (lambda d: d["layers"].update({"__import__('os')": d["layers"]["blocks.0.moe"]}), "is not a module path"),
        (lambda d: d["layers"]["blocks.0.moe"].update(experts=0), "field 'experts' must be a positive integer"),
        (lambda d: d["layers"]["blocks.0.moe"].update(top_k=5), "1 <= top_k <= experts"),
        (lambda d: d["layers"]["blocks.0.moe"].update(token_share=[0.5, 0.5]), "must be a list of 4 numbers"),
        (lambda d: d["layers"]["blocks.0.moe"].update(token_share=[0.5, 0.5, 0.5, 0.5]), "sums to 2, not 1"),
        (lambda d: d["layers"]["blocks.0.moe"].update(token_share=[1.5, -0.5, 0, 0]), "negative share"),
        (lambda d: d["layers"]["blocks.0.moe"].update(token_share=[float("nan"), 0, 0, 1]), "finite numbers only"),
        (lambda d: d["layers"]["blocks.0.moe"].update(coselection=[[0, 1], [1, 0]]), "list of 4 rows"),
        (
            lambda d: d["layers"]["blocks.0.moe"].update(coselection=[[0, 1, 0, 0], [2, 0, 0, 0], [0] * 4, [0] * 4]),
            "must be symmetric",
        ),
    ],
)
def test_bad_fields_are_named(edit, message):
    data = valid()
    edit(data)
    with pytest.raises(RoutingError, match=message):
        routing_from_dict(data)


def test_unreadable_files_get_one_line(tmp_path):
    with pytest.raises(RoutingError, match="does not exist"):
        load_routing(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RoutingError, match="is not valid JSON"):
        load_routing(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    with pytest.raises(RoutingError, match="expected a JSON object"):
        load_routing(tmp_path / "list.json")


def test_default_statistics_are_uniform():
    assert RoutingStats().layer("any.moe", 3, 1).token_share == pytest.approx((1 / 3,) * 3)
