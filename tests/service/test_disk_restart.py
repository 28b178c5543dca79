"""A server with a disk tier and no Redis: a session resumes after a restart, its KV
restored from the block files (the same reply as recomputing), corrupted files are
recomputed, never wrong KV, and a second server on the same directory refuses to start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.clients import KVServeClient
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, cold_reply, tiny_config, wait_until

MSGS = ["hello, tell me a short story about a fox", "what is the fox doing now"]


def disk_server(model_dir: Path, root: Path, **kw) -> ServerThread:
    kw.setdefault("host_cache_memory", 0)
    return ServerThread(
        tiny_config(model_dir, disk_cache_dir=str(root), disk_cache_size=64 << 20, spill_after=0.05,
                    restore_policy="always", **kw)
    )  # fmt: skip


def first_turn(model_dir: Path, root: Path, sid: str, **kw) -> list[int]:
    with disk_server(model_dir, root, **kw) as s, KVServeClient(s.address, timeout=60) as c:
        c.chat(sid, MSGS[0], max_new_tokens=10)
        t1 = c.get_session(sid, include_token_ids=True).token_ids
        assert wait_until(lambda: c.get_session(sid).cached_blocks.get("disk", 0) == len(t1) // BLOCK_SIZE > 0)
    return t1  # the server stopped: no Redis anywhere, only the directory


@pytest.mark.parametrize("host", [0, 1 << 20], ids=["disk-only", "host-and-disk"])
def test_session_resumes_from_disk_after_a_restart(tiny_llama_dir, tmp_path, host):
    root = tmp_path / "kv"
    t1 = first_turn(tiny_llama_dir, root, "fox", host_cache_memory=host)
    assert any((root / "sessions").rglob("*.kvss")) and any((root / "blocks").rglob("*.kvb"))
    with disk_server(tiny_llama_dir, root, host_cache_memory=host) as s, KVServeClient(s.address, timeout=60) as c:
        info = c.get_session("fox", include_token_ids=True)
        assert info.token_ids == t1 and info.cached_blocks.get("disk", 0) == len(t1) // BLOCK_SIZE
        r = c.chat("fox", MSGS[1], max_new_tokens=10)
        full = len(t1) // BLOCK_SIZE * BLOCK_SIZE
        assert r.start.cached_tokens == full and r.start.cached_tier == "disk"
        assert r.start.cached_by_tier["disk"] == full
        t2 = c.get_session("fox", include_token_ids=True).token_ids
        stats = s.engine.cache_stats().store.tiers["disk"]
        assert stats.hits == len(t1) // BLOCK_SIZE and stats.failures == {}
    prompt = t2[: len(t2) - len(r.token_ids)]
    assert prompt[: len(t1)] == t1
    assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 10)  # restored KV == recomputed KV


def test_corrupted_block_files_are_recomputed_not_used(tiny_llama_dir, tmp_path):
    root = tmp_path / "kv"
    t1 = first_turn(tiny_llama_dir, root, "dog")
    files = sorted((root / "blocks").rglob("*.kvb"))
    for i, f in enumerate(files):  # every block: a flipped byte, or another block's file
        raw = bytearray(f.read_bytes())
        if i % 2 == 0:
            raw[len(raw) // 2] ^= 0x01
            f.write_bytes(bytes(raw))
        else:
            f.write_bytes(files[i - 1].read_bytes() if i else bytes(raw))
    with disk_server(tiny_llama_dir, root) as s, KVServeClient(s.address, timeout=60) as c:
        r = c.chat("dog", MSGS[1], max_new_tokens=10)
        assert r.start.cached_by_tier["disk"] == 0  # the first block is bad: the restore stops there
        t2 = c.get_session("dog", include_token_ids=True).token_ids
        stats = s.engine.cache_stats().store.tiers["disk"]
        assert stats.hits == 0 and sum(stats.failures.values()) >= 1
    prompt = t2[: len(t2) - len(r.token_ids)]
    assert prompt[: len(t1)] == t1
    assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 10)


def test_a_second_server_on_the_directory_refuses_to_start(tiny_llama_dir, tmp_path):
    root = tmp_path / "kv"
    with disk_server(tiny_llama_dir, root):
        second = disk_server(tiny_llama_dir, root)
        with pytest.raises(RuntimeError) as err:
            second.__enter__()
        msg = str(err.value.__cause__)
        assert "--disk-cache-dir" in msg and "in use by another kvserve process" in msg and "\n" not in msg


# ---- the session record store on its own -------------------------------------------------


def test_disk_session_store_survives_a_restart_and_drops_bad_files(tmp_path):
    import asyncio

    from kvserve.common.dirlock import DiskCacheLocked
    from kvserve.service.sessions import SessionRecord
    from kvserve.service.sessions.disk import DiskSessionStore
    from kvserve.service.sessions.stores import CONFLICT, WRITTEN, Expect

    async def scenario() -> None:
        root = tmp_path / "sessions"
        store = DiskSessionStore(root)
        a = SessionRecord("a", owner="t1", token_ids=[1, 2, 3], etag="e1", turns=1)
        b = SessionRecord("b", owner="t1", token_ids=[4], etag="e1")
        c = SessionRecord("c", owner="t2", token_ids=[5], etag="e1")
        assert await store.put_if(a, Expect.of(None), create=True) == WRITTEN
        await store.put(b)
        await store.put(c)
        a2 = SessionRecord("a", owner="t1", token_ids=[1, 2, 3, 9], etag="e2", turns=2)
        assert await store.put_if(a2, Expect(frozenset({"e1"}))) == WRITTEN
        stale = SessionRecord("a", owner="t1", token_ids=[7], etag="e3", turns=2)
        assert await store.put_if(stale, Expect(frozenset({"e1"}))) == CONFLICT  # nothing written
        assert await store.delete("t1", "b")
        with pytest.raises(DiskCacheLocked):
            DiskSessionStore(root)  # one process (one store) per directory
        await store.close()
        (root / "tmp" / "x.1.1.tmp").write_bytes(b"half")  # a crash mid-write
        f = store.path("t2", "c")
        f.write_bytes(f.read_bytes()[:-3])  # torn
        again = DiskSessionStore(root)
        assert await again.get("t1", "a") == a2  # the last acknowledged version
        assert await again.get("t1", "b") is None  # deleted stays deleted
        assert await again.get("t2", "c") is None and again.unreadable == 1 and not f.exists()
        assert list((root / "tmp").iterdir()) == []
        await again.close()

    asyncio.run(scenario())


# ---- the deploy files show it on a volume -------------------------------------------------


def test_compose_and_k8s_put_the_disk_tier_on_a_volume():
    from kvserve.service.config import ServerConfig
    from tests.system.test_deploy import COMPOSE, DOCKERFILE, Dockerfile, compose_env, k8s_resource, load_yaml

    compose = load_yaml(COMPOSE)
    svc = compose["services"]["kvserve-disk"]
    df = Dockerfile.parse(DOCKERFILE)
    cfg = ServerConfig.from_args([], {**{k: v for k, v in df.env().items() if k.startswith("KVSERVE_")}, **compose_env(svc)})
    assert cfg.redis_url is None and cfg.disk_cache_dir  # one machine: sessions persist beside the blocks
    volume, target = svc["volumes"][0].split(":")[:2]
    assert target == cfg.disk_cache_dir and volume in compose["volumes"]  # a named volume, its own
    assert all("kvserve-disk" not in str(s.get("volumes", "")) for n, s in compose["services"].items() if n != "kvserve-disk")
    dockerfile = DOCKERFILE.read_text()
    assert f"chown 10001:10001 {cfg.disk_cache_dir}" in dockerfile and "USER 10001:10001" in dockerfile

    config = load_yaml(Path(COMPOSE).parent / "deploy" / "k8s" / "configmap.yaml")["data"]
    k8s_cfg = ServerConfig.from_args([], config)
    pod = k8s_resource("Deployment", "kvserve")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert k8s_cfg.disk_cache_dir in mounts
    vol = next(v for v in pod["volumes"] if v["name"] == mounts[k8s_cfg.disk_cache_dir])
    from kvserve.service.config import parse_bytes

    assert parse_bytes(vol["emptyDir"]["sizeLimit"] + "B") > k8s_cfg.disk_cache_size


def test_an_fp8_kv_cache_resumes_from_disk_after_a_restart(tiny_llama_dir, tmp_path):
    """--kv-cache-format fp8: GetModelInfo reports the format's bytes per token (a block's
    e4m3 values and float32 scales over its tokens), and after a restart the session's
    next turn restores its fp8 blocks from the disk tier as they were written: the reply
    a fork of it got from the same blocks on the device before the restart."""
    from kvserve.service.models.loading import load_model

    root = tmp_path / "kv"
    spec = load_model(str(tiny_llama_dir), dtype="float32", device="cpu", progress=False).kv_spec(BLOCK_SIZE, "fp8")
    with disk_server(tiny_llama_dir, root, kv_cache_format="fp8") as s, KVServeClient(s.address, timeout=60) as c:
        info = c.model_info()
        assert info.bytes_per_token == spec.bytes_per_token == -(-spec.bytes_per_block // BLOCK_SIZE)
        assert info.dtype == "float32"  # the compute dtype
        c.chat("fox8", MSGS[0], max_new_tokens=10)
        t1 = c.get_session("fox8", include_token_ids=True).token_ids
        assert wait_until(lambda: c.get_session("fox8").cached_blocks.get("disk", 0) == len(t1) // BLOCK_SIZE > 0)
        c.fork_session("fox8", "fox8-device")
        ref = c.chat("fox8-device", MSGS[1], max_new_tokens=10)
        assert ref.start.cached_tier == "device"
    with disk_server(tiny_llama_dir, root, kv_cache_format="fp8") as s, KVServeClient(s.address, timeout=60) as c:
        r = c.chat("fox8", MSGS[1], max_new_tokens=10)
        full = len(t1) // BLOCK_SIZE * BLOCK_SIZE
        assert ref.start.cached_tokens == full  # (the fork's own turn spilled too: its prompt's blocks are on disk)
        assert r.start.cached_by_tier["disk"] >= full and r.start.cached_tokens == r.start.cached_by_tier["disk"]
        assert r.token_ids == ref.token_ids
        assert s.engine.cache_stats().store.tiers["disk"].failures == {}
