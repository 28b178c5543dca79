"""The old name of the native kernels' switches, kept for callers outside models/ that
still import it (service/cli.py, service/engine/async_engine.py, some benchmarks): the
kernels live in ``kvserve.service.kernels``; import them from there."""

from ..kernels import MODES, available, isa, passive_openmp, reason

__all__ = ["MODES", "available", "isa", "passive_openmp", "reason"]
