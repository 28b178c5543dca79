"""Tokenizer: round-trips, special tokens, chat templates, incremental detokenization.

The sentencepiece tokenizer is the one trained by the tiny_llama_dir fixture (BPE, byte
fallback); transformers' tokenizer loaded from the same directory is the reference for
chat rendering and for encoding text that contains special tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.service.models.config import ModelLoadError
from kvserve.service.models.tokenizer import BUILTIN_CHAT_TEMPLATE, DEFAULT_ROLES, Tokenizer

TEXTS = [
    "Hello world",
    "Tell me a story about 42 dogs, please!",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 中文字符, 日本語, 한국어",
    "emoji 😀👍🏽 and symbols € £ ¥ © ™ → ∑ √",
    "numbers 3.14159 -273.15 1e-9 0x1F 100%",
    'quotes "double" \'single\' `back` (parens) [brackets] {braces} <angle>',
    "",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there, how much is 6 x 7?"},
    {"role": "assistant", "content": "It is 42."},
    {"role": "user", "content": "And in Spanish? ¿Cuánto?"},
]
# "▁" (U+2581) is sentencepiece's space marker: in input text it decodes as a space.
_text = st.text(alphabet=st.characters(blacklist_characters="\u2581", blacklist_categories=("Cs",)), max_size=60)


@pytest.fixture(scope="module")
def sp_tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def gpt2_tok(tiny_gpt2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_gpt2_dir)


@pytest.fixture(scope="module")
def gpt2_vocab_merges_tok(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("gpt2_vocab_merges")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(tiny_gpt2_dir / name, d / name)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def hf_llama_tok(tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


# ---- encode / decode ----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_round_trip(sp_tok: Tokenizer, text: str) -> None:
    ids = sp_tok.encode(text)
    assert ids[0] == sp_tok.bos_token_id == 1
    assert sp_tok.decode(ids) == text
    assert sp_tok.encode(text, add_bos=False) == ids[1:]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_text)
def test_sentencepiece_round_trip_any_text(sp_tok: Tokenizer, text: str) -> None:
    assert sp_tok.decode(sp_tok.encode(text)) == text


def test_non_ascii_uses_byte_fallback(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("中文 😀", add_bos=False)
    pieces = [sp_tok._backend.sp.id_to_piece(i) for i in ids]
    assert any(p.startswith("<0x") for p in pieces)  # really byte tokens, not <unk>
    assert 0 not in ids  # no <unk>


@pytest.mark.parametrize("name", ["gpt2_tok", "gpt2_vocab_merges_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_round_trip(request: pytest.FixtureRequest, name: str, text: str) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == tok.encode(text, add_bos=False)  # GPT-2 adds no bos


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_and_vocab_merges_agree(gpt2_tok: Tokenizer, gpt2_vocab_merges_tok: Tokenizer, text: str) -> None:
    assert gpt2_tok.encode(text) == gpt2_vocab_merges_tok.encode(text)
    assert gpt2_tok.eos_token_ids == gpt2_vocab_merges_tok.eos_token_ids == (gpt2_tok.token_to_id("<|endoftext|>"),)


def test_special_token_strings_map_to_their_ids(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("hi</s>there", add_bos=False)
    assert ids.count(2) == 1
    assert sp_tok.decode(ids) == "hithere"  # special tokens are skipped on decode
    assert sp_tok.encode("<s>x", add_bos=False)[0] == 1


# Whitespace runs are left out: ours keeps sentencepiece's own encoding of them (which
# round-trips), transformers' Metaspace pre-tokenizer splits them differently.
@pytest.mark.parametrize("text", [t for t in TEXTS if "  " not in t and not t.startswith(" ")])
def test_sentencepiece_matches_transformers_on_plain_and_chat_text(sp_tok: Tokenizer, hf_llama_tok, text: str) -> None:
    assert sp_tok.encode(text) == hf_llama_tok.encode(text)
    rendered = sp_tok.apply_chat_template(CHAT + [{"role": "user", "content": text}])
    assert sp_tok.encode(rendered) == hf_llama_tok.encode(rendered)


# ---- chat templates -----------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(sp_tok: Tokenizer, hf_llama_tok, add_generation_prompt: bool) -> None:
    ours = sp_tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    want = hf_llama_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == want


def test_known_roles_come_from_the_template(sp_tok: Tokenizer, gpt2_tok: Tokenizer) -> None:
    assert set(sp_tok.known_roles) == {"system", "user", "assistant"}
    assert gpt2_tok.chat_template is None and gpt2_tok.known_roles == DEFAULT_ROLES


def test_builtin_template_when_the_checkpoint_has_none(gpt2_tok: Tokenizer) -> None:
    from jinja2 import Template

    msgs = CHAT[:2]
    assert gpt2_tok.apply_chat_template(msgs) == Template(BUILTIN_CHAT_TEMPLATE).render(
        messages=msgs, add_generation_prompt=True)
    text = gpt2_tok.apply_chat_template(msgs)
    assert text.endswith("assistant:") and all(f"{m['role']}: {m['content']}" in text for m in msgs)
    assert not gpt2_tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant:")


def _with_template(src: Path, dst: Path, template: object) -> Tokenizer:
    dst.mkdir()
    shutil.copy(src / "tokenizer.model", dst / "tokenizer.model")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_dir(dst)


def test_template_raise_exception_and_sandbox(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tok = _with_template(tiny_llama_dir, tmp_path / "a",
                         "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    evil = _with_template(tiny_llama_dir, tmp_path / "b", "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_template_list_picks_default(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tok = _with_template(tiny_llama_dir, tmp_path / "a", [{"name": "tool_use", "template": "T"},
                                                          {"name": "default", "template": "D"}])
    assert tok.apply_chat_template(CHAT) == "D"


def test_invalid_template_is_a_load_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="chat_template"):
        _with_template(tiny_llama_dir, tmp_path / "a", "{% for %}")


def test_encode_chat_adds_bos_once(sp_tok: Tokenizer, tiny_llama_dir: Path, tmp_path: Path) -> None:
    ids = sp_tok.encode_chat(CHAT)
    assert ids[0] == 1 and ids.count(1) == 1
    with_bos = _with_template(tiny_llama_dir, tmp_path / "a", "{{ bos_token }}{{ messages[0]['content'] }}")
    ids = with_bos.encode_chat(CHAT)
    assert ids[0] == 1 and ids.count(1) == 1


def test_no_tokenizer_files_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_dir(tmp_path)


# ---- incremental detokenization -----------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str]:
    detok = tok.detokenizer()
    parts = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(detok.flush())
    assert detok.text == "".join(parts)
    return parts, "".join(parts)


@pytest.mark.parametrize("name", ["sp_tok", "gpt2_tok"])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_final_decode(request: pytest.FixtureRequest, name: str, text: str, chunk: int) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(text, add_bos=False)
    parts, streamed = _stream(tok, ids, chunk)
    assert streamed == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in parts)  # never half a character


def test_streamed_text_keeps_word_boundaries(sp_tok: Tokenizer) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    parts, streamed = _stream(sp_tok, sp_tok.encode(text, add_bos=False))
    assert streamed == text
    assert sum(p.startswith(" ") for p in parts) >= 5  # spaces arrive with the words that follow them


def test_multibyte_character_is_held_until_complete(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("a😀", add_bos=False)
    byte_ids = [i for i in ids if sp_tok._backend.sp.id_to_piece(i).startswith("<0x")]
    assert len(byte_ids) == 4  # the emoji is four byte-fallback tokens
    detok = sp_tok.detokenizer()
    out = [detok.push([i]) for i in ids]
    assert out[-4:-1] == ["", "", ""] and out[-1] == "😀"


def test_incomplete_character_is_flushed_at_the_end(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("é", add_bos=False)[:-1]  # drop the last byte of the character
    detok = sp_tok.detokenizer()
    assert "".join(detok.push([i]) for i in ids) == ""
    assert detok.flush() == sp_tok.decode(ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_equals_decode_for_any_ids(sp_tok: Tokenizer, gpt2_tok: Tokenizer, data: st.DataObject) -> None:
    for tok in (sp_tok, gpt2_tok):
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
        chunk = data.draw(st.integers(1, 4))
        assert _stream(tok, ids, chunk)[1] == tok.decode(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=0, max_value=399), max_size=24))
def test_sentencepiece_decode_is_the_processors_own(sp_tok: Tokenizer, ids: list[int]) -> None:
    """Decoding calls sentencepiece's C++ method directly where the installed version has
    it (its Python ``decode`` classifies the input on every call): the same text as
    ``decode``, control and byte tokens, empty input included."""
    backend = sp_tok._backend
    raw = getattr(getattr(backend.sp, "_processor", None), "_DecodeIds", None)
    assert backend._decode_ids == (raw if raw is not None else backend.sp.decode)  # direct where there is one
    assert sp_tok.decode(ids) == backend.sp.decode(list(ids))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab é€😀\n")), max_size=30), cuts=st.lists(st.integers(1, 5), max_size=12))
def test_deferred_tokens_stream_the_text_of_tokens_pushed_one_by_one(sp_tok: Tokenizer, text: str, cuts: list[int]) -> None:
    """A verification's tokens deferred and released at once (``TextStream.defer``, one
    decode for several) stream the text pushing them one at a time streams: at each release
    a prefix of it (a group that ends mid-character holds its text until the character is
    whole, spaces before it included), at the end all of it, multi-byte characters split
    across tokens included; ``finish`` releases what is held. A stream with stop strings
    refuses to defer (their check is per token's text)."""
    from kvserve.service.engine.sequence import TextStream

    ids = sp_tok.encode(text, add_bos=False)
    one, grouped = TextStream(sp_tok.detokenizer()), TextStream(sp_tok.detokenizer())
    at, by_one, by_group = 0, "", ""
    for n in cuts:
        group = ids[at : at + n]
        at += len(group)
        for tok in group:
            by_one += one.push([tok])
            grouped.defer([tok])
        by_group += grouped.release()
        assert by_one.startswith(by_group)
    grouped.defer(ids[at:])
    for tok in ids[at:]:
        by_one += one.push([tok])
    assert by_group + grouped.finish() == by_one + one.finish() == sp_tok.decode(ids)
    with pytest.raises(ValueError, match="stop strings"):
        TextStream(sp_tok.detokenizer(), ["END"]).defer([1])
