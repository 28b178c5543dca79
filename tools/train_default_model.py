"""Train kvserve's default model: a small Llama that writes English, from scratch, on CPU.

What it does, top to bottom (every step is deterministic: fixed seeds, fixed data order):

1. Corpus. ``pip download --no-binary :all: --no-deps sentencepiece==0.2.1`` into a cache
   folder (``.corpus/``, git-ignored) and extract ``test/botchan.txt`` from the sdist:
   *Botchan (Master Darling)* by Natsume Soseki, translated by Yasotaro Morri (1919), a
   Project Gutenberg eBook (#8868), public domain in the U.S. Nothing else is downloaded.
   The Gutenberg header and license are cut off, footnotes removed, and the hard-wrapped
   lines are joined into paragraphs (a short line ends a paragraph); long paragraphs are
   split at sentence ends into short ones (2-4 sentences). Each paragraph ends with
   ``</s>``: the model learns to end a paragraph, and so a chat turn.
2. Tokenizer. A sentencepiece BPE model with byte fallback, 2048 pieces, trained on the
   same text, Llama's special ids (``<unk>``=0, ``<s>``=1, ``</s>``=2), identity
   normalization, digits split, ``"\\n"`` a user-defined piece (always one token). There is
   no dummy-prefix space, so text encodes the same at the start of a sequence as after a
   ``</s>`` or a newline: a conversation rendered turn by turn gives the token transcript it
   would give rendered at once.
3. Model. A Llama (RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention, tied
   embeddings) written below with HF Llama's exact math and tensor names, trained with
   AdamW (warmup + cosine) on random 512-token windows that start with ``<s>`` at a
   paragraph start. The last paragraphs of the book are held out; the checkpoint with the
   lowest held-out loss is kept.
4. Export in Hugging Face format into ``service/default_model/``: ``config.json``,
   ``model.safetensors`` (float32), ``tokenizer.model``, ``tokenizer_config.json`` (with the
   chat template), ``generation_config.json`` and a ``README.md`` model card. The export is
   checked by loading it back with ``transformers.LlamaForCausalLM`` and comparing logits.
5. Sample generations are printed (and written into the model card).

The chat format follows how the book is written: every message is one paragraph closed by
``</s>``, a user's words are rendered as quoted speech, and the model's reply is the next
paragraph, which it ends with ``</s>`` like every paragraph it has read.

Shipped run: ``python tools/train_default_model.py`` (defaults below) takes 15 minutes on
1 of 2 CPU cores (``torch.set_num_threads(1)``; CPU time of the training loop, more wall
clock when the machine is shared); the figures of the shipped run are in
``service/default_model/README.md`` and ``docs/default-model.md``. ``--steps 40 --out /tmp/x`` is a
one-minute smoke run of the whole pipeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
SENTENCEPIECE_SDIST_VERSION = "0.2.1"
BOTCHAN_MEMBER = f"sentencepiece-{SENTENCEPIECE_SDIST_VERSION}/test/botchan.txt"
BOTCHAN_SHA256 = "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7"

# The chat template (jinja, rendered by the service and by transformers alike). One paragraph
# per message, closed by eos (the "</s>" string encodes to its id, as HF tokenizers do); a
# user's words become quoted speech unless already quoted; system and assistant messages are
# plain paragraphs (named, so the service accepts the three roles); newlines inside a message become
# spaces (the book's paragraphs have none). The model's turn needs no prompt: it is simply
# the next paragraph.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set text = message['content'] | replace('\\n', ' ') | trim -%}"
    "{%- if message['role'] == 'user' and not text.startswith('\"') -%}"
    "\"{{ text }}\""
    "{%- elif message['role'] == 'system' or message['role'] == 'assistant' -%}"
    "{{ text }}"
    "{%- else -%}"
    "{{ text }}"
    "{%- endif -%}"
    "{{ eos_token }}"
    "{%- endfor -%}"
)


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Shape of the Llama; the names follow HF ``LlamaConfig``."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.3  # training only (residual + embedding); the export has none

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    seed: int = 1337
    steps: int = 600
    batch_size: int = 4  # windows per step
    seq_len: int = 512  # tokens per window, <s> included
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    val_fraction: float = 0.05
    threads: int = 1


# --------------------------------------------------------------------------------------
# 1. Corpus
# --------------------------------------------------------------------------------------


def fetch_botchan(cache_dir: Path) -> str:
    """Return the text of botchan.txt, downloading the sentencepiece sdist from PyPI once."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    txt = cache_dir / "botchan.txt"
    if not txt.exists():
        sdist = cache_dir / f"sentencepiece-{SENTENCEPIECE_SDIST_VERSION}.tar.gz"
        if not sdist.exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 f"sentencepiece=={SENTENCEPIECE_SDIST_VERSION}", "-d", str(cache_dir)],
                check=True,
            )
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(BOTCHAN_MEMBER)
            assert member is not None, f"{BOTCHAN_MEMBER} not in {sdist}"
            txt.write_bytes(member.read())
    data = txt.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != BOTCHAN_SHA256:
        raise SystemExit(f"{txt}: sha256 {digest} != expected {BOTCHAN_SHA256}")
    return data.decode("utf-8-sig")


