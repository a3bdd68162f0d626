#!/opt/venv/bin/python
"""`minio` and `mc` for the S3 stand-in image (s3.Dockerfile): the commands docker-compose.yaml runs.

    minio server DIR [--console-address ADDR]    moto's S3 server on 0.0.0.0:9000 (DIR unused: in memory)
    mc ready ALIAS                               exit 0 when the alias's S3 API answers
    mc mb [--ignore-existing] ALIAS/BUCKET ...   create buckets

An alias comes from MC_HOST_<ALIAS> (http://KEY:SECRET@HOST:PORT), as mc reads it; `local`
defaults to http://localhost:9000, as in the MinIO image.
"""

import os
import sys
from urllib.parse import unquote, urlsplit


def endpoint(alias: str) -> tuple[str, str | None, str | None]:
    url = urlsplit(os.environ.get(f"MC_HOST_{alias}", "http://localhost:9000" if alias == "local" else ""))
    if not url.hostname:
        sys.exit(f"mc: no alias {alias!r} (set MC_HOST_{alias})")
    user, password = (unquote(v) if v else v for v in (url.username, url.password))
    return f"{url.scheme}://{url.hostname}:{url.port or 9000}", user, password


def client(alias: str):
    import boto3

    url, key, secret = endpoint(alias)
    return boto3.client("s3", endpoint_url=url, aws_access_key_id=key or "stand-in",
                        aws_secret_access_key=secret or "stand-in", region_name="us-east-1")


def mc(args: list[str]) -> int:
    if args[:1] == ["ready"] and len(args) == 2:
        try:
            client(args[1]).list_buckets()
        except Exception as e:  # noqa: BLE001 - any failure means "not ready"
            print(f"mc ready: {args[1]} not ready: {e}", file=sys.stderr)
            return 1
        return 0
    if args[:1] == ["mb"]:
        ignore = "--ignore-existing" in args or "-p" in args
        for target in [a for a in args[1:] if not a.startswith("-")]:
            alias, _, bucket = target.partition("/")
            s3 = client(alias)
            try:
                s3.create_bucket(Bucket=bucket)
                print(f"Bucket created successfully `{target}`.")
            except s3.exceptions.BucketAlreadyOwnedByYou:
                if not ignore:
                    print(f"mc mb: bucket {target} exists", file=sys.stderr)
                    return 1
                print(f"Bucket `{target}` already exists.")
        return 0
    print(f"mc (stand-in): only `ready ALIAS` and `mb [--ignore-existing] ALIAS/BUCKET` are played, not {args}",
          file=sys.stderr)
    return 2


def minio(args: list[str]) -> int:
    if args[:1] != ["server"]:
        print(f"minio (stand-in): only `server DIR` is played, not {args}", file=sys.stderr)
        return 2
    os.execvp("moto_server", ["moto_server", "-H", "0.0.0.0", "-p", "9000"])


if __name__ == "__main__":
    name = os.path.basename(sys.argv[0])
    sys.exit(mc(sys.argv[1:]) if name == "mc" else minio(sys.argv[1:]))
