"""The shipped default model (``service/default_model/``, made by tools/train_default_model.py).

It must be a standard HF Llama checkpoint (transformers loads it; so does our loader, with
the same logits), small enough to ship, with a tokenizer and chat template whose turns end
with ``</s>`` as the model was trained, and it must write English: greedy text from "The" is mostly common English words, and a
plain English passage is likely under it; checks that the same network with random weights
fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

from kvserve.service.engine.config import DEFAULT_MODEL_DIR  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402

MODEL_DIR = Path(DEFAULT_MODEL_DIR)
SHIPPED = ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
           "generation_config.json", "README.md")
MAX_BYTES = 25 * 1024 * 1024

# Common English words (function words, everyday verbs, nouns and adjectives), written here
# so that the check needs no corpus. Deliberately general, not taken from the training text.
ENGLISH = frozenset("""
a about above after again against all almost alone along already also although always am
among an and another any anything are around as ask asked at away back bad be became because
become been before began behind being believe best better between big black boat body book
both boy bring brought but by call called came can cannot case certain child children city
clear close cold come coming could country course cried cry dark day days dead dear did
different do does done door down during each early earth eat end enough even evening ever
every everything eye eyes face fact fall family far father fear feel feet felt few find fine
fire first five followed food foot for found four free friend friends from front full gave
get give given go going gone good got great ground had half hand hands happy hard has have
he head hear heard heart held help her here herself high him himself his home horse hot
hour house how however i if in indeed into is it its itself just keep kept kind knew know
known land large last late laugh laughed least leave left less let life light like little
live long look looked looking lost love made make man many may me mean men might mind
minutes moment money more morning most mother much must my myself name near need never new
next night no none nor not nothing now of off often oh old on once one only open or order
other others our out over own paper part people perhaps person place play poor power
put question quite rather read ready real really reason red replied rest right room round
said same saw say saying school sea second see seemed seen sent set several shall she short
should show side since sir sit small so some something sometimes soon sort sound speak
stand still stood stop story street strong such sure take taken talk teacher tell than that
the their them themselves then there these they thing things think third this those though
thought three through time to today together told too took toward town tree true try turn
turned two under until up upon us use used very voice wait walk want wanted war was watch
water way we well went were what when where whether which while white who whole whom why
wife will wind window with within without woman women word words work world would write
wrong year years yes yet you young your yourself
""".split())


# Plain English written for this test (not from the training text), and the most mean
# next-token loss a model may have on it: a uniform guess over 2048 pieces costs ln 2048 = 7.6.
PASSAGE = (
    "When I came home in the evening, my old friend was waiting for me at the gate. "
    "He said that he had been to the town to buy some books, but the shop was closed, "
    "so he had walked back along the river. I told him that I was very tired and wanted to sleep."
)
MAX_PASSAGE_LOSS = 5.5


def passage_loss(model, sp) -> float:
    """Mean next-token cross-entropy of ``model`` on ``<s>`` + PASSAGE."""
    ids = torch.tensor([[sp.bos_id()] + sp.encode(PASSAGE)])  # (1, T)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]  # (T-1, V)
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()


def english_score(text: str) -> tuple[int, float, int]:
    """(words, fraction of them in ENGLISH, distinct ENGLISH words) of ``text``."""
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    known = [w for w in words if w in ENGLISH]
    return len(words), len(known) / max(1, len(words)), len(set(known))


def writes_english(text: str) -> bool:
    n, frac, distinct = english_score(text)
    return n >= 12 and frac >= 0.6 and distinct >= 8


def greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` with a transformers model, ignoring end-of-turn."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.fixture(scope="module")
def sp():
    return sentencepiece.SentencePieceProcessor(model_file=str(MODEL_DIR / "tokenizer.model"))


@pytest.fixture(scope="module")
def ours():
    return load_model(MODEL_DIR, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def hf_model():
    torch.set_num_threads(1)
    return transformers.LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def test_shipped_files_exist_and_fit():
    for name in SHIPPED:
        assert (MODEL_DIR / name).is_file(), f"{MODEL_DIR / name} is missing"
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total < MAX_BYTES, f"default model is {total / 1e6:.1f} MB, over 25 MiB"


def test_config_is_a_standard_llama(sp):
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == sp.get_piece_size()
    assert cfg["max_position_embeddings"] >= 512
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (sp.bos_id(), sp.eos_id())
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] in (sp.eos_id(), [sp.eos_id()])
    tok_cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<s>", "</s>")


def test_tokenizer_is_llama_style_bpe_with_byte_fallback(sp):
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert sp.get_piece_size() == 2048
    text = 'He said, "Where are you going, Kiyo?"\nThe café costs ¥1200 — 日本.\n'
    ids = sp.encode(text)
    assert sp.decode(ids) == text
    assert sp.unk_id() not in ids  # byte fallback covers what the pieces do not
    assert ids.count(sp.piece_to_id("\n")) == 2  # a newline is always exactly one token
    # no dummy-prefix space: a turn encoded on its own gives the tokens it gives in context
    head, tail = text.split("\n", 1)
    assert sp.encode(head + "\n") + sp.encode(tail) == ids
    assert sp.encode("The school") == sp.encode("I saw it.The school")[-len(sp.encode("The school")):]


def test_chat_template_renders_one_paragraph_per_message(sp, ours):
    tok = ours.tokenizer
    messages = [
        {"role": "user", "content": "Where are you\ngoing?"},
        {"role": "assistant", "content": "I went to the school."},
        {"role": "user", "content": '"Why?" he asked.'},
    ]
    assert tok.apply_chat_template(messages) == (
        '"Where are you going?"</s>I went to the school.</s>"Why?" he asked.</s>'
    )
    # as in training: <s>, then each paragraph's pieces followed by the eos id
    want = [sp.bos_id()]
    for paragraph in ('"Where are you going?"', "I went to the school.", '"Why?" he asked.'):
        want += sp.encode(paragraph) + [sp.eos_id()]
    assert tok.encode_chat(messages) == want
    assert ours.eos_token_ids == (sp.eos_id(),)


def test_greedy_text_from_the_is_english(sp, hf_model):
    ids = [sp.bos_id()] + sp.encode("The")
    text = sp.decode(ids[1:] + greedy(hf_model, ids, 64))
    n, frac, distinct = english_score(text)
    assert writes_english(text), f"{text!r}: {n} words, {frac:.0%} common English, {distinct} distinct"


def test_plain_english_is_likely(sp, hf_model):
    loss = passage_loss(hf_model, sp)
    assert loss < MAX_PASSAGE_LOSS, f"mean loss {loss:.2f} on plain English"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_english_checks_fail_for_random_weights(sp, hf_model, seed):
    torch.manual_seed(seed)
    random_model = transformers.LlamaForCausalLM(hf_model.config).eval()
    ids = [sp.bos_id()] + sp.encode("The")
    text = sp.decode(ids[1:] + greedy(random_model, ids, 64))
    assert not writes_english(text), text
    assert passage_loss(random_model, sp) > MAX_PASSAGE_LOSS


def test_our_loader_matches_transformers(sp, hf_model, ours):
    text = ours.tokenizer.apply_chat_template([{"role": "user", "content": "Where are you going?"}])
    ids = ours.tokenizer.encode(text) + sp.encode("I went to the school and saw the principal.")
    assert ours.tokenizer.encode(text) == [sp.bos_id()] + sp.encode(text[: -len("</s>")]) + [sp.eos_id()]
    x = torch.tensor([ids])  # (1, T)
    with torch.no_grad():
        want = hf_model(x).logits
        got = ours.model.forward_nocache(x)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    # and the two agree on a greedy continuation token for token
    cont = list(ids)
    with torch.no_grad():
        for _ in range(16):
            cont.append(int(ours.model.forward_nocache(torch.tensor([cont]))[0, -1].argmax()))
    assert cont[len(ids):] == greedy(hf_model, ids, 16)


def test_chat_template_accepts_system_user_and_assistant(sp, ours):
    tok = ours.tokenizer
    assert set(tok.known_roles) == {"system", "user", "assistant"}
    messages = [
        {"role": "system", "content": "A story about a school."},
        {"role": "user", "content": "Where are you going?"},
        {"role": "assistant", "content": "I went to the school."},
        {"role": "user", "content": "Why?"},
    ]
    assert tok.apply_chat_template(messages) == (
        'A story about a school.</s>"Where are you going?"</s>I went to the school.</s>"Why?"</s>'
    )


def test_a_live_server_serves_every_chat_role_and_refuses_others():
    import grpc

    from kvserve.proto.kvserve.v1 import generation_pb2 as pb
    from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
    from tests.fixtures.serving import ServerThread, tiny_config

    def chat(*messages):
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_new_tokens=3))
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
        return list(stub.Generate(req, timeout=60))

    with ServerThread(tiny_config(MODEL_DIR, kv_cache_memory=64 << 20, block_size=16)) as s:
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            events = chat(("system", "A story."), ("user", "Hello."), ("assistant", "Hi."), ("user", "Why?"))
            assert events[-1].final.usage.completion_tokens >= 1
            with pytest.raises(grpc.RpcError) as e:
                chat(("robot", "x"))  # ("tool" is a tool's result now: tests/service/test_tools_grpc.py)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "role 'robot' is unknown" in e.value.details()