_SENTENCE_END = re.compile(r'(?<=[.!?])["\']?\s+(?=["\'(]?[A-Z])')


def _sentences(paragraph: str) -> list[str]:
    """Split at '.', '!' or '?' (a closing quote kept) followed by a capitalised word."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(paragraph):
        end = m.start() + len(m.group(0).rstrip())
        out.append(paragraph[start:end].strip())
        start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


def paragraphs_from_gutenberg(raw: str, rng: random.Random, max_words: int = 60) -> list[str]:
    """The book's body as a list of short paragraphs (one line each, no newlines inside).

    The file's blank lines are gone, so a line shorter than the wrap width ends a paragraph.
    Paragraphs longer than ``max_words`` are cut at sentence ends into runs of 2-4 sentences.
    """
    lines = raw.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("*** START OF")) + 1
    end = next(i for i, l in enumerate(lines) if l.startswith("End of Project Gutenberg"))
    body = [l.strip() for l in lines[start:end] if not l.startswith("Produced by")]

    joined, cur = [], []
    for line in body:
        cur.append(line)
        if len(line) < 60:
            joined.append(" ".join(cur))
            cur = []
    if cur:
        joined.append(" ".join(cur))

    paragraphs = []
    for p in joined:
        p = re.sub(r"\[Footnote [^\]]*\]", " ", p)  # translator's footnotes
        p = re.sub(r"\s?\[[0-9A-Z]\]", "", p)  # their markers
        p = re.sub(r"\s+", " ", p).strip()
        if not p:
            continue
        sents = _sentences(p)
        if len(p.split()) <= max_words or len(sents) < 3:
            paragraphs.append(p)
            continue
        i = 0
        while i < len(sents):
            n = rng.randint(2, 4)
            paragraphs.append(" ".join(sents[i:i + n]))
            i += n
    return paragraphs


# --------------------------------------------------------------------------------------
# 2. Tokenizer
# --------------------------------------------------------------------------------------


def train_tokenizer(paragraphs: list[str], out_file: Path, vocab_size: int):
    """Train a sentencepiece BPE model (byte fallback, Llama special ids) into ``out_file``."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "sp"
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(paragraphs),
            model_prefix=str(prefix),
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,  # encode(a + "\n" + b) == encode(a + "\n") + encode(b)
            split_digits=True,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            max_sentence_length=1 << 16,
            num_threads=1,
            minloglevel=2,
        )
        proto = sp_pb2.ModelProto()
        proto.ParseFromString(prefix.with_suffix(".model").read_bytes())
        proto.trainer_spec.model_prefix = "tokenizer"  # not the temporary path: same bytes every run
        out_file.write_bytes(proto.SerializeToString())
    return spm.SentencePieceProcessor(model_file=str(out_file))


# --------------------------------------------------------------------------------------
# 3. Model: HF Llama's math and tensor names, plus dropout for training
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, hd) cos and sin, HF layout (the two halves of the head dimension are rotated)."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hd)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, n_kv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class Llama(nn.Module):
    """Parameter names equal HF ``LlamaForCausalLM``'s (``model.layers.0.self_attn.q_proj...``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.drop = nn.Dropout(args.dropout)
        cos, sin = rope_cos_sin(args, args.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 style scaled init of residual outputs
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * args.num_hidden_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx: (B, T) -> logits (B, T, V)
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.drop(self.model.embed_tokens(idx))  # (B, T, C)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def encode_paragraphs(sp, paragraphs: list[str]) -> tuple[torch.Tensor, list[int]]:
    """One token stream, each paragraph followed by ``</s>``; returns it and the paragraph starts."""
    stream, starts = [], []
    for p in paragraphs:
        starts.append(len(stream))
        stream.extend(sp.encode(p))
        stream.append(sp.eos_id())
    return torch.tensor(stream, dtype=torch.long), starts


def get_batch(stream: torch.Tensor, starts: list[int], bos: int, n: int, seq_len: int,
              g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows ``[<s>, tokens from a random paragraph start...]`` -> (x, y), each (n, seq_len)."""
    usable = [s for s in starts if s + seq_len <= len(stream)]
    picks = torch.randint(len(usable), (n,), generator=g).tolist()
    rows = [torch.cat((torch.tensor([bos]), stream[usable[i]:usable[i] + seq_len])) for i in picks]
    batch = torch.stack(rows)  # (n, seq_len + 1)
    return batch[:, :-1], batch[:, 1:]


