"""The session journal's file (service/sessions/journal.py), on real files: what it says
after a restart is the last pending state of each session; a torn or damaged frame costs
that frame alone; it is emptied when nothing is pending and stays bounded while the same
sessions change; one server per directory."""

from __future__ import annotations

import pytest

from kvserve.common.dirlock import DiskCacheLocked
from kvserve.service.sessions import SessionRecord, TurnInfo
from kvserve.service.sessions.journal import FILE, Pending, SessionJournal, encode_frame, read_frames
from kvserve.service.sessions.stores import Expect


def _rec(sid: str, turns: int, n_tokens: int = 6, owner: str = "t1") -> SessionRecord:
    log = [TurnInfo(2, 1, "stop", 1.0, 2.0)] * turns
    return SessionRecord(sid, owner, list(range(max(n_tokens, 3 * turns))), created_at=1.0, last_used_at=2.0,
                         turns=turns, cache_salt="salt", etag=f"e{turns}", turn_log=log)  # fmt: skip


@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
def test_the_last_pending_state_of_each_session_survives_a_restart(tmp_path, fsync):
    j = SessionJournal(tmp_path, fsync=fsync)
    a1 = Pending(_rec("a", 1), Expect(frozenset({"e0", "e1"})), create=False, base_turns=0)
    j.put(("t1", "a"), a1)
    j.put(("t1", "b"), Pending(delete=True))
    a2 = Pending(_rec("a", 2), Expect(frozenset({"e0", "e1", "e2"}), unreadable="ff"), create=True, base_turns=0)
    j.put(("t1", "a"), a2)
    j.put(("t2", "c"), Pending(_rec("c", 1, owner="t2"), Expect(absent_ok=True), create=True))
    j.put(("t2", "c"), None)  # Redis took it
    both = Pending(_rec("d", 3), Expect(frozenset({"e2", "e3"})), base_turns=2, delete=True)  # deleted, then created again
    j.put(("t1", "d"), both)
    j.put(("t1", "never"), None)  # nothing pending, never was: no frame
    assert j.sessions == 3
    j.close()
    again = SessionJournal(tmp_path, fsync=fsync)
    assert again.pending == {("t1", "a"): a2, ("t1", "b"): Pending(delete=True), ("t1", "d"): both}
    assert again.pending[("t1", "d")].turns == 1 and again.pending[("t1", "a")].turns == 2
    assert again.skipped_bytes == 0
    # rewritten at the start: exactly the three live frames
    frames, skipped = read_frames((tmp_path / FILE).read_bytes())
    assert [k for k, *_ in frames] == [("t1", "a"), ("t1", "b"), ("t1", "d")] and skipped == 0
    again.close()


def test_a_torn_or_damaged_frame_costs_that_frame_alone(tmp_path):
    j = SessionJournal(tmp_path)
    for sid in ("a", "b", "c"):
        j.put(("t1", sid), Pending(_rec(sid, 1), Expect(frozenset({"e0"}))))
    j.close()
    path = tmp_path / FILE
    data = bytearray(path.read_bytes())
    frames, _ = read_frames(bytes(data))
    _, _, offset, length = frames[1]
    data[offset + length // 2] ^= 0x40  # a flipped byte inside b's frame
    torn = encode_frame(("t1", "d"), Pending(_rec("d", 1), Expect()))
    data += torn[: len(torn) // 2]  # a crash in the middle of an append
    path.write_bytes(bytes(data))
    j = SessionJournal(tmp_path)
    assert set(j.pending) == {("t1", "a"), ("t1", "c")}
    assert j.pending[("t1", "c")].record == _rec("c", 1)
    assert j.skipped_bytes == length + len(torn) // 2
    j.close()
    assert SessionJournal(tmp_path).skipped_bytes == 0  # the start rewrote it clean


def test_the_file_is_emptied_when_nothing_is_pending_and_bounded_while_sessions_change(tmp_path):
    j = SessionJournal(tmp_path)
    path = tmp_path / FILE
    big = [Pending(_rec(f"s{i}", 1, n_tokens=20_000), Expect(frozenset({"e0"}))) for i in range(3)]  # ~80 KB each
    for _ in range(60):  # the same three sessions change over and over: ~14 MB appended
        for i, p in enumerate(big):
            j.put(("t1", f"s{i}"), p)
    live = sum(len(encode_frame(("t1", f"s{i}"), p)) for i, p in enumerate(big))
    assert path.stat().st_size <= 2 * live + (1 << 20) + live  # compacted on the way
    j.put(("t1", "s0"), None)
    j.put(("t1", "s1"), None)
    assert path.stat().st_size > 0
    j.put(("t1", "s2"), None)
    assert path.stat().st_size == 0 and j.sessions == 0
    j.close()
    assert SessionJournal(tmp_path).pending == {}


def test_one_server_per_journal_directory(tmp_path):
    j = SessionJournal(tmp_path)
    with pytest.raises(DiskCacheLocked):
        SessionJournal(tmp_path)
    j.close()
    SessionJournal(tmp_path).close()  # released with the journal (or the process)
