"""Fixtures every Kubernetes-facing test shares: a fake clock and a running HTTP API-server double."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fakes.apiserver import ApiServerDouble
from tests.fakes.clock import FakeClock

NODE = "gpu-node-1"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def api(clock: FakeClock) -> AsyncIterator[ApiServerDouble]:
    """The API double on a free local port, serving node `NODE`."""
    double = ApiServerDouble(clock, NODE)
    await double.start()
    yield double
    await double.stop()
