"""Block bookkeeping for the device pool: free list, refcounts, prefix-hash map.

Pure Python, no tensors (the tensors live in ``service.kv.cache.KVPool``).

A block is in exactly one of three states:

* **in use**: ``ref_count > 0``; held by one or more running sequences' block tables.
* **cached**: ``ref_count == 0`` and it holds a ``block_hash``; findable by
  ``match_prefix``; evictable. It sits in the free queue in LRU order.
* **free**: ``ref_count == 0``, no hash; in the free queue.

``allocate`` pops from the front of the free queue (least recently freed first).
Popping a cached block evicts it: ``on_evict(block)`` is called first (the engine
demotes its KV to the host tier there), then its hash is dropped.

Block 0 is the null block: padding writes land there and it is never handed out.

``events`` (a ``BlockEvents``: the KV events publisher, service/kv_events.py) is told of
every hash the pool starts holding (``register``, with the block's parent hash and
tokens) and stops holding (eviction, ``drop_hash``), in the order it happens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from kvserve.cachestore.keys import BlockHash

NULL_BLOCK = 0  # never handed out: padding slots of a batch write their K/V here


class BlockEvents(Protocol):
    """Told of every hash the device pool starts or stops holding (engine thread; quick,
    never raising): the block's hash, its parent's (None: the first block of its chain)
    and its tokens."""

    def block_stored(self, block_hash: BlockHash, parent: BlockHash | None, tokens: Sequence[int]) -> None: ...

    def block_removed(self, block_hash: BlockHash) -> None: ...


class NoFreeBlocks(RuntimeError):
    """Not enough free or evictable blocks for an allocation."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    namespace: bytes | None = None  # the chain root of block_hash (needed to demote it)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        on_evict: Callable[[Block], None] | None = None,
        events: BlockEvents | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> Block, in LRU order (front = evicted first)
        self._free: OrderedDict[int, Block] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[BlockHash, Block] = {}
        self._on_evict = on_evict
        self._events = events
        self.num_evicted = 0

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out now (free + cached-evictable)."""
        return len(self._free)

    @property
    def num_cached_idle(self) -> int:
        """Blocks with a hash and no user (evictable cache)."""
        return sum(1 for b in self._free.values() if b.block_hash is not None)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[Block]:
        """The longest run of leading ``hashes`` held on the device (refcounts unchanged)."""
        out: list[Block] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    # ---- state changes ---------------------------------------------------------------

    def allocate(self, n: int) -> list[Block]:
        """``n`` fresh blocks with ref_count 1 and no hash. All or nothing."""
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on (cached or shared) blocks."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop a reference. Blocks are released tail first, so a sequence's last blocks
        are evicted before its first ones (a prefix is worth more than a suffix)."""
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Unhashed blocks hold nothing reusable: hand them out first.
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = block

    def register(
        self,
        block: Block,
        block_hash: BlockHash,
        namespace: bytes,
        *,
        parent: BlockHash | None = None,
        tokens: Sequence[int] = (),
    ) -> Block:
        """Record that ``block`` holds the KV of ``block_hash`` (``parent``: the hash of
        the block before it in its chain, None for the first; ``tokens``: its tokens;
        both only for ``events``).

        If another block already holds that hash, the existing one stays the cached
        copy and ``block`` remains unhashed (a duplicate that is freed normally).
        Returns the block now registered for the hash.
        """
        existing = self._cached.get(block_hash)
        if existing is not None:
            return existing
        if block.block_hash is not None:
            raise AssertionError(f"block {block.block_id} already holds a hash")
        block.block_hash = block_hash
        block.namespace = namespace
        self._cached[block_hash] = block
        if self._events is not None:
            self._events.block_stored(block_hash, parent, tokens)
        return block

    def drop_hash(self, block: Block) -> None:
        """Forget a block's hash (e.g. its KV is known bad). It stays allocated."""
        if block.block_hash is not None:
            self._cached.pop(block.block_hash, None)
            if self._events is not None:
                self._events.block_removed(block.block_hash)
            block.block_hash = None
            block.namespace = None

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._on_evict is not None:
            self._on_evict(block)
        del self._cached[block.block_hash]
        if self._events is not None:  # after on_evict: the demoted copy is announced first
            self._events.block_removed(block.block_hash)
        block.block_hash = None
        block.namespace = None
        self.num_evicted += 1
