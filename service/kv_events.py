"""KV events: what this replica's KV tiers hold, published over ZMQ in vLLM's wire format.

KV-aware routers (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router,
vLLM's production stack) learn which blocks each engine holds from the events vLLM
publishes (``vllm/distributed/kv_events.py``). ``KVEvents`` publishes the same for
kvserve, tier by tier (docs/kv-events.md):

- **Wire.** A ZMQ PUB socket (``--kv-events-endpoint``: bound when it has a wildcard
  (``tcp://*:5557``), ``ipc://`` or ``inproc://``, else connected to a subscriber that
  binds, as vLLM does) sends three frames per batch: the topic (``--kv-events-topic``,
  llm-d's ``kv@<pod>@<model>``), the batch's sequence number (8 bytes, big-endian, from 0
  at each start) and a msgpack payload ``[ts, events, data_parallel_rank]``. Events are
  maps tagged by ``type`` (vLLM after its PR 42892; ``--kv-events-encoding array`` writes
  the older positional arrays): ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
  ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``),
  ``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``.
- **Hashes.** A block's 64-bit hash is the low 64 bits of its kvserve key (the SHA-256
  chain of cachestore/keys.py) read as a big-endian integer: its last 8 bytes, which is
  also how llm-d reads a hash sent as bytes. Only full blocks have keys. A block's parent
  is the block before it in its chain (None for the first: the chain's root is the
  namespace, never a block).
- **Media.** One event per change of one tier: ``medium`` names it (``MEDIA``: the
  device pool ``GPU`` on CUDA, ``DEVICE`` elsewhere; the host tier ``CPU``; the disk tier
  ``DISK``; Redis ``SHARED``: names Dynamo maps to its device, host, disk and external
  tiers and llm-d keeps as given).
- **State, not a log.** The hooks (the device pool's ``BlockEvents``, the store tiers'
  ``TierObserver``) update an index of what each tier holds (hash -> parent, tokens,
  tiers) under one lock and queue the change; they never touch ZMQ. One thread
  (``kv-events``) publishes what is queued every ``FLUSH_S``, serves replays and writes
  the journal. A full queue (``MAX_PENDING`` changes) is dropped and the next batch is a
  *resync*: ``AllBlocksCleared`` and a ``BlockStored`` for every block the index holds,
  parents first; a start is a resync too (after a restart only the durable tiers hold
  anything, so that is the snapshot of what they still hold).
- **Replay.** A ROUTER socket (``--kv-events-replay-endpoint``) answers a request
  ``[start sequence (8 bytes, big-endian)]`` as vLLM's does: every buffered batch from
  there (``[seq, payload]`` each, at most ``--kv-events-replay-buffer`` bytes of them
  kept), then ``[-1 (8 bytes, signed), b""]``. A start older than the buffer gets one
  batch instead, a resync numbered as the last batch published (a subscriber applies
  it and drops live batches up to that number), so a late subscriber always catches up.
- **Journal.** With a disk tier the index's durable blocks (disk, Redis) are appended
  to ``<disk-cache-dir>/kv-events.journal`` (hash, parent, tokens; rewritten without the
  dead ones when they outnumber the live ones), so a restarted replica announces what
  its disk still holds, and what Redis still holds of it (one pipelined ``EXISTS`` per
  batch), with parents and tokens.
- **Redis.** Redis expires and evicts keys without telling anyone: the index keeps a
  block in ``SHARED`` until this replica deletes it, finds it missing (a lookup), or its
  ``--redis-ttl`` passes since this replica last wrote it, and holds at most
  ``--kv-events-redis-blocks`` of them (the least recently written leave first).
"""

from __future__ import annotations

import logging
import struct
import sys
import threading
import time
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kvserve.common.tiers import Tier

if TYPE_CHECKING:
    from kvserve.cachestore.tiered import TieredStore

log = logging.getLogger(__name__)

