"""Server-side sessions: the exact token transcript of each conversation.

A session is a token transcript plus bookkeeping (owner, timestamps, completed turns).
The next turn's prompt is ``transcript + new input tokens``: the exact tokens the
model saw and generated, never a re-tokenization of decoded text, so every earlier
block of the conversation hashes the same and is found in the cache.

Turns and the transcript
------------------------
* One turn at a time: ``SessionManager.begin_turn`` takes the session's lock (held in
  this replica's memory and as a lease in the store, renewed while the turn runs); a
  second turn gets ``SessionBusy``. Record writes are compare-and-set on the version the
  turn started from, so whatever Redis loses (restart, FLUSHALL) no acknowledged turn is
  overwritten (see ``SessionManager``).
* A session is created by its first turn and stored right away (empty transcript), so
  it is visible (busy) while that turn runs; if that first turn does not complete
  (bad input, cancelled, failed) the session is removed again.
* A turn that completes (finish reason stop or length) commits
  ``prompt + generated tokens`` as the new transcript and counts one turn.
* **A cancelled or failed turn leaves the transcript as it was before the turn**: the
  new input and any tokens generated before the cancel are dropped. The KV blocks the
  turn computed stay in the cache (they are keyed by content), so retrying the same
  input finds the old transcript's blocks and, for full blocks of the new input, its
  own. Only ``last_used_at`` changes.

The new input
-------------
The conversation (``service.conversations``) turns the new input into tokens with
``Tokenizer.encode_text_turn`` / ``encode_chat_turn`` (``service/models/tokenizer.py``
says how a chat turn renders as a continuation of the transcript) and appends them.

The package
-----------
``records`` (``SessionRecord``, ids, errors, the binary codec), ``stores`` (where
records live), ``disk`` (record files, for a server with a disk directory and no Redis),
``journal`` (what Redis has not confirmed, in a file replayed at the next start) and
``table`` (``SessionManager``: owners, locks, TTL, limits).

Storage
-------
``SessionStore`` is the small async protocol behind the table (get / put / delete /
list, plus the per-session turn lock). ``InMemorySessionStore`` keeps records in the
process; ``RedisSessionStore`` keeps one compact binary record per session
(``encode_record``: magic, version, JSON metadata, token ids as little-endian
uint32, CRC-32) with an optional TTL, so sessions survive restarts and move between
replicas. Each record carries an ``etag`` (the id of the write that stored it): writes
are conditional on it (``put_if``). ``FallbackSessionStore`` puts this process's memory
behind Redis, with per-call timeouts and a circuit breaker, so a hung Redis stalls no
turn. Sessions are keyed by ``(owner, session_id)``: another owner's session id is
simply not found.

Durable acknowledgement
-----------------------
A change is answered (a turn's final event, a delete's OK) only once it is where the
deployment keeps sessions: in Redis, in the record files (``disk.DiskSessionStore``), or,
while Redis does not confirm it, in the journal (``journal.SessionJournal``, with a disk
directory). A store that cannot put it there raises ``SessionStoreUnavailable`` (the
session as it was). ``SessionStore.flush`` (the drain) saves what only memory holds and
reports what it could not (``FlushReport``: the server's one error line, exit status 3).

Deletion
--------
``SessionManager.delete`` (refused while a turn is in flight) leaves a tombstone where
the Redis record was, kept as long as a record would be: no write of the deleted session
(a turn that started before the delete and lost its lock, a replica's write-back of its
own copy) passes it (``DELETED``; the turn raises ``SessionDeleted``, NOT_FOUND, and
records nothing). A creation, i.e. a first turn that found no record or a fork, replaces
it: the id is free for a new session. See ``stores.RedisSessionStore`` and
``stores.FallbackSessionStore``.

Expiry and limits
-----------------
With ``ttl_s`` a session unused for that long is gone: Redis expires its record (the
TTL is renewed by every write, i.e. every turn), the in-memory store drops it when it
is next looked at or swept by ``SessionManager.reap`` (which also returns the expired
records, so the server can drop their KV blocks). ``max_sessions_per_owner`` caps how
many sessions one tenant holds; creating one more raises ``SessionLimit``. The cap is
exact under concurrency on any number of replicas: the store admits each creation
atomically (in Redis one script over the tenant's index; a refused creation is undone),
and while Redis is away each replica counts the sessions it holds.

Unreadable records
------------------
A stored record that fails to decode or verify (``decode_record``), names another
session, or whose Redis key is of another type is no record: reads treat it as absent
(``get`` returns None: NOT_FOUND, and a turn starts the session over), it is counted and
logged once, and the session's next write replaces exactly that value (HEALED,
``SessionManager.records_healed``). It is never an error of the store, so it never opens
the session store's circuit breaker (``FallbackSessionStore``: only Redis failing does).
"""


from .records import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    SESSION_ID_RE,
    BadTurnCount,
    InvalidSessionId,
    SessionBusy,
    SessionConflict,
    SessionDeleted,
    SessionError,
    SessionExists,
    SessionLimit,
    SessionNotFound,
    SessionRecord,
    SessionRecordError,
    SessionStoreUnavailable,
    TurnInfo,
    TurnUnavailable,
    TurnsChanged,
    check_session_id,
    decode_record,
    encode_record,
)
from .stores import (
    FallbackSessionStore,
    InMemorySessionStore,
    RedisSessionStore,
    SessionStore,
)
from .table import SessionManager, Turn

__all__ = [
    "BadTurnCount",
    "DEFAULT_PAGE_SIZE",
    "MAX_PAGE_SIZE",
    "SESSION_ID_RE",
    "FallbackSessionStore",
    "InMemorySessionStore",
    "InvalidSessionId",
    "RedisSessionStore",
    "SessionBusy",
    "SessionConflict",
    "SessionDeleted",
    "SessionError",
    "SessionExists",
    "SessionLimit",
    "SessionManager",
    "SessionNotFound",
    "SessionRecord",
    "SessionRecordError",
    "SessionStore",
    "SessionStoreUnavailable",
    "Turn",
    "TurnInfo",
    "TurnUnavailable",
    "TurnsChanged",
    "check_session_id",
    "decode_record",
    "encode_record",
]
