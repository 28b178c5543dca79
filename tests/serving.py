"""Helpers for the service tests: a real server on loopback, run in a background thread
(its own event loop) so tests can use the blocking client, or as a subprocess."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Coroutine

from kvserve.service.config import ServerConfig
from kvserve.service.server import RunningServer, serve

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 8


def tiny_config(model_dir: Path | str, **overrides: Any) -> ServerConfig:
    """Settings for a tiny model on CPU, loopback, a free port and a 256-block pool."""
    base: dict[str, Any] = dict(
        model=str(model_dir),
        host="127.0.0.1",
        port=0,
        device="cpu",
        dtype="float32",
        kv_cache_memory=1 << 20,  # tiny Llama: 512 bytes/token -> 2048 tokens = 256 blocks of 8
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        default_max_new_tokens=16,
        drain_timeout=5.0,
        log_level="warning",
    )
    base.update(overrides)
    return ServerConfig(**base)


class ServerThread:
    """``serve(config)`` in a daemon thread with its own event loop."""

    def __init__(self, config: ServerConfig, **serve_kwargs: Any) -> None:
        self.config = config
        self._kwargs = serve_kwargs
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.running: RunningServer | None = None
        self._thread = threading.Thread(target=self._main, name="kvserve-test-server", daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(timeout=120)
        if self._error is not None:
            raise RuntimeError("server failed to start") from self._error
        assert self.running is not None, "server did not start in time"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with serve(self.config, **self._kwargs) as running:
                self.running = running
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # surfaced by __enter__
            self._error = e
            self._ready.set()

    @property
    def address(self) -> str:
        assert self.running is not None
        return self.running.address

    @property
    def engine(self) -> Any:
        assert self.running is not None
        return self.running.engine

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        """Run a coroutine on the server's event loop and return its result."""
        assert self._loop is not None
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=60)


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds (a liveness wait, not a speed assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


_LISTEN_RE = re.compile(r"serving kvserve\.v1\.GenerationService on \S+:(\d+)")


def start_server_process(args: list[str], timeout: float = 120.0) -> tuple[subprocess.Popen, int, list[str]]:
    """``python -m kvserve.service ARGS`` (use ``--port 0``); returns (process, port, stderr lines so far).

    A thread keeps draining stderr into the returned list so the server never blocks on it.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.service", *args],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    port: list[int] = []
    found = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = _LISTEN_RE.search(line)
            if m and not port:
                port.append(int(m.group(1)))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    found.wait(timeout)
    if not port:
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(lines))
    return proc, port[0], lines
