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
     ("strategy", "zero3"), ("checkpoint_every", -1), ("seed", -1), ("grad_clip", -0.5), ("steps", True),
     ("comm_hook", "topk"), ("powersgd_rank", 0), ("powersgd_warmup_steps", 1)],
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


@pytest.mark.parametrize("replicate, shard, world, mesh", [(1, -1, 4, (1, 4)), (2, -1, 4, (2, 2)), (-1, 2, 8, (4, 2)),
                                                           (2, 3, 6, (2, 3))])
def test_the_hsdp_mesh_fills_in_a_minus_one_from_the_world_size(replicate, shard, world, mesh):
    cfg = TrainConfig(dataset_uri="/d", strategy="fsdp", dp_replicate=replicate, dp_shard=shard, batch_size=48)
    cfg.check_world_size(world)
    assert cfg.mesh_shape(world) == mesh


@pytest.mark.parametrize("sets, world, field, words", [
    ({"dp_replicate": 3}, 4, "dp_replicate", "3 does not divide world_size=4. Fix: choose a divisor of 4, e.g. 2"),
    ({"dp_replicate": 2, "dp_shard": 3}, 4, "dp_shard", "dp_replicate=2 x dp_shard=3 is 6, not world_size=4"),
    ({"dp_replicate": -1}, 4, "dp_replicate", "is -1 and so is dp_shard"),
])
def test_hsdp_degrees_that_do_not_fit_the_world_are_refused(sets, world, field, words):
    cfg = TrainConfig(dataset_uri="/d", strategy="fsdp", **sets)
    with pytest.raises(ConfigError) as err:
        cfg.check_world_size(world)
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("sets, field", [({"dp_replicate": 2}, "dp_replicate"), ({"dp_shard": 2}, "dp_shard"),
                                         ({"strategy": "fsdp", "dp_shard": 0}, "dp_shard")])
def test_hsdp_degrees_need_fsdp_and_a_number_of_ranks(sets, field):
    with pytest.raises(ConfigError) as err:
        TrainConfig(dataset_uri="/d", **sets)
    assert err.value.field == field and "Fix:" in str(err.value)


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


@pytest.mark.parametrize("fields, target, says", [
    ({"text_column": "text"}, "eval/r2", "eval/r2 is measured for regression only, but text_column is 'text'"),
    ({"task": "classification"}, "eval/rmse", "eval/rmse is measured for regression only, but task is classification"),
    ({"task": "regression"}, "eval/accuracy", "eval/accuracy is measured for classification only, but task is regression"),
    ({}, "eval/bits_per_byte", "eval/bits_per_byte is measured for language modeling only, but text_column is empty"),
    ({"text_column": "text", "task": "classification"}, "eval/bits_per_byte", "language modeling only"),
])
def test_a_target_the_task_cannot_log_is_refused_from_the_fields_alone(fields, target, says):
    with pytest.raises(ConfigError) as err:
        TrainConfig(dataset_uri="/data", target_metric=target, target_value=0.5, eval_every=50, **fields)
    assert err.value.field == "target_metric" and says in str(err.value)
    assert "or target_metric=none" in str(err.value)


@pytest.mark.parametrize("fields, target", [
    ({"text_column": "text"}, "eval/accuracy"),  # a text classifier, when the table holds the label
    ({"text_column": "text"}, "eval/bits_per_byte"), ({}, "eval/accuracy"), ({}, "eval/r2"),
    ({"task": "regression"}, "eval/loss"), ({"text_column": "text"}, "eval/loss"),
])
def test_a_target_some_data_of_these_fields_logs_passes(fields, target):
    TrainConfig(dataset_uri="/data", target_metric=target, target_value=0.5, eval_every=50, **fields)


def test_powersgd_compresses_ddp_gradients_only():
    with pytest.raises(ConfigError) as err:
        TrainConfig(dataset_uri="/d", strategy="fsdp", comm_hook="powersgd")
    assert err.value.field == "comm_hook" and "use comm_hook=none with fsdp" in str(err.value)
    TrainConfig(dataset_uri="/d", comm_hook="powersgd").check_device(cuda=False)  # gloo runs it
