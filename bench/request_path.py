"""How far one request wanders through the code: a gRPC ``Generate`` and an HTTP chat
completion traced through a live in-process server, call by call, over service/'s files.

A server (``serve``: the packaged default model unless ``--model``, gRPC and the HTTP
front on free loopback ports) runs on its own event loop in a thread. Each request is
sent once untraced (lazy first-use work out of the way), then again with
``sys.setprofile`` on the server's event-loop thread, from just before the request is
sent until its answer is read whole, on the server's event-loop thread and on the worker
threads it hands work to (``asyncio.to_thread``: tokenizing, a resent history's plan).
What is counted, over functions defined in ``service/`` (``kvserve.service``) only:

- a *visit* to a file: a call that starts a frame of a function of that file from a
  frame of another file (the nearest caller in service/; none: the event loop, grpc,
  starlette or a worker thread). Resuming a suspended coroutine or generator continues
  its visit, and a return is no visit: ``conversations.py`` visited twice is two calls
  into it from elsewhere;
- *steps*: the visits of every file, in order (the call transitions between files);
- *files*: the distinct service/ files a step entered.

The rooms below the conversation (``sessions/``, ``engine/``, ``kv/``, ``models/``,
``kernels/``, ``tools/``) are counted at their door: a call one of them makes inside
itself, into another room, or into the domain's checks and types (``validation.py``:
the engine's own guard, ``types.py``, ``errors.py``) is the room's own work, not a step
(the ``in rooms`` column counts them). The engine thread's step loop is not traced.

    python bench/request_path.py              # the table (a few seconds on a CPU)
    python bench/request_path.py --steps      # and each row's steps, caller -> callee

``tests/service/test_request_path.py`` asserts the path's property with the same tracer:
each request visits ``conversations.py`` twice (prepare, stream) and ``validation.py`` at
most twice.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from kvserve.clients import KVServeClient  # noqa: E402
from kvserve.service.config import ServerConfig  # noqa: E402
from kvserve.service.server import RunningServer, serve  # noqa: E402

SERVICE = (REPO / "service").resolve()
# The rooms below the conversation, each counted at its door: a call a room makes inside
# itself, into another room or into the domain's checks and types is the room's own work.
ROOMS = ("sessions/", "engine/", "kv/", "models/", "kernels/", "tools/")
BELOW = (*ROOMS, "validation.py", "types.py", "errors.py")
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


@dataclass
class Path_:
    """One traced request: its steps (caller file -> callee file and function, in order)
    and the files it ran in."""

    name: str
    steps: list[tuple[str, str, str]] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    in_rooms: int = 0  # calls a room made inside itself or below (not steps)

    def visits(self, file: str) -> int:
        return sum(1 for _, callee, _ in self.steps if callee == file)

    @property
    def by_file(self) -> Counter[str]:
        return Counter(callee for _, callee, _ in self.steps)


class PathTracer:
    """A ``sys.setprofile`` function for one thread that records a request's visits to
    service/'s files (see the module docstring). ``path`` is what it recorded."""

    def __init__(self, name: str, root: Path = SERVICE) -> None:
        self.root = str(root) + "/"
        self.path = Path_(name)
        self.active = True
        self._rel: dict[str, str | None] = {}
        self._inside: dict[int, FrameType] = {}  # frames of a room's own work (and what they call)
        self._started: dict[int, FrameType] = {}  # coroutine and generator frames begun (kept alive: ids stay theirs)

    def _file(self, frame: FrameType) -> str | None:
        filename = frame.f_code.co_filename
        rel = self._rel.get(filename, "")
        if rel == "":
            real = str(Path(filename).resolve()) if filename and not filename.startswith("<") else ""
            rel = real[len(self.root) :] if real.startswith(self.root) else None
            self._rel[filename] = rel
        return rel

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.active:
            return
        callee = self._file(frame)
        if callee is None:
            return
        if frame.f_code.co_flags & _RESUMABLE:
            if self._started.get(id(frame)) is frame:
                return  # a coroutine or generator resumed: the same visit
            self._started[id(frame)] = frame
        back = frame.f_back
        caller = None
        while back is not None:
            caller = self._file(back)
            if caller is not None:
                break
            back = back.f_back
        inside = caller is not None and (caller.startswith(ROOMS) or self._inside.get(id(back)) is back)
        if inside and callee.startswith(BELOW):
            self._inside[id(frame)] = frame
            self.path.in_rooms += 1  # the room's own work: counted at its door
            return
        self.path.files.add(callee)
        if caller != callee:
            self.path.steps.append((caller or "-", callee, frame.f_code.co_qualname))


