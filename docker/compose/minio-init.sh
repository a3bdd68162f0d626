#!/bin/sh
# minio-init (docker-compose.yaml), run with MinIO's root key (MC_HOST_local): the buckets, then one
# user per service with a policy that reaches only its own bucket. Rerunning sets the same state.
#   the pipeline (TRAINING_S3_ACCESS_KEY): objects in s3://$TRAINING_BUCKET (checkpoints, data)
#   MLflow (MLFLOW_S3_ACCESS_KEY):          objects in s3://mlflow (artifacts it serves)
# mc takes a new user's secret as an argument: it stays inside this one-shot container.
set -eu

mc mb --ignore-existing "local/${TRAINING_BUCKET}" local/mlflow

bucket_policy() {  # name bucket: list the bucket, read/write/delete its objects, nothing else
    cat > "/tmp/$1.json" <<POLICY
{"Version": "2012-10-17", "Statement": [
  {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"],
   "Resource": ["arn:aws:s3:::$2"]},
  {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                                 "s3:ListMultipartUploadParts"],
   "Resource": ["arn:aws:s3:::$2/*"]}]}
POLICY
    mc admin policy create local "$1" "/tmp/$1.json"
}

user_with_policy() {  # access-key secret-key policy
    mc admin user add local "$1" "$2"
    # An attached policy attached again: mc says so and fails; that is the state wanted.
    if ! out=$(mc admin policy attach local "$3" --user "$1" 2>&1); then
        case "$out" in *"already"*) ;; *) echo "$out" >&2; exit 1 ;; esac
    fi
    echo "user $1: policy $3"
}

bucket_policy training-pipeline "${TRAINING_BUCKET}"
bucket_policy mlflow-artifacts mlflow
user_with_policy "${TRAINING_S3_ACCESS_KEY}" "${TRAINING_S3_SECRET_KEY}" training-pipeline
user_with_policy "${MLFLOW_S3_ACCESS_KEY}" "${MLFLOW_S3_SECRET_KEY}" mlflow-artifacts
