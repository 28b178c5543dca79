"""Tokenizers read from GGUF metadata (``tokenizer.ggml.*``) against the Hugging Face
tokenizer of the same model, on a corpus of English, Unicode, code, whitespace runs,
digits, contractions and special tokens spelled in the text:

- sentencepiece ("llama" vocabularies: pieces, scores, types): the tiny Llama's trained
  ``tokenizer.model`` and the packaged default model's, against sentencepiece on the
  directory's model and transformers' tokenizer of the directory (bos included, as the
  file says);
- byte-level BPE ("gpt2" vocabularies: tokens, merges, control and user-defined tokens):
  the tiny GPT-2's, and tiny tokenizers trained here with each pre-tokenizer the loader
  names (GPT-2's, SmolLM's digits, Llama 3's and Qwen2's split rules, Qwen2's NFC),
  against their ``tokenizer.json`` in ``tokenizers``.

The chat template, the bos and the end-of-generation tokens come from the file too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.service.engine.config import DEFAULT_MODEL_DIR
from kvserve.service.models.config import ModelLoadError
from kvserve.service.models.gguf import read_tokenizer
from kvserve.service.models.tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT, Tokenizer
from tests.fixtures.gguf_files import write_gguf, write_vocab_gguf
from tests.fixtures.models import english_corpus

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = english_corpus(120, seed=5) + [
    "Hello world",
    "  leading spaces,   runs   of spaces\t\ttabs\n\n\nnew lines  ",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 中文字符, 日本語, 한국어",
    "emoji 😀👍🏽 ✅ 🦙🦙 and symbols € £ ¥ © ™ → ∑ √",
    "def square(x):\n    return x ** 2  # comment\n\nclass A:\n\tpass\r\n",
    'if (a && b) { printf("%d\\n", a[i]); }  // C',
    "numbers 3 33 333 3333 33333 3.14159 -273.15 1e-9 0x1F 100%",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    # llama.cpp's probe text for its pre-tokenizer hash (convert_hf_to_gguf.py's chktxt)
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо "
    "на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there",
    "",
    " ",
    "\n",
    "a",
    "trailing space ",
]


def _check_encode_decode(ours: Tokenizer, encode, decode, texts: list[str]) -> None:
    for text in texts:
        ids = encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == decode(ids), text


# ---- sentencepiece ------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model_gguf(tmp_path_factory) -> Path:
    return write_gguf(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("gguf_default") / "default.gguf", "F16")


@pytest.mark.parametrize("which", ["tiny_llama", "default_model"])
def test_sentencepiece_vocabulary_equals_transformers(request, which: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    if which == "tiny_llama":
        src = request.getfixturevalue("tiny_llama_dir")
        path = write_gguf(src, tmp_path / "m.gguf")
    else:
        src, path = DEFAULT_MODEL_DIR, request.getfixturevalue("default_model_gguf")
    hf, ours = AutoTokenizer.from_pretrained(str(src)), read_tokenizer(path)
    texts = CORPUS + ["<s> bos and </s> eos spelled in the text</s>", "<unk> too", "tokens</s><s>glued"]
    # every text against sentencepiece itself (what the directory serves, and llama.cpp's
    # tokenizer: "▁" for each space, merged by score), and against transformers: all of them
    # for the default model; for the tiny Llama, whose tokenizer_config leaves transformers
    # in its legacy Metaspace mode, the texts without runs of spaces (test_tokenizer.py's rule)
    direct = Tokenizer.from_dir(src)
    _check_encode_decode(ours, direct.encode, direct.decode, texts)
    texts = [t for t in texts if "<unk>" not in t]  # sentencepiece decodes it as " ⁇ ", transformers skips it
    if which == "tiny_llama":
        texts = [t for t in texts if "  " not in t and not t.startswith(" ")]
    _check_encode_decode(ours, hf.encode, lambda ids: hf.decode(ids, skip_special_tokens=True), texts)
    assert ours.encode("Hello")[0] == ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == (hf.eos_token_id,)
    assert ours.vocab_size == Tokenizer.from_dir(src).vocab_size
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "And now?"}]  # fmt: skip
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)  # fmt: skip


def test_sentencepiece_token_bytes_are_the_directorys(tiny_llama_dir, tmp_path: Path) -> None:
    """Constrained decoding reads a sentencepiece vocabulary piece by piece (grammar.py)."""
    ours = read_tokenizer(write_gguf(tiny_llama_dir, tmp_path / "m.gguf"))
    assert ours.token_bytes() == Tokenizer.from_dir(tiny_llama_dir).token_bytes()


# ---- byte-level BPE -----------------------------------------------------------------


def _train_bpe(out: Path, splits: list[str], nfc: bool, bos: str | None) -> Path:
    """A byte-level BPE tokenizer.json as the family has it (its pre-tokenizer, normalizer,
    bos post-processor), with special and one user-defined token. Its merges are learnt
    under GPT-2's rule for every family, so the vocabulary has tokens that only some
    families' rules can produce (" 33", "333", "'RE"): the rules decide the tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIALS + ([bos] if bos and bos not in SPECIALS else [])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(english_corpus(600) + CORPUS * 20, trainer)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos or "<|endoftext|>", "eos_token": "<|im_end|>",
           "add_bos_token": bool(bos), "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
           "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
