"""Shared pytest configuration. Fixtures live in tests/fixtures/, one module per real part."""

import os

# Keep torch from oversubscribing the 2-core CI machine when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")

pytest_plugins = [
    "tests.fixtures.models",  # random tiny HF checkpoints written with save_pretrained
    "tests.fixtures.redis_server",  # a real redis-server on a free loopback port
]
