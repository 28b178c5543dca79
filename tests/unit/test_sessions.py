"""The session table: record codec, the in-memory and Redis stores (real redis-server),
turn locking and commit/rollback, and chat turns rendered as continuations."""

from __future__ import annotations

import asyncio
import json
import random
import struct
import zlib
from typing import Any, Sequence

import pytest

from kvserve.service.models.tokenizer import ChatTemplateError, Tokenizer
from kvserve.service.sessions import (
    InMemorySessionStore,
    InvalidSessionId,
    RedisSessionStore,
    BadTurnCount,
    SessionBusy,
    SessionExists,
    SessionLimit,
    SessionManager,
    SessionNotFound,
    SessionRecord,
    SessionRecordError,
    TurnInfo,
    TurnsChanged,
    decode_record,
    encode_record,
)
from kvserve.service.sessions.records import (
    MAX_RECALL,
    MAX_RECALL_TOKENS,
    RECALL_CONTEXT,
    dropped_answers,
    with_recall,
)
from tests.fixtures.models import LLAMA_CHAT_TEMPLATE

# ----------------------------------------------------------------------------- codec


def _record(**kw: Any) -> SessionRecord:
    base = dict(session_id="s-1", owner="tenant/a:b", token_ids=[0, 1, 2**32 - 1, 31999],
                created_at=1700000000.25, last_used_at=1700000100.5, turns=3)  # fmt: skip
    base.update(kw)
    return SessionRecord(**base)


def test_record_round_trips():
    big = json.dumps({"items": ["\u00e9\"x" * 40_000]})  # a conversation's items, past the old 64 KiB metadata
    for rec in (_record(), _record(token_ids=[]), _record(owner="", session_id="x" * 128), _record(attachment=big)):
        assert decode_record(encode_record(rec)) == rec
    assert b"attachment" not in encode_record(_record())  # a plain session's record is as before


def test_record_is_compact_uint32_tokens():
    small, big = _record(token_ids=[]), _record(token_ids=list(range(1000)))
    assert len(encode_record(big)) - len(encode_record(small)) == 4000


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:4] + struct.pack("<H", 9) + b[6:], "unsupported record version"),
        (lambda b: b[:-1], "checksum"),
        (lambda b: b[:20], "checksum"),
        (lambda b: b[:5], "too short"),
        (lambda b: b[:30] + bytes([b[30] ^ 0x01]) + b[31:], "checksum"),
    ],
    ids=["magic", "version", "truncated-1", "truncated-20", "tiny", "flipped-bit"],
)
def test_record_corruption_is_detected(mutate, reason):
    with pytest.raises(SessionRecordError, match=reason):
        decode_record(mutate(encode_record(_record())))


def test_random_and_mutated_bytes_never_decode_to_a_wrong_record():
    rng = random.Random(0)
    good = encode_record(_record(token_ids=list(range(50))))
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if bytes(data) == good:
            continue
        with pytest.raises(SessionRecordError):
            decode_record(bytes(data))
    for n in range(0, 64):
        with pytest.raises(SessionRecordError):
            decode_record(rng.randbytes(n))


def test_record_turn_boundaries_round_trip_and_version_1_records_still_load():
    log = [TurnInfo(2, 1, "stop", 10.0, 11.5), TurnInfo(0, 1, "length", 12.0, 12.25)]
    rec = _record(token_ids=[5, 6, 7, 8, 9], turns=3, turn_log=log)
    back = decode_record(encode_record(rec))
    assert back == rec and back.untracked_turns == 1 and back.untracked_tokens == 1
    assert [back.turn_end(t) for t in (1, 2, 3)] == [1, 4, 5]
    with pytest.raises(ValueError):
        back.turn_end(0)  # inside the untracked prefix
    # version 1: the same header and tokens, no turn section
    v2 = encode_record(_record(token_ids=[5, 6], turns=2))
    body = v2[:4] + struct.pack("<H", 1) + v2[6:-8]  # drop "u32 0 turns" and the crc
    old = decode_record(body + struct.pack("<I", zlib.crc32(body)))
    assert old.turn_log == [] and old.turns == 2 and old.untracked_tokens == 2 and old.turn_end(2) == 2


