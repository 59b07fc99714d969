"""Fixtures of the object-store request tests (tests/remote/test_request_budget.py, test_put_once.py)."""
from __future__ import annotations

import pytest

from countproxy import CountingProxy  # noqa: E402


@pytest.fixture
def proxy(s3_server):
    """The request-counting proxy of tests/countproxy.py in front of the loopback moto S3 server."""
    if s3_server.is_external:
        pytest.skip("counts requests through a proxy in front of the loopback moto server")
    with CountingProxy(s3_server.port) as p:
        yield p
