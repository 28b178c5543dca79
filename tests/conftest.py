"""Shared pytest configuration. Fixtures and helpers live in tests/fixtures/, one module per
real part; the tests live in four tiers, one folder each:

- ``unit/``: bookkeeping, codecs, keys, sessions and the store's tiers (a real redis-server
  where a tier needs one); no model, no server.
- ``engine/``: models against transformers, the native kernels, the engine, its rooms.
- ``service/``: real gRPC and HTTP servers on loopback, in this process.
- ``system/``: other processes: the CLI, subprocess servers, HAProxy, Node, packaging, docs.

Each test is marked with its tier's name, and unit and engine tests that are not ``slow``
are also marked ``fast``: ``pytest -m fast`` is the edit-test loop's tier.
"""

import os
from pathlib import Path

import pytest

# Keep torch from oversubscribing the 2-core CI machine when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# The Triton kernels (service/kernels/triton/) run under Triton's interpreter in tests: CI has
# no GPU. Triton reads this when it is imported (transformers' model classes import it), so it
# is set here, before any test module loads; TRITON_INTERPRET=0 in the environment keeps the
# compiled kernels (a GPU host).
os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = [
    "tests.fixtures.models",  # random tiny HF checkpoints written with save_pretrained
    "tests.fixtures.redis_server",  # a real redis-server on a free loopback port
]

TIERS = ("unit", "engine", "service", "system")
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(_HERE).parts
        tier = parts[0] if parts and parts[0] in TIERS else None
        if tier is None:
            continue
        item.add_marker(getattr(pytest.mark, tier))
        if tier in ("unit", "engine") and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
