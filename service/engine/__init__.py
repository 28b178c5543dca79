"""The generation engine: continuous batching over a paged, prefix-cached KV pool."""

from service.engine.async_engine import AsyncEngine, build_engine
from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine

__all__ = ["AsyncEngine", "EngineConfig", "LLMEngine", "build_engine"]
