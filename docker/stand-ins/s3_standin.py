#!/opt/venv/bin/python
"""`minio` and `mc` for the S3 stand-in image (s3.Dockerfile): the commands docker-compose.yaml runs.

    minio server DIR [--console-address ADDR]    moto's S3 server on 0.0.0.0:9000 (DIR unused: in memory)
    mc ready ALIAS                               exit 0 when the alias's server answers /minio/health/ready
    mc mb [--ignore-existing] ALIAS/BUCKET ...   create buckets
    mc admin user add ALIAS ACCESSKEY SECRETKEY  a user whose keys are these
    mc admin policy create ALIAS NAME FILE       a policy (IAM policy JSON, MinIO's grammar)
    mc admin policy attach ALIAS NAME --user U   give user U that policy

Credentials and policies are enforced as MinIO does: the root user (MINIO_ROOT_USER /
MINIO_ROOT_PASSWORD) may do anything; a user added with `mc admin user add` may do only what its
attached policies allow; a request whose signature does not match its key is refused. moto's own
IAM engine does the checking (its INITIAL_NO_AUTH_ACTION_COUNT mode): every MinIO user is an IAM
user of moto's default account holding exactly the access key MinIO gives it. moto cannot create an
access key with a chosen secret through its API, so the user administration is an admin endpoint of
this process (/minio/admin/v3/..., as MinIO's, but JSON bodies instead of MinIO's encrypted ones),
signed with the root key and checked here with botocore's SigV4 (the same computation moto uses).

An alias comes from MC_HOST_<ALIAS> (http://KEY:SECRET@HOST:PORT), as mc reads it; `local`
defaults to http://localhost:9000, as in the MinIO image.
"""

import json
import os
import signal
import sys
from urllib.parse import parse_qs, unquote, urlsplit

ADMIN = "/minio/admin/v3/"
HEALTH = "/minio/health/"  # live, ready: unauthenticated, as MinIO's
ROOT_USER = "minio-root"  # the IAM user that holds the root key


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


def admin_call(alias: str, action: str, query: dict[str, str], body: bytes) -> int:
    """One admin API call signed with the alias's (root) key."""
    from urllib.parse import urlencode

    import requests
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    url, key, secret = endpoint(alias)
    req = AWSRequest("PUT", f"{url}{ADMIN}{action}?{urlencode(query)}", data=body,
                     headers={"Content-Type": "application/json"})
    SigV4Auth(Credentials(key or "", secret or ""), "s3", "us-east-1").add_auth(req)
    out = requests.put(req.url, data=body, headers=dict(req.headers.items()), timeout=30)
    if out.status_code != 200:
        print(f"mc admin: {action} refused ({out.status_code}): {out.text[:300]}", file=sys.stderr)
        return 1
    return 0


def mc_admin(args: list[str]) -> int:
    if args[:2] == ["user", "add"] and len(args) == 5:
        _, _, alias, access, secret = args
        code = admin_call(alias, "add-user", {"accessKey": access}, json.dumps({"secretKey": secret}).encode())
        if not code:
            print(f"Added user `{access}` successfully.")
        return code
    if args[:2] == ["policy", "create"] and len(args) == 5:
        _, _, alias, name, path = args
        with open(path, "rb") as f:
            code = admin_call(alias, "add-canned-policy", {"name": name}, f.read())
        if not code:
            print(f"Created policy `{name}` successfully.")
        return code
    if args[:2] == ["policy", "attach"] and len(args) == 6 and args[4] == "--user":
        _, _, alias, name, _, user = args
        code = admin_call(alias, "attach-policy", {"policyName": name, "user": user}, b"{}")
        if not code:
            print(f"Attached Policies: [{name}] To User: {user}")
        return code
    print(f"mc (stand-in): admin {' '.join(args)} is not played (only user add, policy create, policy attach)",
          file=sys.stderr)
    return 2


