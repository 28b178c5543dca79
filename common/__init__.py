"""What the service (kvserve.service) and the cache store (kvserve.cachestore) share, so
that neither reaches into the other for it: the tier names (``tiers.Tier``), the circuit
breaker in front of Redis (``breaker.CircuitBreaker``, one in the KV tier, one in the
session store) and the one-process-per-directory lock (``dirlock``: the disk KV tier and
the disk session store). Standard library only; it imports nothing of kvserve, and
tests/unit/test_imports.py keeps it so."""
