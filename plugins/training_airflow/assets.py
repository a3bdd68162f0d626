"""The Airflow Asset that stands for "the training dataset".

``register_dataset`` emits an event on it each time new data lands (and passed the data gate); its
``extra`` says where the data is and what exactly it is (``dataset_uri``, ``fingerprint``, rows).
``distributed_training_on_data`` is scheduled on it and trains on the folder the newest event names.
"""

from __future__ import annotations

from airflow.sdk import Asset

# Named only (its URI is the name): a URI with a scheme makes Airflow load every provider's URI
# normalizers at parse time, boto3 included. The folder travels in each event's extra instead.
TRAINING_DATASET = Asset(name="training_dataset", group="training-data")
