"""Checkpoint upload throughput: our S3 store against raw boto3 ``upload_file`` with default settings.

    .venv/bin/python benchmarks/upload_bench.py [--mb 200] [--rounds 3] [--sweep]

Starts moto's S3 server on 127.0.0.1 (real HTTP), writes one random file of ``--mb`` MB and uploads
it in the same run, rounds interleaved so both see the same machine load:

- ``boto3 default``: ``client.upload_file`` with boto3's default client and TransferConfig;
- ``ours: put_file``: ``S3Store.put_file`` (our TransferConfig, retries, sha256 metadata);
- ``ours: upload_checkpoint``: the whole commit of a one-file checkpoint from a local folder
  (the file checked against its manifest's sha256, making the client, upload, manifest, ``latest``),
  what the ``upload_checkpoint`` task does with ``checkpoint_location=local``.

Prints MiB/s per variant (median of the rounds) and the ratio ours / boto3 default. ``--sweep``
also tries other part sizes and concurrencies (how the defaults in training/store/s3.py were chosen).
The figures measure the client and a local Python S3 server; against a real S3 endpoint the network
decides, and larger parts with more in flight matter more there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.local_s3 import empty_bucket, moto_s3  # noqa: E402 (after the path is set)
from training.util import sha256_file  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200, help="file size in MB (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant (default 3)")
    ap.add_argument("--sweep", default="", metavar="MBxTHREADS,...",
                    help="also try these part sizes (MiB) x concurrencies, e.g. 8x8,16x8,64x4")
    a = ap.parse_args()

    with moto_s3("bench") as raw:
        from training import store as storage_api
        from training.checkpoint import commit as storage
        from training.store.s3 import CONCURRENCY, PART_SIZE

        with tempfile.TemporaryDirectory() as tmp:
            ck = Path(tmp) / "step_00000001"
            ck.mkdir()
            data = ck / "shard.bin"
            with open(data, "wb") as f:
                for _ in range(a.mb):
                    f.write(os.urandom(1 << 20))
            sha = sha256_file(data)
            manifest = storage.new_manifest(step=1, world_size=1, config_hash="bench",
                                            files=[{"path": data.name, "size": data.stat().st_size, "sha256": sha}])
            (ck / storage.MANIFEST).write_text(json.dumps(manifest))
            mb = data.stat().st_size / 2**20

            def boto3_default(i: int) -> None:
                raw.upload_file(str(data), "bench", f"raw/{i}")

            stores: dict[tuple, storage_api.S3Store] = {}

            def ours_put(i: int, **env: str) -> None:
                # One store object per setting, made before timing starts (like the raw client).
                stores[tuple(sorted(env.items()))].put_file(data, f"put/{i}", sha)

            def ours_commit(i: int) -> None:
                storage.upload_checkpoint(ck, f"s3://bench/commit{i}", experiment="bench", run_id="r")

            variants = {"boto3 default (8 MiB parts, 10 threads)": boto3_default,
                        f"ours: put_file ({PART_SIZE >> 20} MiB parts, {CONCURRENCY} threads)": ours_put,
                        "ours: upload_checkpoint (sha256 + upload + manifest + latest)": ours_commit}
            for spec in filter(None, a.sweep.split(",")):
                part, conc = spec.split("x")
                variants[f"sweep: put_file, {part} MiB parts, {conc} threads"] = (
                    lambda i, p=part, c=conc: ours_put(i, TRAINING_S3_PART_SIZE_MB=p, TRAINING_S3_CONCURRENCY=c))
            stores[()] = storage_api.open_store("s3://bench/ours")
            for spec in filter(None, a.sweep.split(",")):
                part, conc = spec.split("x")
                env = {"TRAINING_S3_PART_SIZE_MB": part, "TRAINING_S3_CONCURRENCY": conc}
                stores[tuple(sorted(env.items()))] = storage_api.open_store("s3://bench/ours", env)
            times: dict[str, list[float]] = {k: [] for k in variants}
            for r in range(a.rounds):
                for name, fn in variants.items():
                    t0 = time.perf_counter()
                    fn(r)
                    times[name].append(time.perf_counter() - t0)
                empty_bucket(raw, "bench")  # keep moto's memory flat

        base = statistics.median(times["boto3 default (8 MiB parts, 10 threads)"])
        print(f"file: {mb:.0f} MiB, moto_server on 127.0.0.1, {a.rounds} interleaved rounds, median per variant")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:64s} {mb / med:7.1f} MiB/s  ({med:.2f} s)  x{base / med:.2f} vs boto3 default")
        print(f"machine load (1-min average) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        return 0


if __name__ == "__main__":
    sys.exit(main())