def test_record_recall_round_trips_and_records_without_it_load_as_before():
    rec = _record(recall=[[1, 2, 2**32 - 1], [7] * 300])
    assert decode_record(encode_record(rec)) == rec
    plain = encode_record(_record())
    assert b"recall" not in plain and decode_record(plain).recall == []  # as written before recall existed
    # a replica that predates recall reads only the keys it knows: the record's other fields as they are
    meta_len = struct.unpack_from("<I", encode_record(rec), 6)[0]
    meta = json.loads(encode_record(rec)[10 : 10 + meta_len])
    assert set(meta) - set(json.loads(plain[10 : 10 + struct.unpack_from("<I", plain, 6)[0]])) == {"recall"}


@pytest.mark.parametrize("recall", ['"AQID"', "[1]", '["AQID"]', '["!!!!"]', '{"a": 1}'])
def test_record_with_a_bad_recall_is_refused(recall):
    good = encode_record(_record(recall=[[1]]))
    meta_len = struct.unpack_from("<I", good, 6)[0]
    meta = good[10 : 10 + meta_len].replace(b'["AQAAAA=="]', recall.encode())
    body = good[:6] + struct.pack("<I", len(meta)) + meta + good[10 + meta_len : -4]
    with pytest.raises(SessionRecordError, match="bad metadata"):
        decode_record(body + struct.pack("<I", zlib.crc32(body)))


def test_recall_keeps_the_latest_dropped_answers_within_its_bounds():
    log = [TurnInfo(2, 3, "stop", 0.0, 0.0), TurnInfo(1, 0, "stop", 0.0, 0.0), TurnInfo(40, 2, "stop", 0.0, 0.0)]
    rec = _record(token_ids=list(range(1, 50)), turns=3, turn_log=log)  # 1 untracked token, 5, 1, 42
    assert dropped_answers(rec, 1) == [list(range(50 - 2 - RECALL_CONTEXT, 50))]
    assert dropped_answers(rec, 9) == [[1, 2, 3, 4, 5, 6], list(range(50 - 2 - RECALL_CONTEXT, 50))]  # no empty one
    many = with_recall([[1]] * MAX_RECALL, [[2], [3]])
    assert many == [[1]] * (MAX_RECALL - 2) + [[2], [3]]
    big = with_recall([[1] * 10], [[2] * (MAX_RECALL_TOKENS - 4), [3] * 8])
    assert big == [[2] * (MAX_RECALL_TOKENS - 8), [3] * 8]  # the oldest cut to its first tokens, the older gone


def test_record_with_turn_boundaries_that_do_not_fit_is_refused():
    for log, turns in (([TurnInfo(3, 3, "stop", 0.0, 0.0)], 1), ([TurnInfo(1, 0, "stop", 0.0, 0.0)] * 2, 1)):
        with pytest.raises(SessionRecordError, match="do not fit"):
            decode_record(encode_record(_record(token_ids=[1, 2, 3, 4], turns=turns, turn_log=log)))


# ----------------------------------------------------------------------------- stores


@pytest.fixture(params=["memory", "redis"])
def store(request) -> Any:
    if request.param == "memory":
        return lambda: InMemorySessionStore()
    url = request.getfixturevalue("redis_url")
    return lambda: RedisSessionStore.from_url(url, key_prefix="test:")


def test_store_get_put_delete_and_owner_isolation(store):
    async def scenario() -> None:
        s = store()
        try:
            rec = _record()
            assert await s.get(rec.owner, rec.session_id) is None
            await s.put(rec)
            assert await s.get(rec.owner, rec.session_id) == rec
            assert await s.get("someone-else", rec.session_id) is None  # owners are separate
            rec.token_ids.append(7)
            assert (await s.get(rec.owner, rec.session_id)).token_ids == rec.token_ids[:-1]  # stored a copy
            assert await s.delete(rec.owner, rec.session_id)
            assert not await s.delete(rec.owner, rec.session_id)
            assert await s.get(rec.owner, rec.session_id) is None
        finally:
            await s.close()

    asyncio.run(scenario())


