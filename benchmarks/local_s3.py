"""moto's S3 server on 127.0.0.1 for the benchmarks that write to S3 (upload_bench.py,
checkpoint_bench.py): a real HTTP endpoint, dummy credentials, nothing that can reach an account."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from training.util import free_port, stop_process, wait_for_port


@contextlib.contextmanager
def moto_s3(bucket: str) -> Iterator[Any]:
    """Start the server, point this process (and its children) at it, create ``bucket``; yields a
    boto3 client with boto3's defaults. The server stops on exit."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Dummy credentials: moto accepts any, and nothing here may reach a real account.
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        wait_for_port(port)
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        yield client
    finally:
        stop_process(server, 10)


def empty_bucket(client: Any, bucket: str) -> None:
    """Delete every object: keeps moto's memory flat between rounds."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