@torch.no_grad()
def evaluate(model: Llama, stream: torch.Tensor, bos: int, seq_len: int) -> float:
    """Mean next-token loss over consecutive windows ``[<s>, chunk[:-1]] -> chunk`` covering ``stream``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(stream), seq_len):
        y = stream[i:i + seq_len]  # (T,)
        x = torch.cat((torch.tensor([bos]), y[:-1]))[None]  # (1, T)
        total += F.cross_entropy(model(x)[0], y, reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def lr_at(step: int, t: TrainArgs) -> float:
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def train(model: Llama, train_stream, train_starts, val_stream, bos: int, t: TrainArgs) -> dict:
    """Train in place; the weights with the lowest held-out loss are loaded back at the end."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    g = torch.Generator().manual_seed(t.seed)
    best = {"val_loss": float("inf"), "step": -1, "state": None}
    history = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    smooth = None
    model.train()
    for step in range(t.steps + 1):
        if step % t.eval_every == 0 or step == t.steps:
            val = evaluate(model, val_stream, bos, t.seq_len)
            elapsed = time.perf_counter() - t0
            history.append({"step": step, "train_loss": smooth, "val_loss": val, "elapsed_s": elapsed})
            mark = ""
            if val < best["val_loss"]:
                best = {"val_loss": val, "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
                mark = " *"
            tl = f"{smooth:.3f}" if smooth is not None else "  -  "
            print(f"step {step:5d} | train {tl} | val {val:.3f}{mark} | {elapsed / 60:5.1f} min", flush=True)
        if step == t.steps:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        x, y = get_batch(train_stream, train_starts, bos, t.batch_size, t.seq_len, g)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
    train_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    model.load_state_dict(best["state"])
    model.eval()
    return {"best_step": best["step"], "best_val_loss": best["val_loss"], "train_seconds": train_s,
            "train_cpu_seconds": cpu_s,
            "history": history}


# --------------------------------------------------------------------------------------
# 4. Export (HF format) and 5. samples
# --------------------------------------------------------------------------------------


def export_hf(model: Llama, sp, tokenizer_file: Path, out: Path) -> None:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    a = model.args
    config = LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim,
        max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta, hidden_act="silu", attention_bias=False, mlp_bias=False,
        tie_word_embeddings=True, bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(),
        initializer_range=0.02, attention_dropout=0.0,
    )
    hf = LlamaForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    hf.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)
    # Loaders written for transformers 4.x read the top-level rope_theta: keep both spellings.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", a.rope_theta)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    GenerationConfig(
        bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(), pad_token_id=sp.eos_id(),
        do_sample=True, temperature=0.8, top_k=40, max_new_tokens=96,
    ).save_pretrained(out)

    (out / "tokenizer.model").write_bytes(tokenizer_file.read_bytes())
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": a.max_position_embeddings,
        "clean_up_tokenization_spaces": False, "legacy": False, "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def check_export(model: Llama, out: Path, val_stream: torch.Tensor, bos: int) -> float:
    """Load the export with transformers; return the largest |logit difference| against ours."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.cat((torch.tensor([bos]), val_stream[:255]))[None]  # (1, 256)
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
    assert diff < 1e-3, f"exported model disagrees with the trained one: max |dlogit| = {diff}"
    return diff


COMPLETION_PROMPTS = ("The", "I went to the school")
CHAT_TURNS = ("Where are you going?", "What did the principal say to you?")


def render_chat(messages: list[dict]) -> str:
    """Render ``CHAT_TEMPLATE`` the way transformers and the service do (sandboxed jinja)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                 bos_token="<s>", eos_token="</s>")


def encode_with_specials(sp, text: str) -> list[int]:
    """sentencepiece ids of ``text`` where the strings "<s>" and "</s>" stand for bos and eos."""
    ids: list[int] = []
    for i, part in enumerate(re.split(r"(</?s>)", text)):
        if i % 2:
            ids.append(sp.bos_id() if part == "<s>" else sp.eos_id())
        elif part:
            ids.extend(sp.encode(part))
    return ids


