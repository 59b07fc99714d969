"""pytest fixtures for the loopback object stores.  Load with ``pytest_plugins = ["backends.pytest_plugin"]``.

Session scope (started lazily, on first use, stopped at session end):
  ``s3_server``  -> ``S3Server``  (moto on 127.0.0.1, or CKPTSTORE_TEST_S3_ENDPOINT)
  ``gcs_server`` -> ``GCSServer`` (fake-gcs-server on 127.0.0.1, or CKPTSTORE_TEST_GCS_ENDPOINT)

Function scope (each yields a ``RemoteTarget(url, storage_options)`` named tuple, unpackable as
``url, storage_options = ...``; the url has no trailing slash):
  ``s3_bucket_url``  -> ``s3://test-<uuid8>`` (a new empty bucket) or, with CKPTSTORE_TEST_S3_BUCKET,
                        ``s3://<bucket>/test-<uuid8>``
  ``gcs_bucket_url`` -> ``gs://test-<uuid8>`` likewise
  ``memory_url``     -> ``memory://ckptstore-test-<uuid8>`` with ``{}`` (fsspec in-memory filesystem)
  ``remote_url``     -> parametrised over ["s3", "gcs", "memory"] (test ids ``[s3]``, ``[gcs]``,
                        ``[memory]``; s3/gcs carry the ``remote`` marker, so ``-m "not remote"`` keeps
                        only memory)
After each test, local servers are wiped (``reset()``: every bucket and object), external ones lose that
test's bucket/prefix, the memory prefix is removed, and cached fsspec listings are invalidated.

Tests that need ``restart()``/``stop()`` should ``pytest.skip`` unless ``server.supports_restart``
(``require_restart(server)`` does that).
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator, NamedTuple

import pytest

from backends.launcher import GCSServer, S3Server, _Server

__all__ = ["RemoteTarget", "require_restart"]


class RemoteTarget(NamedTuple):
    url: str
    storage_options: dict[str, Any]


def require_restart(server: _Server) -> None:
    """Skip the calling test when ``server`` is an external endpoint that cannot be restarted."""
    if not server.supports_restart:
        pytest.skip(f"restart/stop not supported on external endpoint {server.endpoint}")


def _serve(cls: type[_Server]) -> Iterator[_Server]:
    """The server ``cls.from_env()`` names, started for the session; stopped after it unless external."""
    srv = cls.from_env()
    srv.start()
    try:
        yield srv
    finally:
        if not srv.is_external:
            srv.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    yield from _serve(S3Server)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    yield from _serve(GCSServer)


def _invalidate(protocol: str, storage_options: dict[str, Any]) -> None:
    import fsspec

    try:
        fsspec.filesystem(protocol, **storage_options).invalidate_cache()
    except Exception:
        pass


def _bucket_target(server: _Server, protocol: str) -> Iterator[RemoteTarget]:
    if not server.is_running():  # e.g. a test stopped it and failed before restarting
        server.start()
    url = server.new_bucket_url()
    opts = server.storage_options()
    try:
        yield RemoteTarget(url, opts)
    finally:
        try:
            if not server.is_running():
                server.start()
            if server.is_external:
                server.cleanup(url)
            else:
                server.reset()
        finally:
            _invalidate(protocol, opts)


@pytest.fixture
def s3_bucket_url(s3_server: S3Server) -> Iterator[RemoteTarget]:
    yield from _bucket_target(s3_server, "s3")


@pytest.fixture
def gcs_bucket_url(gcs_server: GCSServer) -> Iterator[RemoteTarget]:
    yield from _bucket_target(gcs_server, "gs")


@pytest.fixture
def memory_url() -> Iterator[RemoteTarget]:
    import fsspec

    root = f"ckptstore-test-{uuid.uuid4().hex[:8]}"
    yield RemoteTarget(f"memory://{root}", {})
    fs = fsspec.filesystem("memory")
    try:
        if fs.exists(root):
            fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass
    # rm leaves pseudo_dirs of parents it did not create; drop ours explicitly
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if d != f"/{root}" and not d.startswith(f"/{root}/")]


_REMOTE_FIXTURES = {"s3": "s3_bucket_url", "gcs": "gcs_bucket_url", "memory": "memory_url"}


@pytest.fixture(
    params=[
        pytest.param("s3", marks=pytest.mark.remote),
        pytest.param("gcs", marks=pytest.mark.remote),
        "memory",
    ]
)
def remote_url(request: pytest.FixtureRequest) -> RemoteTarget:
    """(url, storage_options) for each of s3 / gcs / memory; servers start only for the params that run."""
    return request.getfixturevalue(_REMOTE_FIXTURES[request.param])
