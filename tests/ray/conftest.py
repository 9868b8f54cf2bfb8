"""A local Ray cluster per test module (2 CPUs), shut down after the module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="the Ray tests need: pip install 'areal-agents[ray]'")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # address="local": always a cluster of its own, never one a killed run left behind
    ray.init(address="local", num_cpus=2, log_to_driver=False, logging_level="warning")
    # Test modules are not importable by name from the workers: ship their code by value.
    ray.cloudpickle.register_pickle_by_value(request.module)
    try:
        yield ray
    finally:
        ray.cloudpickle.unregister_pickle_by_value(request.module)
        ray.shutdown()