def samples(out: Path, seed: int) -> list[tuple[str, str]]:
    """(title, text) pairs from the exported model run by transformers: completions, then a chat."""
    import sentencepiece as spm
    from transformers import GenerationConfig, LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))

    def complete(ids: list[int], sample: bool) -> list[int]:
        torch.manual_seed(seed + len(ids))
        kw = {} if sample else {"temperature": None, "top_k": None}
        cfg = GenerationConfig.from_dict({**gen.to_dict(), "do_sample": sample, "max_new_tokens": 96, **kw})
        with torch.no_grad():
            o = hf.generate(torch.tensor([ids]), generation_config=cfg)
        new = o[0, len(ids):].tolist()
        return new[:-1] if new and new[-1] == sp.eos_id() else new

    results = []
    for prompt in COMPLETION_PROMPTS:
        ids = [sp.bos_id()] + sp.encode(prompt)
        for sample in (False, True):
            mode = "sampled (temperature 0.8, top-k 40)" if sample else "greedy"
            results.append((f"{mode}, prompt {prompt!r}", sp.decode(ids[1:] + complete(ids, sample))))
    messages: list[dict] = []
    for turn in CHAT_TURNS:
        messages.append({"role": "user", "content": turn})
        ids = [sp.bos_id()] + encode_with_specials(sp, render_chat(messages))
        messages.append({"role": "assistant", "content": sp.decode(complete(ids, True)).strip()})
    transcript = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    results.append(("chat (sampled), two turns", transcript))
    return results