def test_store_lists_in_pages_by_id(store):
    async def scenario() -> None:
        s = store()
        try:
            ids = [f"sess-{i:03d}" for i in range(23)]
            for sid in reversed(ids):
                await s.put(_record(session_id=sid, owner="t1"))
            await s.put(_record(session_id="other", owner="t2"))
            seen, token = [], ""
            while True:
                page, token = await s.list("t1", 5, token)
                assert len(page) <= 5
                seen += [r.session_id for r in page]
                if not token:
                    break
            assert seen == ids
            page, token = await s.list("t1", 23, "")
            assert len(page) == 23 and token == ""
            await s.delete("t1", "sess-005")
            page, _ = await s.list("t1", 100, "sess-003")
            assert [r.session_id for r in page][:2] == ["sess-004", "sess-006"]
        finally:
            await s.close()

    asyncio.run(scenario())


def test_store_lock_is_exclusive_and_expires(store):
    async def scenario() -> None:
        s = store()
        try:
            assert await s.try_lock("o", "s", "holder-a", 0.3)
            assert not await s.try_lock("o", "s", "holder-b", 0.3)
            assert await s.is_locked("o", "s")
            assert not await s.refresh_lock("o", "s", "holder-b", 10)
            await s.unlock("o", "s", "holder-b")  # not the holder: no effect
            assert await s.is_locked("o", "s")
            assert await s.refresh_lock("o", "s", "holder-a", 0.3)
            await s.unlock("o", "s", "holder-a")
            assert not await s.is_locked("o", "s")
            assert await s.try_lock("o", "s", "holder-c", 0.1)
            for _ in range(100):  # a crashed holder's lease runs out
                if not await s.is_locked("o", "s"):
                    break
                await asyncio.sleep(0.02)
            assert await s.try_lock("o", "s", "holder-d", 1)
        finally:
            await s.close()

    asyncio.run(scenario())


def test_redis_store_survives_a_new_client_and_ignores_a_corrupt_record(redis_url):
    import redis

    async def write() -> None:
        s = RedisSessionStore.from_url(redis_url, key_prefix="test:", ttl_s=60)
        await s.put(_record(session_id="keep", owner=""))
        await s.put(_record(session_id="corrupt", owner=""))
        await s.close()

    asyncio.run(write())
    r = redis.Redis.from_url(redis_url)
    key = "test:sess::corrupt"
    assert r.exists(key) and 0 < r.pttl(key) <= 60_000
    data = bytearray(r.get(key))
    data[10] ^= 0xFF
    r.set(key, bytes(data))

    async def read() -> None:
        s = RedisSessionStore.from_url(redis_url, key_prefix="test:")  # "another replica"
        try:
            assert await s.get("", "keep") == _record(session_id="keep", owner="")
            assert await s.get("", "corrupt") is None
        finally:
            await s.close()

    asyncio.run(read())


# ----------------------------------------------------------------------------- manager


