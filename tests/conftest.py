"""Shared fixtures: the loopback S3 (moto) and GCS (fake-gcs-server) servers come from backends/."""
import os

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

pytest_plugins = ["backends.pytest_plugin"]