BPE_FAMILIES = {  # tokenizer.ggml.pre -> the family's tokenizer.json: split rules, NFC, bos added
    "gpt-2": ([GPT2_SPLIT], False, None),
    "smollm": ([r"\p{N}", GPT2_SPLIT], False, None),  # SmolLM2: Digits(individual) + ByteLevel
    "llama-bpe": ([_LLAMA3_SPLIT], False, "<|begin_of_text|>"),  # Llama 3
    "qwen2": ([_QWEN2_SPLIT], True, None),  # Qwen2 / Qwen2.5 / Qwen3
}


@pytest.mark.parametrize("pre", list(BPE_FAMILIES))
def test_byte_level_bpe_vocabulary_equals_its_tokenizer_json(pre: str, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    splits, nfc, bos = BPE_FAMILIES[pre]
    src = _train_bpe(tmp_path / "tok", splits, nfc, bos)
    hf = HFTokenizer.from_file(str(src / "tokenizer.json"))
    ours = read_tokenizer(write_vocab_gguf(src, tmp_path / "vocab.gguf", pre))
    texts = CORPUS + ["<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "a <tool> call<|endoftext|>",
                      "cafe\u0301 (e + combining acute) and café"]  # fmt: skip
    _check_encode_decode(ours, lambda t: hf.encode(t).ids, lambda ids: hf.decode(ids, skip_special_tokens=True), texts)
    assert ours.encode("x", add_bos=False) == hf.encode("x", add_special_tokens=False).ids
    assert (ours.encode("x")[0] == hf.token_to_id(bos)) if bos else ours.encode("x") == ours.encode("x", add_bos=False)
    assert ours.eos_token_ids[0] == hf.token_to_id("<|im_end|>")
    assert hf.token_to_id("<|endoftext|>") in ours.eos_token_ids  # an end-of-generation token by its spelling
    assert ours.special_id("<|im_start|>") == hf.token_to_id("<|im_start|>") and ours.special_id("<tool>") is None
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gpt2_vocabulary_equals_transformers(tiny_gpt2_dir, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_gpt2_dir))
    ours = read_tokenizer(write_gguf(tiny_gpt2_dir, tmp_path / "m.gguf"))
    _check_encode_decode(ours, hf.encode, lambda ids: hf.decode(ids, skip_special_tokens=True),
                         CORPUS + ["<|endoftext|>in the text"])  # fmt: skip
    assert ours.bos_token_id == hf.bos_token_id and ours.eos_token_ids == (hf.eos_token_id,)


def test_an_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    src = _train_bpe(tmp_path / "tok", [GPT2_SPLIT], False, None)
    path = write_vocab_gguf(src, tmp_path / "vocab.gguf", "chameleon")
    with pytest.raises(ModelLoadError, match=r"vocab\.gguf: tokenizer\.ggml\.pre 'chameleon' is not supported; supported: "):
        read_tokenizer(path)


def test_a_chat_continuation_after_any_end_token_adds_no_second_one(tmp_path: Path) -> None:
    """A transcript that ends with one of several end-of-generation tokens (<|im_end|>, or
    <|endoftext|>) is continued without writing that token again."""
    src = _train_bpe(tmp_path / "tok", [GPT2_SPLIT], False, None)
    tok = read_tokenizer(write_vocab_gguf(src, tmp_path / "vocab.gguf", "gpt-2"))
    first = tok.encode_chat_turn([], [{"role": "user", "content": "hi"}])
    im_end = tok.token_to_id("<|im_end|>")
    answered = first + tok.encode("hello", add_bos=False) + [im_end]
    nxt = tok.encode_chat_turn(answered, [{"role": "user", "content": "more"}])
    assert tok.decode(nxt) == tok.decode(tok.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"))
    assert im_end not in nxt[:1]