def test_manager_turns_commit_roll_back_and_exclude_each_other(store):
    async def scenario() -> None:
        m = SessionManager(store(), lock_ttl_s=5)
        try:
            with pytest.raises(InvalidSessionId):
                await m.begin_turn("", "bad id!")
            # a first turn that does not complete leaves no session
            t = await m.begin_turn("", "s")
            rec, busy = await m.get("", "s")
            assert busy and rec.token_ids == []
            await m.end_turn(t)
            with pytest.raises(SessionNotFound):
                await m.get("", "s")

            t = await m.begin_turn("", "s")
            with pytest.raises(SessionBusy):
                await m.begin_turn("", "s")
            with pytest.raises(SessionBusy):
                await m.delete("", "s")
            await m.commit_turn(t, [1, 2, 3], [4, 5])
            await m.end_turn(t)
            rec, busy = await m.get("", "s")
            assert rec.token_ids == [1, 2, 3, 4, 5] and rec.turns == 1 and not busy

            # a second turn that is cancelled: the transcript stays as it was
            t = await m.begin_turn("", "s")
            assert t.record.token_ids == [1, 2, 3, 4, 5]
            await m.end_turn(t)
            rec, _ = await m.get("", "s")
            assert rec.token_ids == [1, 2, 3, 4, 5] and rec.turns == 1

            t = await m.begin_turn("", "s")
            with pytest.raises(RuntimeError, match="does not extend"):
                await m.commit_turn(t, [9, 9, 9, 9, 9, 6], [7])
            await m.commit_turn(t, [1, 2, 3, 4, 5, 6], [7])
            await m.end_turn(t)
            rec, _ = await m.get("", "s")
            assert rec.token_ids == [1, 2, 3, 4, 5, 6, 7] and rec.turns == 2

            page, token = await m.list("", 0, "")
            assert [(r.session_id, busy) for r, busy in page] == [("s", False)] and token == ""
            await m.delete("", "s")
            with pytest.raises(SessionNotFound):
                await m.delete("", "s")
        finally:
            await m.store.close()

    asyncio.run(scenario())


def test_manager_rewind_fork_and_replace_last(store):
    async def turn(m: SessionManager, sid: str, prompt: list[int], out: list[int], replace_last: bool = False) -> None:
        t = await m.begin_turn("", sid)
        await m.commit_turn(t, prompt, out, finish_reason="length", replace_last=replace_last)
        await m.end_turn(t)

    async def scenario() -> None:
        m = SessionManager(store(), lock_ttl_s=5, max_sessions_per_owner=3)
        try:
            await turn(m, "s", [1, 2], [3])
            await turn(m, "s", [1, 2, 3, 4], [5, 6])
            await turn(m, "s", [1, 2, 3, 4, 5, 6, 7], [8])
            rec, _ = await m.get("", "s")
            assert [(t.input_tokens, t.output_tokens) for t in rec.turn_log] == [(2, 1), (1, 2), (1, 1)]
            assert {t.finish_reason for t in rec.turn_log} == {"length"}
            # replace the last turn: its prompt extends the transcript before it
            await turn(m, "s", [1, 2, 3, 4, 5, 6, 9, 9], [10], replace_last=True)
            rec, _ = await m.get("", "s")
            assert rec.token_ids == [1, 2, 3, 4, 5, 6, 9, 9, 10] and rec.turns == 3
            assert (rec.turn_log[-1].input_tokens, rec.turn_log[-1].output_tokens) == (2, 1)
            assert rec.recall == [[1, 2, 3, 4, 5, 6, 7, 8]]  # the replaced answer after its prompt's tokens
            # fork at turn 2, then from the fork; the source is untouched
            child = await m.fork("", "s", "c", 2)
            assert child.token_ids == [1, 2, 3, 4, 5, 6] and child.turn_log == rec.turn_log[:2]
            assert child.forked_from == "s" and await m.shared_prefix(child) == 6
            assert await m.shared_prefix(rec) == 6  # the fork references the source's leading blocks too
            assert (await m.fork("", "c", "g", 1)).token_ids == [1, 2, 3]
            with pytest.raises(SessionExists):
                await m.fork("", "s", "c")
            with pytest.raises(SessionLimit):
                await m.fork("", "s", "d")
            with pytest.raises(BadTurnCount):
                await m.fork("", "s", "d", 4)
            with pytest.raises(SessionNotFound):
                await m.fork("other", "s", "d")
            # rewind: under the turn lock, counted, conditional
            t = await m.begin_turn("", "s")
            with pytest.raises(SessionBusy):
                await m.rewind("", "s", 1)
            await m.end_turn(t)
            with pytest.raises(BadTurnCount):
                await m.rewind("", "s", 4)
            with pytest.raises(TurnsChanged):
                await m.rewind("", "s", 1, expected_turns=2)
            before, after = await m.rewind("", "s", 2, expected_turns=3)
            assert before.turns == 3 and after.token_ids == [1, 2, 3] and after.turns == 1
            assert after.recall == [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9, 9, 10]]
            assert (await m.get("", "s"))[0] == after
            assert (await m.get("", "c"))[0].token_ids == [1, 2, 3, 4, 5, 6]
            with pytest.raises(BadTurnCount, match="'s' has 1 completed turn; cannot rewind 2"):  # singular
                await m.rewind("", "s", 2)
        finally:
            await m.store.close()

    asyncio.run(scenario())


