"""mlflow-users (docker-compose.yaml): MLflow's users, made by its admin through the auth REST API.

    training-pipeline   the pipeline's own user (MLFLOW_PIPELINE_PASSWORD): it creates the
                        experiments and runs it writes to, so it may write them (MANAGE)
    reader              for people (MLFLOW_READER_PASSWORD): reads everything (default READ)

The admin's credentials come as MLFLOW_TRACKING_USERNAME/PASSWORD (mlflow's client reads them);
a user that exists gets its password set again, so a changed .env applies on the next `up`.
"""

import os
import sys

from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient

USERS = {"training-pipeline": "MLFLOW_PIPELINE_PASSWORD", "reader": "MLFLOW_READER_PASSWORD"}


def main() -> int:
    client = AuthServiceClient(os.environ["MLFLOW_TRACKING_URI"])
    for user, variable in USERS.items():
        password = os.environ.get(variable, "")
        if len(password) < 12:
            print(f"mlflow-users: {variable} must be set in .env, 12 characters or more (MLflow's rule)",
                  file=sys.stderr)
            return 1
        try:
            client.create_user(user, password)
            print(f"mlflow-users: created {user}")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            client.update_user_password(user, password)
            print(f"mlflow-users: {user} exists; password set from {variable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
