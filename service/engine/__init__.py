"""The generation engine: continuous batching over a paged, prefix-cached KV pool."""

from .async_engine import AsyncEngine, build_engine
from .config import EngineConfig
from .engine import LLMEngine

__all__ = ["AsyncEngine", "EngineConfig", "LLMEngine", "build_engine"]