FLUSH_S = 0.02  # the publisher thread publishes what is queued this often (and serves replays meanwhile)
MAX_PENDING = 100_000  # queued changes before the queue is dropped for a resync (vLLM's max_queue_size)
MAX_BATCH_BLOCKS = 512  # blocks in one published batch (a resync's snapshot: several batches)
LIMBO_BLOCKS = 65_536  # blocks no tier holds whose parent and tokens are kept for a demotion still queued
PUB_HWM = 100_000  # ZMQ high-water mark of the PUB socket (vLLM's); past it PUB drops, never blocks
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODINGS = ("map", "array")
JOURNAL_NAME = "kv-events.journal"
_JOURNAL_MAGIC = b"KVEVJ1\n"
_RECORD = struct.Struct("<32sBQH")  # digest, flags (1: has parent), parent, token count; then the tokens (uint32 LE)
_BITS = {Tier.DEVICE: 1, Tier.HOST: 2, Tier.DISK: 4, Tier.REDIS: 8}
_DURABLE = _BITS[Tier.DISK] | _BITS[Tier.REDIS]
_STORED, _REMOVED = "BlockStored", "BlockRemoved"


def media(device: str) -> dict[Tier, str]:
    """The ``medium`` of each tier's events, for a pool on ``device`` ("cuda", "cpu")."""
    return {
        Tier.DEVICE: "GPU" if device == "cuda" else "DEVICE",
        Tier.HOST: "CPU",
        Tier.DISK: "DISK",
        Tier.REDIS: "SHARED",
    }


def hash64(block_hash: bytes) -> int:
    """A block's event hash: the low 64 bits of its key read as a big-endian integer."""
    return int.from_bytes(block_hash[-8:], "big")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _token_list(data: bytes) -> list[int]:
    a = array("I")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


@dataclass(slots=True)
class _Block:
    digest: bytes  # the 32-byte key
    parent: int | None  # the parent's event hash
    tokens: bytes  # uint32 little-endian; b"" when not known or not published
    media: int = 0  # bits of _BITS: the tiers holding it
    journaled: bool = False  # the journal has its record


@dataclass(frozen=True, slots=True)
class KVEventsStats:
    """The publisher's figures so far (cumulative but ``blocks``)."""

    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)  # by type
    resyncs: dict[str, int] = field(default_factory=dict)  # by reason: start, overflow
    replays: dict[str, int] = field(default_factory=dict)  # by answer: buffered, snapshot
    blocks: dict[str, int] = field(default_factory=dict)  # what a subscriber holds now, by medium


class KVEventsUnavailable(RuntimeError):
    """pyzmq or msgpack is not installed (the ``events`` extra)."""


