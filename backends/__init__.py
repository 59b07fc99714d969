"""Loopback object-store servers (moto S3, fake-gcs-server) for ckptstore's tests and local development.

See ``backends/launcher.py`` (servers) and ``backends/pytest_plugin.py`` (fixtures).
"""