def test_manager_renews_the_lock_of_a_long_turn():
    async def scenario() -> None:
        m = SessionManager(InMemorySessionStore(), lock_ttl_s=0.15)
        t = await m.begin_turn("", "long")
        await asyncio.sleep(0.5)  # several leases long
        with pytest.raises(SessionBusy):
            await m.begin_turn("", "long")
        await m.end_turn(t)
        t2 = await m.begin_turn("", "long")
        await m.end_turn(t2)

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- turn input


class _CharBackend:
    """One token per character (id = code point + 16), special tokens are ids 1 and 2:
    encoding is exact and additive, so continuation tokens can be compared exactly."""

    vocab_size = 0x110000 + 16
    specials = {"<s>": 1, "</s>": 2}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [1] if add_special_tokens else []
        i = 0
        while i < len(text):
            for tok, tid in self.specials.items():
                if text.startswith(tok, i):
                    ids.append(tid)
                    i += len(tok)
                    break
            else:
                ids.append(ord(text[i]) + 16)
                i += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - 16) for i in ids if i >= 16)

    def token_to_id(self, token: str) -> int | None:
        return self.specials.get(token)


def _char_tokenizer(template: str | None) -> Tokenizer:
    return Tokenizer(_CharBackend(), bos_token="<s>", eos_tokens=["</s>"], chat_template=template)


@pytest.mark.parametrize("ended_with_eos", [True, False], ids=["eos", "cut-by-length"])
def test_chat_turns_render_as_a_continuation_of_the_transcript(ended_with_eos):
    tok = _char_tokenizer(LLAMA_CHAT_TEMPLATE)  # TinyLlama-Chat's: the eos closes each message
    u1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = "Hello! How can I help?"
    u2 = [{"role": "user", "content": "Tell me a story."}]

    transcript = tok.encode_chat_turn([], u1)
    assert transcript == tok.encode_chat(u1)
    transcript += tok.encode(reply, add_bos=False) + (list(tok.eos_token_ids) if ended_with_eos else [])
    new = tok.encode_chat_turn(transcript, u2)

    # the whole conversation rendered at once encodes to exactly transcript + new, whether
    # the model wrote the end-of-turn eos itself or was cut off (then the eos is added)
    full = tok.encode_chat(u1 + [{"role": "assistant", "content": reply}] + u2)
    assert transcript + new == full


@pytest.mark.parametrize("ended_with_eos", [True, False], ids=["eos", "cut-by-length"])
def test_chat_continuation_with_the_builtin_template(ended_with_eos):
    tok = _char_tokenizer(None)  # "role: content" lines, no eos in the template
    transcript = tok.encode_chat_turn([], [{"role": "user", "content": "Hi"}])
    assert tok.decode(transcript) == "user: Hi\nassistant:"
    transcript += tok.encode(" Hello", add_bos=False) + ([2] if ended_with_eos else [])
    new = tok.encode_chat_turn(transcript, [{"role": "user", "content": "Story?"}])
    assert tok.decode(new) == "\nuser: Story?\nassistant:"
    assert 2 not in new and 1 not in new


def test_text_turns_add_bos_only_first(tiny_llama_dir):
    tok = Tokenizer.from_dir(tiny_llama_dir)
    first = tok.encode_text_turn([], "hello world")
    assert first[0] == tok.bos_token_id
    later = tok.encode_text_turn(first + [5], "hello world")
    assert later == first[1:]


def test_a_template_that_rejects_the_messages_is_invalid_input():
    strict = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    tok = _char_tokenizer(strict)
    transcript = tok.encode_chat_turn([], [{"role": "user", "content": "hi"}]) + [70, 2]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.encode_chat_turn(transcript, [{"role": "assistant", "content": "two assistants in a row"}])
