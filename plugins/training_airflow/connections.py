"""Airflow connections the pipeline reads: ``store_env``, the S3 settings of ``aws_conn_id`` as
environment for the store object or the ranks, never as arguments, XCom or MLflow."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowFailException


def store_env(params: dict[str, Any]) -> dict[str, str]:
    """``AWS_*`` settings for the checkpoint store from ``params['aws_conn_id']``; {} when unset.

    With the Param empty, the store reads the worker's own ``AWS_*`` environment (or boto3's chain:
    profile, container or instance role). With it set, the amazon provider's ``AwsBaseHook``
    resolves the connection (keys, session token, assumed role, region, ``endpoint_url`` in the
    extra). The mapping goes to the store object in this process, or into the environment of the
    torchrun child; never on a command line, in a Param, XCom or MLflow, and every secret in it is
    registered with Airflow's secrets masker in case anything prints it."""
    conn_id = (params.get("aws_conn_id") or "").strip()
    if not conn_id:
        return {}
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    try:
        hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
        creds = hook.get_credentials()
        endpoint = hook.conn_config.get_service_endpoint_url("s3")
        region = hook.region_name
    except Exception as e:
        # The exception text is the provider's; it names the connection, not its password.
        raise AirflowFailException(
            f"aws_conn_id {conn_id!r}: cannot read the AWS connection ({type(e).__name__}); create it "
            "(Admin > Connections, type 'Amazon Web Services') or clear aws_conn_id to use the worker's AWS_* "
            "environment") from None
    env: dict[str, str] = {}
    if creds and creds.access_key and creds.secret_key:
        env.update(AWS_ACCESS_KEY_ID=creds.access_key, AWS_SECRET_ACCESS_KEY=creds.secret_key)
        if creds.token:
            env["AWS_SESSION_TOKEN"] = creds.token
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    if region:
        env["AWS_DEFAULT_REGION"] = region
    from airflow.sdk.log import mask_secret

    for secret in (env.get("AWS_SECRET_ACCESS_KEY"), env.get("AWS_SESSION_TOKEN")):
        if secret:
            mask_secret(secret)
    return env
