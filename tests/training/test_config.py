import json

import pytest

from training.config.fields import ConfigError
from training.config.train_config import TrainConfig, check_path_part, load_train_config


def test_defaults_are_valid():
    cfg = TrainConfig(dataset_uri="/data")
    assert cfg.model == "mlp" and cfg.strategy == "ddp"


@pytest.mark.parametrize(
    "field, value",
    [("steps", 0), ("steps", -5), ("batch_size", 0), ("lr", 0.0), ("lr", -1.0), ("model", "resnet"),
     ("strategy", "zero3"), ("checkpoint_every", -1), ("seed", -1), ("grad_clip", -0.5), ("steps", True)],
)
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        TrainConfig(dataset_uri="/data", **{field: value})
    assert err.value.field == field
    assert f"'{field}'" in str(err.value) and "Fix:" in str(err.value)


def test_empty_dataset_is_refused():
    with pytest.raises(ConfigError, match="dataset_uri"):
        TrainConfig()


def test_batch_must_split_over_ranks():
    cfg = TrainConfig(dataset_uri="/d", batch_size=30)
    cfg.check_world_size(3)
    with pytest.raises(ConfigError, match="batch_size.*world_size=4"):
        cfg.check_world_size(4)


def test_file_and_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dataset_uri": "/d", "steps": 7}))
    cfg = load_train_config(path, ["lr=0.5", "batch_size=8", "steps=9"])
    assert (cfg.steps, cfg.lr, cfg.batch_size) == (9, 0.5, 8)


@pytest.mark.parametrize("item, field", [("steps=abc", "steps"), ("nope=1", "nope"), ("steps", "--set")])
def test_bad_overrides_name_the_field(item, field):
    with pytest.raises(ConfigError) as err:
        load_train_config(None, ["dataset_uri=/d", item])
    assert err.value.field == field


def test_unknown_field_in_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dataset_uri": "/d", "stepz": 7}))
    with pytest.raises(ConfigError, match="stepz"):
        load_train_config(path)


@pytest.mark.parametrize("bad", ["..", "a/b", "../x", "/abs", "", "a b", "x" * 200, "a..b"])
def test_unsafe_key_parts_are_refused(bad):
    with pytest.raises(ConfigError, match="run_id"):
        check_path_part("run_id", bad)


def test_config_hash_ignores_paths():
    a = TrainConfig(dataset_uri="/d", checkpoint_dir="/x")
    b = TrainConfig(dataset_uri="/d", checkpoint_dir="/y")
    assert a.config_hash() == b.config_hash() != TrainConfig(dataset_uri="/d", seed=1).config_hash()
