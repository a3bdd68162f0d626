"""One declaration per knob: the checks, the --set round trip, the schema and the help all come
from the dataclass field, so they cannot drift apart."""

from __future__ import annotations

import dataclasses
import json

import pytest

from training.config.train_config import TrainConfig, load_train_config
from training.config.fields import ConfigError, format_value, json_schema, parse_value, set_args, specs


def _other_value(spec):
    """A valid value different from the default, for every kind of field."""
    if spec.choices:
        return spec.choices[-1] if spec.default != spec.choices[-1] else spec.choices[0]
    if spec.kind == "integer":
        return int(spec.minimum or 0) + 3
    if spec.kind == "number":
        return 0.125
    if spec.kind == "boolean":
        return not spec.default
    if spec.kind == "object":
        return {"A": "b c"}
    if spec.kind == "json":
        return {"width": 64, "blocks": [1, 2.5], "act": {"name": "gelu", "approx": None}}
    return "some/path with space"


def test_every_field_round_trips_through_set_arguments():
    values = {name: _other_value(spec) for name, spec in specs(TrainConfig).items()}
    values.update(dataset_uri="/data/x", strategy="ddp", precision="fp32", comm_hook="fp16", model="hf:/models/llama",
                  lora_targets="q_proj,v_proj", prompt_column=None, response_column=None, messages_column=None,
                  chat_template=None,  # SFT's fields: their rules are tests/training/test_sft.py's
                  target_metric="eval/accuracy", target_value=0.5, eval_every=5,
                  metrics_host="0.0.0.0", dp_replicate=1, dp_shard=-1)  # ddp (for comm_hook) has no mesh to shape
    args = set_args(TrainConfig, values)
    cfg = load_train_config(None, [a for a in args if a != "--set"])
    assert cfg.to_dict() == {**TrainConfig(dataset_uri="x").to_dict(), **values}
    # An optional field left empty survives the trip as empty.
    spec = specs(TrainConfig)["target_value"]
    assert parse_value(spec, format_value(spec, None)) is None


def test_every_field_is_declared_with_help_title_and_limits_on_numbers():
    for name, spec in specs(TrainConfig).items():
        assert len(spec.help) >= 15 and spec.title, name
        if spec.kind in ("integer", "number"):
            assert spec.minimum is not None or spec.exclusive_minimum is not None, f"{name}: no lower bound"
        schema = json_schema(spec)
        assert schema["description"] == spec.help
        if spec.choices:
            assert spec.default in schema["enum"]


@pytest.mark.parametrize("field, value, words", [
    ("steps", 0, ">= 1"), ("steps", "7", "an integer"), ("lr", float("nan"), "a number"),
    ("precision", "fp8", "use one of fp32, bf16, fp16"), ("async_checkpoint", "yes", "true or false"),
    ("dropout", 0.99, "<= 0.95"),
])
def test_generic_checks_name_the_field_and_the_fix(field, value, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset_uri="/d", **{field: value})
    assert e.value.field == field and words in str(e.value) and "Fix:" in str(e.value)


def test_a_config_file_from_an_older_version_still_loads(tmp_path):
    # train_config.json files written before target_metric had an explicit "none"
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dataset_uri": "/d", "target_metric": "", "target_value": 0.0}))
    assert not load_train_config(path).has_target


def test_only_what_the_pipeline_sets_is_kept_out_of_the_form():
    hidden = {f.name for f in dataclasses.fields(TrainConfig) if not f.metadata["form"]}
    assert hidden == {"checkpoint_dir", "output_dir", "dataset_fingerprint", "token_shards"}


def test_model_args_take_any_json_object_and_nothing_else():
    cfg = load_train_config(None, ["dataset_uri=/d", 'model_args={"width": 8, "blocks": [1, 2]}'])
    assert cfg.model_args == {"width": 8, "blocks": [1, 2]}
    assert json_schema(specs(TrainConfig)["model_args"])["type"] == "object"
    for bad in ("[1, 2]", "width=8"):
        with pytest.raises(ConfigError, match="'model_args'.*not a JSON object"):
            load_train_config(None, ["dataset_uri=/d", f"model_args={bad}"])
    with pytest.raises(ConfigError, match="'model_args'"):
        TrainConfig(dataset_uri="/d", model_args={"x": float("nan")})
