"""The generation engine: continuous batching over a paged, prefix-cached KV pool."""

from kvserve.service.engine.async_engine import AsyncEngine, build_engine
from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.engine import LLMEngine

__all__ = ["AsyncEngine", "EngineConfig", "LLMEngine", "build_engine"]
