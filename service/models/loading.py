"""Load a checkpoint: config, weights, tokenizer, eos ids, fingerprint.

    loaded = load_model("path/to/model", dtype="float32", device="auto", weight_format="int8")
    loaded = load_model("model.Q4_K_M.gguf")   # a GGUF file (gguf.py): the same families
    loaded.model(layout, kv)          # layers.CausalLM: the forward contract

A checkpoint is an HF-format directory (config.json, safetensors, tokenizer files) or a
GGUF file; each gives the same four things (``Checkpoint``) and the model is built,
loaded and served the same way after that.

Weights are read memory-mapped (safetensors ``safe_open``) one tensor at a time and
copied into a model whose parameters were allocated once, on the target device and in
the target dtype, so a 7B checkpoint never needs twice its size in RAM. Weight loading
is data plus checks (nanoGPT's manner): every checkpoint tensor must name a parameter,
every parameter must be found, every shape must match; anything else raises
``ModelLoadError`` naming the file and the tensor.

After loading, projections that run side by side are fused (q/k/v, gate/up: one weight
read and one kernel call per step) and the linear layers are re-encoded in the served
weight format (quant.py); the format is part of the fingerprint.
"""

from __future__ import annotations

import contextlib

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..kv.cache import KVCacheSpec, KVPool
from .config import ModelConfig, ModelLoadError
from .gemma import GemmaForCausalLM
from .gguf import GGUFCheckpoint, is_gguf, kernel_block_types
from .gpt2 import GPT2LMHeadModel
from .. import kernels
from .layers import CausalLM, fuse_projections, pack_linears, use_kernels
from .llama import LlamaForCausalLM
from .phi3 import Phi3ForCausalLM
from .quant import WEIGHT_FORMATS, format_fingerprint, quantize_model
from .qwen3 import Qwen3ForCausalLM
from .tokenizer import Tokenizer

__all__ = ["Checkpoint", "LoadedModel", "ModelLoadError", "load_model", "model_fingerprint", "open_checkpoint",
           "resolve_device", "resolve_dtype"]

