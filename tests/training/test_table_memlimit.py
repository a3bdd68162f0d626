"""A table larger than the memory limit trains, and resumes exactly: a Parquet train split whose
rows, as the model reads them, outweigh the whole job's cgroup memory limit (the torchrun agent
and both ranks in one group, as a pod's processes are) streams row group by row group; a rank
SIGKILLed mid-row-group restarts the group, which resumes from the newest checkpoint and ends
bit-identical to an uninterrupted run under the same limit. The whole-table path held the table
twice (Arrow's columns and the float32 array) on every rank."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import memlimit
from tests.training.test_stream_resume import resumes_bit_identical_under

LIMIT = 1536 << 20  # the job's limit: agent + 2 ranks (the memory preflight wants about this much)
FEATURES = 64
GROUP_ROWS = 65_536  # 17 MiB of float32 rows a row group
GROUPS = 100  # 6.5M rows: 1.6 GiB as the model reads them (float32 features, int64 labels)
STEPS = 30


@pytest.fixture(scope="module")
def big_table(tmp_path_factory):
    root = tmp_path_factory.mktemp("table") / "data"
    names = [f"f{i}" for i in range(FEATURES)]
    schema = pa.schema([*(pa.field(n, pa.float32()) for n in names), pa.field("label", pa.int64())])
    rng = np.random.default_rng(0)
    w = rng.normal(size=FEATURES).astype(np.float32)

    def group(n):
        x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        return pa.table([*x.T, (x @ w > 0).astype(np.int64)], schema=schema)

    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    with pq.ParquetWriter(root / "train" / "part-0.parquet", schema, compression="none", use_dictionary=False) as out:
        for _ in range(GROUPS):
            out.write_table(group(GROUP_ROWS), row_group_size=GROUP_ROWS)
    pq.write_table(group(2_000), root / "validation" / "part-0.parquet")
    (root / "dataset.json").write_text(json.dumps({"features": names, "label": "label", "n_classes": 2,
                                                   "normalize": False}))
    return root


def _sets(data, root):
    return {"dataset_uri": data, "model": "mlp", "hidden": 32, "depth": 1, "steps": STEPS, "checkpoint_every": 10,
            "batch_size": 64, "log_every": 5, "warmup_steps": 5, "eval_every": 0, "target_metric": "none",
            "checkpoint_dir": root / "ck", "output_dir": root / "out", "shuffle_window": 32}


@pytest.mark.slow
@pytest.mark.skipif(not memlimit.available(), reason="needs root and the cgroup v1 memory controller")
def test_a_table_larger_than_the_memory_limit_trains_and_resumes_bit_identical(big_table, tmp_path):
    rows = pq.ParquetFile(big_table / "train" / "part-0.parquet").metadata.num_rows
    assert rows * (FEATURES * 4 + 8) > LIMIT
    resumes_bit_identical_under(LIMIT, lambda root: _sets(big_table, root), tmp_path, STEPS)