class ServerThread:
    """``serve(config, http_port=0)`` on its own event loop in a daemon thread."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.running: RunningServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="request-path", daemon=True)

    async def _serve(self) -> None:
        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with serve(self.config, http_port=0) as running:
                self.running = running
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - surfaced by __enter__
            self._error = e
            self._ready.set()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(timeout=120)
        if self._error is not None or self.running is None:
            raise RuntimeError("the server did not start") from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.loop is not None and self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)

    def on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server's event-loop thread, and wait for it."""
        assert self.loop is not None
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(30), "the server's event loop did not answer"

    def trace(self, name: str, send: Callable[[], None]) -> Path_:
        """``send()`` once untraced, then once traced on the event loop's thread and on the
        worker threads it hands work to (``asyncio.to_thread``: tokenizing, a history's
        plan), a fresh default executor's, whose threads start with the tracer."""
        send()
        tracer = PathTracer(name)

        def on_workers(frame: FrameType, event: str, arg: Any) -> None:
            if tracer.active and threading.current_thread().name.startswith("asyncio"):
                tracer(frame, event, arg)

        def install() -> None:
            assert self.loop is not None
            self.loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="asyncio"))
            sys.setprofile(tracer)

        threading.setprofile(on_workers)  # threads started from now on: the new executor's
        self.on_loop(install)
        try:
            send()
        finally:
            self.on_loop(lambda: sys.setprofile(None))
            threading.setprofile(None)
            tracer.active = False
        return tracer.path


def trace_requests(config: ServerConfig, max_new_tokens: int = 4) -> list[Path_]:
    """Trace a gRPC ``Generate`` and an HTTP chat completion, each a session's next turn
    and a one-off request, against a server of ``config``."""
    paths = []
    with ServerThread(config) as server, KVServeClient(server.running.address, timeout=60) as grpc_client:
        http = httpx.Client(base_url=f"http://127.0.0.1:{server.running.http_port}", timeout=60)
        grpc_client.chat("path-grpc", "hello there", max_new_tokens=max_new_tokens)  # the session's first turn

        def grpc_turn() -> None:
            grpc_client.chat("path-grpc", "and then?", max_new_tokens=max_new_tokens)

        def grpc_one_off() -> None:
            grpc_client.complete(text="the fox", max_new_tokens=max_new_tokens)

        model = str(config.model)
        histories: dict[str, list[dict[str, str]]] = {}

        def chat(session_id: str) -> Callable[[], None]:
            """A chat turn that resends the session's history (OpenAI's way) and the next message."""

            def send() -> None:
                history = histories.setdefault(session_id, [])
                history.append({"role": "user", "content": f"and then, {len(history) // 2}?"})
                headers = {"X-Session-Id": session_id} if session_id else {}
                body = {"model": model, "messages": history, "max_tokens": max_new_tokens}
                r = http.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                if session_id:
                    history.append(r.json()["choices"][0]["message"])
                else:
                    history.clear()

            return send

        chat("path-http")()  # the session's first turn; the traced ones extend it
        paths.append(server.trace("gRPC Generate, a session's turn", grpc_turn))
        paths.append(server.trace("gRPC Generate, one-off", grpc_one_off))
        paths.append(server.trace("HTTP chat, X-Session-Id", chat("path-http")))
        paths.append(server.trace("HTTP chat, one-off", chat("")))
        http.close()
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "service" / "default_model"))
    ap.add_argument("--steps", action="store_true", help="list each row's steps")
    args = ap.parse_args()
    config = ServerConfig(model=args.model, host="127.0.0.1", port=0, device="cpu", log_level="warning",
                          metrics_port=0)  # fmt: skip
    paths = trace_requests(config)
    print(f"{'request':34} {'steps':>5} {'files':>5} {'conversations':>13} {'validation':>10} {'in rooms':>8}")
    for p in paths:
        print(f"{p.name:34} {len(p.steps):5} {len(p.files):5} {p.visits('conversations.py'):13} "
              f"{p.visits('validation.py'):10} {p.in_rooms:8}")  # fmt: skip
    if args.steps:
        for p in paths:
            print(f"\n{p.name}: {len(p.steps)} steps over {', '.join(sorted(p.files))}")
            for i, (caller, callee, fn) in enumerate(p.steps, 1):
                print(f"  {i:3} {caller:28} -> {callee:28} {fn}")


if __name__ == "__main__":
    main()