MODEL_CARD = """\
# kvserve default model

A small Llama-architecture language model that kvserve trains itself and ships as package
data: the model the server loads when no `--model` is given. It writes English in the style
of one novel, nothing more: it is here so that a fresh install can stream, chat and restore
KV cache from Redis without downloading anything.

| | |
|---|---|
| architecture | `LlamaForCausalLM`: {layers} layers, hidden {hidden}, {heads} heads / {kv_heads} kv heads (head dim {head_dim}), SwiGLU {ffn}, RoPE θ={theta:g}, tied embeddings |
| parameters | {params:,} ({mb:.1f} MB float32 safetensors) |
| context | {ctx} tokens |
| tokenizer | sentencepiece BPE, {vocab} pieces, byte fallback, no dummy-prefix space; `<unk>`=0, `<s>`=1, `</s>`=2, `"\\n"`={nl} |
| end of turn | `</s>` (id 2): every paragraph in training ends with it, and so does every message in the chat template |
| corpus | *Botchan (Master Darling)* by Natsume Soseki, tr. Yasotaro Morri (1919), Project Gutenberg eBook #8868 (public domain in the U.S.), the `test/botchan.txt` file of the sentencepiece {sp_version} sdist on PyPI; {train_tokens:,} training tokens, {val_tokens:,} held out |
| training | {steps} steps of {batch} × {seq} tokens ({seen:,} tokens seen), AdamW, lr {lr:g} warmup + cosine, dropout {dropout:g}, seed {seed}; best held-out loss {val:.3f} (perplexity {ppl:.1f}) at step {best_step} |
| time | {cpu_minutes:.0f} minutes on 1 of 2 CPU cores (`torch.set_num_threads(1)`; CPU time of the training loop, {minutes:.0f} min wall clock on a machine shared with other work) |
| license | weights and tokenizer: Apache-2.0, like kvserve; the corpus is public domain |

Reproduce (downloads only the sentencepiece sdist from PyPI):

```
python tools/train_default_model.py
```

## Chat format

One paragraph per message, closed by `</s>`. A user's message is rendered as quoted speech
(`"Hello."</s>`), the model answers with the next paragraph of the story and ends it with
`</s>`. `system` and `assistant` messages are rendered as plain paragraphs. Newlines inside a message become
spaces.

## Samples (from the training script's own output)

{samples}

## Limitations

It has read one short novel ({train_tokens:,} tokens) and nothing else: it knows that
world's people (Red Shirt, Badger, Porcupine, Kiyo...) and phrases, repeats itself, has no
facts, follows no instructions, and its grammar drifts within a few sentences. Use it to
exercise the service, never as a source of information.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "service" / "default_model")
    ap.add_argument("--cache-dir", type=Path, default=REPO_ROOT / ".corpus")
    ap.add_argument("--steps", type=int, default=TrainArgs.steps)
    ap.add_argument("--threads", type=int, default=TrainArgs.threads)
    ap.add_argument("--layers", type=int, default=ModelArgs.num_hidden_layers)
    ap.add_argument("--dropout", type=float, default=ModelArgs.dropout)
    ap.add_argument("--lr", type=float, default=TrainArgs.lr)
    ap.add_argument("--batch-size", type=int, default=TrainArgs.batch_size)
    opts = ap.parse_args(argv)
    try:  # the last step checks the result against transformers: fail now, not after training
        import transformers  # noqa: F401
    except ImportError:
        print("train_default_model.py: needs transformers: pip install -e '.[bench]'", file=sys.stderr)
        return 2

    t = TrainArgs(steps=opts.steps, threads=opts.threads, lr=opts.lr, min_lr=opts.lr / 10,
                  batch_size=opts.batch_size, warmup_steps=min(TrainArgs.warmup_steps, max(1, opts.steps // 10)),
                  eval_every=min(TrainArgs.eval_every, max(1, opts.steps // 4)))
    torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    rng = random.Random(t.seed)
    t_start = time.perf_counter()

    raw = fetch_botchan(opts.cache_dir)
    paragraphs = paragraphs_from_gutenberg(raw, rng)
    n_val = max(1, round(len(paragraphs) * t.val_fraction))
    train_pars, val_pars = paragraphs[:-n_val], paragraphs[-n_val:]
    print(f"corpus: {len(paragraphs)} paragraphs, {sum(len(p.split()) for p in paragraphs):,} words")

    args = ModelArgs(num_hidden_layers=opts.layers, dropout=opts.dropout)
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = Path(tmp) / "tokenizer.model"
        sp = train_tokenizer(train_pars, tok_file, args.vocab_size)
        assert (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2) and sp.get_piece_size() == args.vocab_size
        train_stream, train_starts = encode_paragraphs(sp, train_pars)
        val_stream, _ = encode_paragraphs(sp, val_pars)
        print(f"tokens: {len(train_stream):,} train, {len(val_stream):,} held out "
              f"({len(''.join(paragraphs)) / (len(train_stream) + len(val_stream)):.2f} chars/token)")

        model = Llama(args)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params:,} parameters; {t.steps} steps x {t.batch_size} x {t.seq_len} tokens "
              f"on {t.threads} thread(s)")
        result = train(model, train_stream, train_starts, val_stream, sp.bos_id(), t)
        print(f"trained in {result['train_seconds'] / 60:.1f} min ({result['train_cpu_seconds'] / 60:.1f} min CPU); best held-out loss "
              f"{result['best_val_loss']:.3f} at step {result['best_step']}")

        export_hf(model, sp, tok_file, opts.out)
    diff = check_export(model, opts.out, val_stream, sp.bos_id())
    print(f"export: {opts.out} loads with transformers, max |dlogit| = {diff:.2e}")

    outs = samples(opts.out, t.seed)
    sample_md = "\n\n".join(f"{title}:\n\n```\n{text}\n```" for title, text in outs)
    print("\nsamples:")
    for title, text in outs:
        print(f"--- {title}\n{text}")

    size = (opts.out / "model.safetensors").stat().st_size
    card = MODEL_CARD.format(
        layers=args.num_hidden_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
        kv_heads=args.num_key_value_heads, head_dim=args.head_dim, ffn=args.intermediate_size,
        theta=args.rope_theta, params=n_params, mb=size / 1e6, ctx=args.max_position_embeddings,
        vocab=args.vocab_size, nl=sp.piece_to_id("\n"), sp_version=SENTENCEPIECE_SDIST_VERSION,
        train_tokens=len(train_stream), val_tokens=len(val_stream), steps=t.steps, batch=t.batch_size,
        seq=t.seq_len, seen=t.steps * t.batch_size * t.seq_len, lr=t.lr, dropout=args.dropout,
        seed=t.seed, val=result["best_val_loss"], ppl=math.exp(result["best_val_loss"]),
        best_step=result["best_step"], minutes=result["train_seconds"] / 60, cpu_minutes=result["train_cpu_seconds"] / 60,
        samples=sample_md,
    )
    (opts.out / "README.md").write_text(card)
    (opts.out / "training_log.json").write_text(json.dumps(
        {"model": dataclasses.asdict(args), "train": dataclasses.asdict(t),
         **{k: v for k, v in result.items() if k != "history"}, "history": result["history"],
         "total_seconds": time.perf_counter() - t_start}, indent=1) + "\n")
    print(f"total {(time.perf_counter() - t_start) / 60:.1f} min; wrote {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