def mc(args: list[str]) -> int:
    if args[:1] == ["ready"] and len(args) == 2:
        import requests

        try:  # MinIO's health endpoint takes no credentials (the MinIO container's own `mc ready local` has none)
            requests.get(f"{endpoint(args[1])[0]}{HEALTH}ready", timeout=5).raise_for_status()
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
    if args[:1] == ["admin"]:
        return mc_admin(args[1:])
    print(f"mc (stand-in): only `ready`, `mb` and `admin user add / policy create / policy attach` are played, "
          f"not {args}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- the server


class Users:
    """MinIO's users as IAM users of moto's default account, each with the access key MinIO gives it."""

    def __init__(self, root_key: str, root_secret: str) -> None:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.iam.models import iam_backends

        self.iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
        self.policies: dict[str, str] = {}
        self.add(ROOT_USER, root_key, root_secret)
        self.iam.put_user_policy(ROOT_USER, "root", json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        self.root = (root_key, root_secret)

    def add(self, name: str, access: str, secret: str) -> None:
        try:
            user = self.iam.get_user(name)
        except Exception:  # noqa: BLE001 - moto's NoSuchEntity: a new user
            user = self.iam.create_user("us-east-1", name, path="/", tags=[])
        user.access_keys.clear()  # MinIO: adding an existing user sets its secret
        key = user.create_access_key(prefix="AKIA")
        key.access_key_id, key.secret_access_key = access, secret

    def secret(self, access: str) -> str | None:
        for user in self.iam.users.values():
            for key in user.access_keys:
                if key.access_key_id == access:
                    return key.secret_access_key
        return None

    def attach(self, policy: str, user: str) -> None:
        self.iam.get_user(user)
        self.iam.put_user_policy(user, policy, self.policies[policy])


def signed_by(environ: dict, body: bytes, key: str, secret: str) -> bool:
    """Whether the request carries a SigV4 signature of this key (botocore computes it as moto does)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    auth = environ.get("HTTP_AUTHORIZATION", "")
    part = lambda first, rest: auth.partition(first)[2].partition(rest)[0]  # noqa: E731
    if part("Credential=", "/") != key:
        return False
    signed = part("SignedHeaders=", ",").split(";")
    headers = {k[5:].replace("_", "-").title(): v for k, v in environ.items() if k.startswith("HTTP_")}
    headers["Content-Type"] = environ.get("CONTENT_TYPE", "")
    headers["Content-Length"] = environ.get("CONTENT_LENGTH", "")
    headers = {k: v for k, v in headers.items() if k.lower() in signed}
    query = environ.get("QUERY_STRING", "")
    req = AWSRequest(method=environ["REQUEST_METHOD"], url=f"http://{environ.get('HTTP_HOST', '')}"
                     f"{environ.get('PATH_INFO', '')}{'?' + query if query else ''}", data=body, headers=headers)
    req.context["timestamp"] = headers.get("X-Amz-Date", "")
    sig = SigV4Auth(Credentials(key, secret), "s3", "us-east-1")
    return sig.signature(sig.string_to_sign(req, sig.canonical_request(req)), req) == part("Signature=", ",")


def presigned_as_signed(environ: dict, users: Users) -> str | None:
    """A presigned URL (SigV4 in the query, as MLflow's artifact proxy hands its clients) made into the
    same request signed in its headers, which moto's IAM engine checks like any other: moto does not
    read query signatures. The URL's own signature is checked first (key, signature, expiry): None
    when it holds, else why not (the request is refused with it)."""
    import hashlib
    import hmac
    from datetime import datetime, timezone
    from urllib.parse import quote, unquote

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    pairs = [p.split("=", 1) + [""] for p in environ.get("QUERY_STRING", "").split("&") if p]
    query = {unquote(k): unquote(v) for k, v, *_ in pairs}
    key, _, scope = query.get("X-Amz-Credential", "").partition("/")
    secret = users.secret(key)
    if secret is None:
        return "InvalidAccessKeyId"
    when = datetime.strptime(query.get("X-Amz-Date", ""), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    if (datetime.now(timezone.utc) - when).total_seconds() > int(query.get("X-Amz-Expires", "0")):
        return "AccessDenied: Request has expired"
    signed = query["X-Amz-SignedHeaders"].split(";")
    headers = {h: (environ.get("HTTP_" + h.upper().replace("-", "_")) or "").strip() for h in signed}
    path = environ.get("RAW_URI", environ["PATH_INFO"]).split("?")[0]
    canonical = "\n".join([
        environ["REQUEST_METHOD"], quote(path, safe="/~%"),
        "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
                 if k != "X-Amz-Signature"),
        "".join(f"{h}:{headers[h]}\n" for h in signed), ";".join(signed), "UNSIGNED-PAYLOAD"])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", query["X-Amz-Date"], scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = ("AWS4" + secret).encode()
    for part in scope.split("/"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest(), query["X-Amz-Signature"]):
        return "SignatureDoesNotMatch"
    rest = "&".join(f"{a}={b}" for a, b, *_ in pairs if not unquote(a).startswith("X-Amz-"))
    req = AWSRequest(environ["REQUEST_METHOD"], f"http://{environ['HTTP_HOST']}{path}{'?' + rest if rest else ''}",
                     headers={"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"})
    S3SigV4Auth(Credentials(key, secret), "s3", "us-east-1").add_auth(req)
    environ["QUERY_STRING"] = rest
    environ["RAW_URI"] = environ["REQUEST_URI"] = path + ("?" + rest if rest else "")
    for name, value in req.headers.items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    return None


def admin_app(users: Users, inner):
    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in (f"{HEALTH}live", f"{HEALTH}ready"):
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b""]
        if "Signature=" in environ.get("QUERY_STRING", "") and "X-Amz-Signature=" not in environ["QUERY_STRING"]:
            start_response("403 Forbidden", [("Content-Type", "application/xml")])  # moto fails on these with a 500
            return [b"<Error><Code>AccessDenied</Code><Message>the stand-in plays SigV4 presigned URLs only</Message>"
                    b"</Error>"]
        if "X-Amz-Signature=" in environ.get("QUERY_STRING", ""):
            refused = presigned_as_signed(environ, users)
            if refused:
                start_response("403 Forbidden", [("Content-Type", "application/xml")])
                return [f"<Error><Code>{refused.split(':')[0]}</Code><Message>{refused}</Message></Error>".encode()]
        if not path.startswith(ADMIN):
            return inner(environ, start_response)
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))

        def answer(code: str, text: str):
            start_response(code, [("Content-Type", "text/plain")])
            return [text.encode()]

        if not signed_by(environ, body, *users.root):
            return answer("403 Forbidden", "AccessDenied: the admin API takes the root key only")
        q = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        action = path[len(ADMIN):]
        try:
            if action == "add-user":
                users.add(q["accessKey"], q["accessKey"], json.loads(body)["secretKey"])
            elif action == "add-canned-policy":
                json.loads(body)  # a malformed policy is refused here, as MinIO does
                users.policies[q["name"]] = body.decode()
            elif action == "attach-policy":
                users.attach(q["policyName"], q["user"])
            else:
                return answer("404 Not Found", f"no admin action {action}")
        except (KeyError, ValueError) as e:
            return answer("400 Bad Request", f"{action}: {e!r}")
        except Exception as e:  # noqa: BLE001 - moto's NoSuchEntity and the like
            return answer("404 Not Found", f"{action}: {e}")
        return answer("200 OK", "")

    return app


def minio(args: list[str]) -> int:
    if args[:1] != ["server"]:
        print(f"minio (stand-in): only `server DIR` is played, not {args}", file=sys.stderr)
        return 2
    from moto import settings
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    users = Users(os.environ.get("MINIO_ROOT_USER", "minioadmin"), os.environ.get("MINIO_ROOT_PASSWORD", "minioadmin"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1 in its container: no default action
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # every request is authenticated and authorized from the first
    # In its container it serves the compose network on 0.0.0.0, as MinIO does; S3_STANDIN_* move it (a run by hand).
    host, port = os.environ.get("S3_STANDIN_HOST", "0.0.0.0"), int(os.environ.get("S3_STANDIN_PORT", "9000"))
    run_simple(host, port, admin_app(users, DomainDispatcherApplication(create_backend_app)), threaded=True)
    return 0


if __name__ == "__main__":
    name = os.path.basename(sys.argv[0])
    sys.exit(mc(sys.argv[1:]) if name == "mc" else minio(sys.argv[1:]))