class KVEvents:
    """The KV events sink and publisher (module docstring). Built by server.py; the
    device pool (``BlockManager``) and the store's tiers call its hooks, ``attach`` starts
    it once the store exists, ``close`` ends it after them.

    Over 400 lines: the hooks, the index they keep, the publisher thread and the journal share one lock and one state; split apart, each would reach into the others' members."""

    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int,
        topic: str = "",
        replay_endpoint: str | None = None,
        token_ids: bool = True,
        tiers: Sequence[Tier] = tuple(Tier),
        encoding: str = "map",
        replay_buffer_bytes: int = 64 << 20,
        redis_ttl_s: float = 0.0,
        redis_max_blocks: int = 1 << 18,
        journal_dir: str | Path | None = None,
        max_pending: int = MAX_PENDING,
        clock: Any = time.monotonic,
    ) -> None:
        """Binds (or connects) the sockets now: ``zmq.ZMQError`` when an endpoint cannot
        be used, ``KVEventsUnavailable`` without pyzmq or msgpack. ``journal_dir``: where
        the journal lives (the disk tier's directory; None: no journal)."""
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise KVEventsUnavailable(f"{e.name} is not installed") from None
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        self._zmq, self._pack = zmq, msgpack.Packer(use_bin_type=True).pack
        self.block_size = block_size
        self.topic = topic.encode()
        self.token_ids = token_ids
        self.encoding = encoding
        self.replay_buffer_bytes = replay_buffer_bytes
        self.redis_ttl_s = redis_ttl_s
        self.redis_max_blocks = redis_max_blocks
        self.max_pending = max_pending
        self._clock = clock
        self._bits = {t: _BITS[t] for t in tiers}
        self._media = media("cpu")
        self.journal_path = Path(journal_dir) / JOURNAL_NAME if journal_dir is not None else None

        # the index, its queue of changes and the journal's pending bytes: under _lock
        self._lock = threading.Lock()
        self._blocks: dict[int, _Block] = {}
        self._limbo: OrderedDict[int, _Block] = OrderedDict()
        self._redis: OrderedDict[int, float] = OrderedDict()  # hash -> clock of the last write, oldest first
        self._counts: Counter[Tier] = Counter()  # blocks per tier
        self._pending: list[tuple] = []
        self._resync: str | None = None
        self._recall: dict[bytes, tuple[int | None, bytes]] = {}  # the journal read at start, until attach is done
        self._jbuf = bytearray()
        self._jrecords = 0  # records in the journal file (and _jbuf)
        self._durable = 0  # blocks a durable tier holds
        self._stats_events: Counter[str] = Counter()
        self._stats_resyncs: Counter[str] = Counter({"start": 0, "overflow": 0})
        self._stats_replays: Counter[str] = Counter({"buffered": 0, "snapshot": 0})
        self._batches = 0

        # the publisher thread's own: the sockets, the sequence, the replay buffer
        self._open_sockets(endpoint, replay_endpoint)
        self._seq = 0
        self._buffer: list[tuple[int, bytes]] = []
        self._buffer_start = 0  # index of the oldest kept entry of _buffer
        self._buffer_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _open_sockets(self, endpoint: str, replay_endpoint: str | None) -> None:
        """The PUB socket bound (a wildcard or local endpoint) or connected, and the replay
        ROUTER bound; both closed again when either fails (``zmq.ZMQError``)."""
        zmq = self._zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._replay = None
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay is bounded by the buffer
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode() or endpoint
        self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay is not None else None

    # ---- hooks (any thread; quick; never raising) ------------------------------------

    def block_stored(self, block_hash: bytes, parent: bytes | None, tokens: Sequence[int]) -> None:
        """The device pool holds ``block_hash`` now (``BlockManager``'s ``BlockEvents``)."""
        data = _token_bytes(tokens) if self.token_ids else b""
        with self._lock:
            self._store(Tier.DEVICE, block_hash, None if parent is None else hash64(parent), data)

    def block_removed(self, block_hash: bytes) -> None:
        """The device pool no longer holds ``block_hash``."""
        with self._lock:
            self._remove(Tier.DEVICE, block_hash)

    def tier_stored(self, tier: Tier, hashes: Sequence[bytes]) -> None:
        """A store tier holds ``hashes`` now (cachestore's ``TierObserver``)."""
        with self._lock:
            for h in hashes:
                parent, tokens = self._recall.get(h, (None, b""))
                self._store(tier, h, parent, tokens)

    def tier_removed(self, tier: Tier, hashes: Sequence[bytes]) -> None:
        """A store tier no longer holds ``hashes``."""
        with self._lock:
            for h in hashes:
                self._remove(tier, h)

    def _store(self, tier: Tier, digest: bytes, parent: int | None, tokens: bytes) -> None:
        bit = self._bits.get(tier)
        if bit is None:
            return
        h = hash64(digest)
        b = self._blocks.get(h)
        if b is None:
            b = self._limbo.pop(h, None) or _Block(digest, parent, tokens)
            self._blocks[h] = b
        if tokens and not b.tokens:  # learned now (a block first seen in a store tier, then computed)
            b.parent, b.tokens = parent, tokens
        if tier == Tier.REDIS:  # its TTL runs from this write
            self._redis[h] = self._clock()
            self._redis.move_to_end(h)
        if b.media & bit:
            return
        if not b.media & _DURABLE and bit & _DURABLE:
            self._durable += 1
            if self.journal_path is not None and not b.journaled:
                self._jbuf += _record(b)
                self._jrecords += 1
                b.journaled = True
        b.media |= bit
        self._counts[tier] += 1
        self._queue((_STORED, tier, h, b.parent, b.tokens))

    def _remove(self, tier: Tier, digest: bytes) -> None:
        bit = self._bits.get(tier)
        if bit is None:
            return
        h = hash64(digest)
        b = self._blocks.get(h)
        if b is None or not b.media & bit:
            return
        b.media &= ~bit
        self._counts[tier] -= 1
        if tier == Tier.REDIS:
            self._redis.pop(h, None)
        if bit & _DURABLE and not b.media & _DURABLE:
            self._durable -= 1
        if not b.media:
            del self._blocks[h]
            self._limbo[h] = b
            if len(self._limbo) > LIMBO_BLOCKS:
                self._limbo.popitem(last=False)
        self._queue((_REMOVED, tier, h))

    def _queue(self, change: tuple) -> None:
        if self._resync is not None:
            return  # the resync's snapshot will say it
        self._pending.append(change)
        if len(self._pending) > self.max_pending:
            self._pending.clear()
            self._resync = "overflow"

    # ---- life ------------------------------------------------------------------------

    def attach(self, *, device: str, store: TieredStore | None) -> None:
        """Start: the device pool is on ``device``; watch ``store`` (None: no tiers below
        the device), after reading the journal, so what its durable tiers hold (the disk
        tier's files; what Redis still holds of the journal's blocks) is in the first
        batch, a resync; then publish from the ``kv-events`` thread."""
        self._media = media(device)
        if store is not None:
            self._recall = self._read_journal()
            t0 = time.monotonic()
            store.observe(self, recall={Tier.REDIS: list(self._recall)} if Tier.REDIS in self._bits else None)
            with self._lock:
                self._recall = {}
                n = len(self._blocks)
            if n:
                log.info("kv events: %d block(s) the durable tiers still hold announced at start (%.1f s)",
                         n, time.monotonic() - t0)  # fmt: skip
            self._compact()
        with self._lock:
            self._pending.clear()
            self._resync = "start"
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("kv events: publishing on %s%s, topic %r", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", self.topic.decode())  # fmt: skip

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop (after the engine and the store did): the device and host tiers end with
        the process, so their blocks are announced removed; what is queued goes out, the
        journal is written, the sockets close (lingering a moment to deliver)."""
        with self._lock:
            for h, b in list(self._blocks.items()):
                for tier in (Tier.DEVICE, Tier.HOST):
                    if b.media & _BITS[tier]:
                        self._remove(tier, b.digest)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        else:
            self._close_sockets()

    def view(self) -> dict[str, set[int]]:
        """What a subscriber that applied every batch holds: medium -> event hashes."""
        with self._lock:
            out: dict[str, set[int]] = {self._media[t]: set() for t in self._bits}
            for h, b in self._blocks.items():
                for tier, bit in self._bits.items():
                    if b.media & bit:
                        out[self._media[tier]].add(h)
            return out

    def stats(self) -> KVEventsStats:
        with self._lock:
            return KVEventsStats(
                batches=self._batches,
                events=dict(self._stats_events),
                resyncs=dict(self._stats_resyncs),
                replays=dict(self._stats_replays),
                blocks={self._media[t]: self._counts[t] for t in self._bits},
            )

    # ---- the publisher thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._serve_replays(FLUSH_S)
                self._tick()
            self._tick()
        except Exception:  # noqa: BLE001 - the publisher must not take the server down
            log.exception("kv events: the publisher failed; no more events are published")
        finally:
            self._close_sockets()

    def _tick(self) -> None:
        """Publish what is queued (or a resync), age out Redis blocks, write the journal."""
        with self._lock:
            self._expire_redis()
            reason, self._resync = self._resync, None
            snapshot = self._snapshot() if reason is not None else None
            changes, self._pending = self._pending, []
            journal = bytes(self._jbuf)
            self._jbuf.clear()
        if snapshot is not None:
            assert reason is not None
            with self._lock:
                self._stats_resyncs[reason] += 1
            first = True
            for events in _chunks(self._events(snapshot), MAX_BATCH_BLOCKS):
                self._publish(([self._cleared()] if first else []) + events)
                first = False
            if first:
                self._publish([self._cleared()])
        for events in _chunks(self._events(changes), MAX_BATCH_BLOCKS):
            self._publish(events)
        if journal and self.journal_path is not None:
            try:
                with open(self.journal_path, "ab") as f:
                    f.write(journal)
            except OSError as e:
                log.warning("kv events: cannot append to %s: %r", self.journal_path, e)
        if self._jrecords > 2 * self._durable + 4096:
            self._compact()

    def _expire_redis(self) -> None:
        """(lock held) Blocks this replica last wrote to Redis more than --redis-ttl ago
        (Redis expired them) and the least recently written past the cap leave SHARED."""
        now = self._clock()
        while self._redis:
            h, t = next(iter(self._redis.items()))
            expired = self.redis_ttl_s > 0 and now - t >= self.redis_ttl_s
            if not expired and len(self._redis) <= self.redis_max_blocks:
                break
            self._remove(Tier.REDIS, self._blocks[h].digest)

    def _snapshot(self) -> list[tuple]:
        """(lock held) A BlockStored change for every (block, tier) the index holds,
        each chain's blocks from its root on (a parent before its children)."""
        out: list[tuple] = []
        for tier, bit in self._bits.items():
            held = {h: b for h, b in self._blocks.items() if b.media & bit}
            children: dict[int | None, list[int]] = {}
            for h, b in held.items():
                children.setdefault(b.parent if b.parent in held else None, []).append(h)
            stack = list(reversed(children.get(None, [])))
            while stack:  # depth first: a chain's blocks come one after another (merged into one event)
                h = stack.pop()
                b = held[h]
                out.append((_STORED, tier, h, b.parent, b.tokens))
                stack.extend(reversed(children.get(h, [])))
        return out

    def _events(self, changes: list[tuple]) -> list[tuple[int, Any]]:
        """Changes as wire events, consecutive ones merged (a chain's blocks stored into one
        tier: one BlockStored; blocks removed from one tier: one BlockRemoved); each with
        its block count."""
        out: list[tuple[int, Any]] = []
        run: list[tuple] = []

        def flush() -> None:
            if run:
                out.append((len(run), self._event(run)))
                run.clear()

        for c in changes:
            if run and (
                len(run) >= MAX_BATCH_BLOCKS
                or c[0] != run[-1][0]
                or c[1] != run[-1][1]
                or (c[0] == _STORED and (c[3] != run[-1][2] or bool(c[4]) != bool(run[-1][4])))
            ):
                flush()
            run.append(c)
        flush()
        return out

    def _cleared(self) -> Any:
        return ["AllBlocksCleared"] if self.encoding == "array" else {"type": "AllBlocksCleared"}

    def _event(self, run: list[tuple]) -> Any:
        kind, tier = run[0][0], run[0][1]
        medium = self._media[tier]
        hashes = [c[2] for c in run]
        if kind == _REMOVED:
            if self.encoding == "array":
                return [_REMOVED, hashes, medium]
            return {"type": _REMOVED, "block_hashes": hashes, "medium": medium}
        parent = run[0][3]
        tokens = _token_list(b"".join(c[4] for c in run)) if self.token_ids else []
        if self.encoding == "array":
            return [_STORED, hashes, parent, tokens, self.block_size, None, medium, None]
        return {
            "type": _STORED,
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }

    def _publish(self, events: list[Any]) -> None:
        seq = self._seq
        self._seq += 1
        payload = self._pack([time.time(), events, 0])
        with self._lock:
            self._batches += 1
            for e in events:
                self._stats_events[e["type"] if isinstance(e, dict) else e[0]] += 1
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=self._zmq.NOBLOCK)
        except self._zmq.Again:  # at the high-water mark: PUB drops it (the replay buffer keeps it)
            pass
        self._buffer.append((seq, payload))
        self._buffer_bytes += len(payload)
        while self._buffer_bytes > self.replay_buffer_bytes and self._buffer_start < len(self._buffer) - 1:
            self._buffer_bytes -= len(self._buffer[self._buffer_start][1])
            self._buffer_start += 1
        if self._buffer_start > 4096 and self._buffer_start * 2 > len(self._buffer):
            del self._buffer[: self._buffer_start]
            self._buffer_start = 0

    def _serve_replays(self, timeout_s: float) -> None:
        """Answer replay requests for up to ``timeout_s`` (or sleep it without a replay socket)."""
        if self._replay is None:
            self._stop.wait(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._replay.poll(int(left * 1000) + 1):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.debug("kv events: ignoring a replay request of %d frame(s)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            kept = self._buffer[self._buffer_start :]
            if kept and start < kept[0][0]:  # older than the buffer: the state as of the last batch instead
                with self._lock:
                    snapshot = self._snapshot()
                    self._stats_replays["snapshot"] += 1
                events = [self._cleared()] + [e for _, e in self._events(snapshot)]
                self._replay.send_multipart([client, b"", (self._seq - 1).to_bytes(8, "big"), self._pack([time.time(), events, 0])])
            else:
                with self._lock:
                    self._stats_replays["buffered"] += 1
                for seq, payload in kept:
                    if seq >= start:
                        self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([client, b"", END_SEQ, b""])

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()

    # ---- the journal -----------------------------------------------------------------

    def _read_journal(self) -> dict[bytes, tuple[int | None, bytes]]:
        """The journal's records: digest -> (parent, tokens); a torn last record (a crash
        mid-write) is dropped."""
        out: dict[bytes, tuple[int | None, bytes]] = {}
        if self.journal_path is None:
            return out
        try:
            data = self.journal_path.read_bytes()
        except FileNotFoundError:
            return out
        except OSError as e:
            log.warning("kv events: cannot read %s: %r; announcing the durable tiers without tokens", self.journal_path, e)
            return out
        if not data.startswith(_JOURNAL_MAGIC):
            log.warning("kv events: %s is not a kv events journal; ignoring it", self.journal_path)
            return out
        off = len(_JOURNAL_MAGIC)
        while off + _RECORD.size <= len(data):
            digest, flags, parent, n = _RECORD.unpack_from(data, off)
            end = off + _RECORD.size + 4 * n
            if end > len(data):
                break
            out[digest] = (parent if flags & 1 else None, bytes(data[off + _RECORD.size : end]) if self.token_ids else b"")
            off = end
        return out

    def _compact(self) -> None:
        """Rewrite the journal with the records of the blocks a durable tier holds now."""
        if self.journal_path is None:
            return
        with self._lock:
            blob = bytearray(_JOURNAL_MAGIC)
            n = 0
            for b in (*self._blocks.values(), *self._limbo.values()):
                b.journaled = bool(b.media & _DURABLE)
                if b.journaled:
                    blob += _record(b)
                    n += 1
            self._jbuf.clear()
            self._jrecords = n
        tmp = self.journal_path.with_suffix(".tmp")
        try:
            tmp.write_bytes(blob)
            tmp.replace(self.journal_path)
        except OSError as e:
            log.warning("kv events: cannot write %s: %r", self.journal_path, e)


def _record(b: _Block) -> bytes:
    return _RECORD.pack(b.digest, int(b.parent is not None), b.parent or 0, len(b.tokens) // 4) + b.tokens


def _chunks(events: list[tuple[int, Any]], limit: int) -> list[list[Any]]:
    """``(blocks, event)`` pairs cut into batches of at most ``limit`` blocks."""
    out: list[list[Any]] = []
    batch: list[Any] = []
    n = 0
    for blocks, event in events:
        if batch and n + blocks > limit:
            out.append(batch)
            batch, n = [], 0
        batch.append(event)
        n += blocks
    if batch:
        out.append(batch)
    return out


__all__ = ["KVEvents", "KVEventsStats", "KVEventsUnavailable", "END_SEQ", "hash64", "media"]