# ModelConfig.architecture (the family) -> the class in its model file
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FINGERPRINT_VERSION = b"kvserve-model-fingerprint-v1"
_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    model: CausalLM  # eval mode, requires_grad False; the forward and loader contract: layers.CausalLM
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]  # config.json + generation_config.json (+ tokenizer if both empty); GGUF: the tokenizer's
    fingerprint: str  # hex sha256 of the canonical config, every weight's bytes as stored and the weight format
    dtype: torch.dtype
    device: torch.device
    path: Path  # the model directory or GGUF file
    weight_format: str = "exact"  # quant.WEIGHT_FORMATS
    native: str | None = None  # "on": decode products by the native kernels; else why not (None: not asked)

    def kv_spec(self, block_size: int, kv_format: str = "exact") -> KVCacheSpec:
        """The geometry of this model's KV blocks in ``kv_format`` (``--kv-cache-format``):
        the one source for the pool and the store."""
        return KVCacheSpec.for_model(self.config, block_size, self.dtype, kv_format)

    def new_kv_pool(self, budget_bytes: int, block_size: int, kv_format: str = "exact") -> KVPool:
        """A KV pool for this model (its geometry, KV format and device) within ``budget_bytes``."""
        return KVPool.from_spec(self.kv_spec(block_size, kv_format), budget_bytes, self.device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A dtype name or torch dtype -> the torch dtype; "auto" -> float32 on CPU (bf16
    prefill is slower on CPUs without AMX), bfloat16 on CUDA."""
    if str(dtype) == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose one of {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; choose cpu, cuda or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    return device


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    weight_format: str = "exact",
    pack_weights: bool = True,
    native_kernels: str = "auto",
    keep_blocks: frozenset[str] | None = None,
) -> LoadedModel:
    """Load the model directory or GGUF file at ``path``. ``progress`` None: bars over
    shards (GGUF: tensors and the fingerprint's bytes) and quantized matrices on a TTY. ``weight_format``: one of quant.WEIGHT_FORMATS.
    ``pack_weights``: keep oneDNN-packed copies of large float32 CPU weights for
    batched decode (``layers.Linear.pack``: faster 2..64-row products, twice the float32
    weights' memory); False serves every product from the one dense copy.
    ``native_kernels`` (kernels.MODES): auto uses the native decode kernels (built at
    install, service/kernels/) for a float32 model on a CPU they were built for (then
    nothing is packed: they read the dense copy as fast), on requires them
    (``ModelLoadError`` otherwise), off keeps torch's kernels. ``keep_blocks``: the ggml
    block types (quant.BLOCK_TYPES) a GGUF file's product weights are served in as stored;
    None: those the native kernels read, where they serve (else none: dequantized)."""
    path = Path(path)
    if native_kernels not in kernels.MODES:
        raise ValueError(f"native_kernels must be one of {', '.join(kernels.MODES)}, got {native_kernels!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    checkpoint = open_checkpoint(path)
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    if keep_blocks is None:  # where the native kernels will serve: the block types they read
        native = native_kernels != "off" and torch_device.type == "cpu" and torch_dtype == torch.float32
        keep_blocks = kernel_block_types() if native and kernels.available() else frozenset()
    keep_blocks = frozenset(keep_blocks)

    cls = MODEL_CLASSES[config.architecture]
    with torch.device("meta"), _skip_init():
        model = cls(config)
    # allocate once, uninitialized: Module.to_empty's empty_like of a meta tensor runs
    # torch's Python reference, which imports sympy (~0.3-0.5 s of every start); a plain
    # torch.empty of each tensor's shape is the same allocation
    model = model.to(dtype=torch_dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=torch_device))
    model.tie_weights()
    model.reset_buffers()
    if progress is None:
        progress = sys.stderr.isatty()
    checkpoint.load_weights(model, progress, keep_blocks)
    model.eval().requires_grad_(False)
    fuse_projections(model)
    quantize_model(model, weight_format, progress)
    native_state = None
    if native_kernels != "off" and torch_device.type == "cpu":
        if torch_dtype != torch.float32:
            native_state = f"the native kernels compute in float32, the model in {str(torch_dtype).removeprefix('torch.')}"
        elif kernels.available():
            use_kernels(model)
            native_state = "on"
        else:
            native_state = kernels.reason()
        if native_state != "on" and native_kernels == "on":
            raise ModelLoadError(f"native_kernels=on: {native_state}")
    elif native_kernels == "on":
        raise ModelLoadError(f"native_kernels=on: the native kernels run on the CPU, the device is {torch_device}")
    if pack_weights and native_state != "on":
        pack_linears(model)  # CPU float32: oneDNN-packed copies for decode-sized products
    return LoadedModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=checkpoint.eos_token_ids,
        fingerprint=format_fingerprint(checkpoint.fingerprint(progress, keep_blocks), weight_format),
        dtype=torch_dtype,
        device=torch_device,
        path=path,
        weight_format=weight_format,
        native=native_state,
    )


class Checkpoint(Protocol):
    """What a checkpoint gives the loader, whatever its format (``HFCheckpoint``, ``gguf.GGUFCheckpoint``)."""

    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]

    def load_weights(self, model: CausalLM, progress: bool = False, blocks: frozenset[str] = frozenset()) -> None: ...
    def fingerprint(self, progress: bool | None = None, blocks: frozenset[str] = frozenset()) -> str: ...


@dataclass(frozen=True)
class HFCheckpoint:
    """An HF-format directory: config.json, safetensors weights, tokenizer files."""

    path: Path
    raw_config: dict
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    weight_files: list[Path]

    @classmethod
    def open(cls, path: Path) -> "HFCheckpoint":
        config_path = path / "config.json"
        if not config_path.exists():
            raise ModelLoadError(f"{path}: missing config.json")
        raw_config = _read_json(config_path)
        config = ModelConfig.from_hf(raw_config, source=str(config_path))
        weight_files = _weight_files(path)
        tokenizer = Tokenizer.from_dir(path)
        if tokenizer.vocab_size > config.vocab_size:  # its ids would index past the embedding
            raise ModelLoadError(
                f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but config.json's vocab_size is "
                f"{config.vocab_size}"
            )
        return cls(path, raw_config, config, tokenizer, _eos_token_ids(path, config, tokenizer), weight_files)

    def load_weights(self, model: CausalLM, progress: bool = False, blocks: frozenset[str] = frozenset()) -> None:
        _load_weights(model, self.weight_files, self.path, progress)  # safetensors hold no blocks

    def fingerprint(self, progress: bool | None = None, blocks: frozenset[str] = frozenset()) -> str:
        return model_fingerprint(self.raw_config, self.weight_files)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path`` (its config and tokenizer read, no weights yet): a GGUF
    file or an HF-format directory; ModelLoadError otherwise."""
    path = Path(path)
    if path.is_file() and is_gguf(path):
        return GGUFCheckpoint.open(path)
    if not path.is_dir():
        what = "is a file, not a model directory or a GGUF file" if path.exists() else "model directory or GGUF file does not exist"
        raise ModelLoadError(f"{path}: {what}")
    return HFCheckpoint.open(path)


@contextlib.contextmanager
def _skip_init():
    """Build modules without running their weight initializers (as transformers'
    ``no_init_weights`` does): every weight is overwritten by the checkpoint, and
    initializing meta tensors pulls in torch's compiler stack (seconds of imports at
    every server start)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "trunc_normal_", "zeros_", "ones_", "constant_")  # fmt: skip
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot parse JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files to read: the shards of the index, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{index}: lists shard {f.name}, which does not exist")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    hint = " (only safetensors weights are supported)" if any(path.glob("*.bin")) else ""
    raise ModelLoadError(f"{path}: no weights: expected model.safetensors or model.safetensors.index.json{hint}")


def _load_weights(model: CausalLM, files: list[Path], path: Path, progress: bool) -> None:
    from safetensors import safe_open
    from tqdm import tqdm

    params = dict(model.named_parameters())  # tied aliases appear once, under their source name
    aliases = model.tied_weights
    transposed = model.transposed
    found: dict[str, str] = {}
    for file in tqdm(files, desc="loading shards", unit="shard", disable=not progress or len(files) < 2):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
        with handle as f:
            for key in f.keys():
                name = model.checkpoint_name(key)
                if name is None:
                    continue
                if name in aliases:  # e.g. lm_head.weight written next to a tied embedding
                    continue
                if name not in params:
                    raise ModelLoadError(f"{file}: unexpected tensor {key!r} (no such parameter in the model)")
                if name in found:
                    raise ModelLoadError(f"{file}: tensor {key!r} also present in {found[name]}")
                flip = name.endswith(transposed) if transposed else False
                shape = tuple(f.get_slice(key).get_shape())
                want = tuple(params[name].shape)
                if flip:
                    want = want[::-1]
                if shape != want:
                    raise ModelLoadError(
                        f"{file}: tensor {key!r} has shape {list(shape)}, expected {list(want)}"
                    )
                tensor = f.get_tensor(key)
                params[name].data.copy_(tensor.t() if flip else tensor)
                found[name] = file.name
    missing = [n for n in params if n not in found]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        where = files[0] if len(files) == 1 else path / "model.safetensors.index.json"
        raise ModelLoadError(f"{where}: missing tensor(s) {shown}")


def _eos_token_ids(path: Path, config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = list(config.eos_token_ids)
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        gen = _read_json(gen_path).get("eos_token_id")
        ids += [gen] if isinstance(gen, int) else list(gen or [])
    if not ids:
        ids = list(tokenizer.eos_token_ids)
    return tuple(dict.fromkeys(int(i) for i in ids))


def model_fingerprint(raw_config: dict, weight_files: list[Path]) -> str:
    """Hex sha256 over the canonical config.json and every weight file's bytes (streamed).

    Deterministic across processes and machines; any change to the architecture config
    or to a single weight byte gives another fingerprint (and so another KV namespace).
    """
    h = hashlib.sha256(_FINGERPRINT_VERSION)
    # bookkeeping keys that vary with the writing tool, not with the model, are left out
    stable = {k: v for k, v in raw_config.items() if not k.startswith("_") and k != "transformers_version"}
    canonical = json.dumps(stable, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    h.update(len(canonical).to_bytes(8, "little") + canonical)
    for file in sorted(weight_files, key=lambda p: p.name):
        h.update(len(file.name).to_bytes(8, "little") + file.name.encode())
        h.update(file.stat().st_size.to_bytes(8, "little"))
        with open(file, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
