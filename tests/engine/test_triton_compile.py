"""The Triton kernels compile for Hopper (sm_90: the H100 / H200) on this CPU host, with
the specializations a real launch makes (16-divisible strides, strides of 1 as
constants), and keep every value in registers (no local-memory spills). The
interpreter (test_triton_kernels.py) checks what they compute but is more lenient than
the compiler (a dot of fewer than 16 rows, an int64 pointer offset, a constexpr misuse
run there and fail on a GPU); CI has no GPU, so this is where a kernel that would not
build for the device is caught.

Two subprocesses side by side (TRITON_INTERPRET unset: the kernels are JIT functions there;
each compiles half of the shapes, so two cores take the time of one) run each
launcher of ``_kernels`` on CPU tensors of the 1.1B shape's geometry (and the families'
options) with each kernel's launch replaced by ``triton.compile`` for the sm_90 target
(the wheel's own ptxas), then reads the cubin's resource usage (the wheel's cuobjdump).
What it prints (registers, stack, shared memory per kernel and shape) is the first thing
to read when tuning on a device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import os, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import native_specialize_impl
from kvserve.service.kernels.triton import _kernels as K
from kvserve.service.kv.cache import KVPool

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


class Compile:
    """``kernel[grid](*args, **kwargs)`` that compiles for sm_90 as a launch would and prints
    the cubin's resource usage."""

    def __init__(self, fn, label):
        self.fn, self.label = fn, label

    def __getitem__(self, grid):
        return self.compile

    def compile(self, *args, **kwargs):
        fn = self.fn
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
        bound = dict(zip(fn.arg_names, args), **kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
            value = bound[name]
            if param.is_constexpr:
                signature[name], constexprs[name] = "constexpr", value
                continue
            ty, key = native_specialize_impl(BaseBackend, value, False, True, True)
            signature[name] = ty
            if ty == "constexpr":  # an int of 1: a constant, as a launch makes it
                constexprs[name] = value
            elif isinstance(key, str):
                attrs[(i,)] = BACKEND.parse_attr(key)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
        line = next(l for l in usage.splitlines() if "REG:" in l)
        fields = dict(p.split(":") for p in line.split() if ":" in p)
        print(f"{LABEL} {fn.__name__} REG={fields['REG']} STACK={fields['STACK']} LOCAL={fields['LOCAL']} "
              f"SHARED={kernel.metadata.shared}", flush=True)


for name in ("_write_rows_kernel", "_write_quant_kernel", "_attention_kernel", "_reduce_kernel", "_rms_norm_kernel",
             "_rope_kernel", "_scatter_kernel"):
    setattr(K, name, Compile(getattr(K, name), name))

SHARD = int(sys.argv[1])  # 0 or 1: every other shape, and the norms (0) or the restore (1)
bf16 = torch.bfloat16
for LABEL, model, fmt, nh, nkv, hd, bs, window, softcap in [
    ("llama-1.1B-bf16", bf16, bf16, 32, 4, 64, 16, None, None),
    ("llama-1.1B-int8", bf16, torch.int8, 32, 4, 64, 16, None, None),
    ("llama-1.1B-fp8", bf16, torch.float8_e4m3fn, 32, 4, 64, 16, 4096, None),
    ("gemma2-fp16", torch.float16, torch.float16, 8, 4, 256, 16, 4096, 50.0),
    ("qwen-f32-kv-bf16", torch.float32, bf16, 14, 2, 128, 32, None, None),
][SHARD::2]:
    pool = KVPool(8, 1, bs, nkv, hd, fmt, compute_dtype=model)
    scales = (pool.k_scale(0), pool.v_scale(0)) if pool.spec.quantized else (None, None)
    rows = 32
    q = torch.zeros(rows, nh, hd, dtype=model)
    kv = torch.zeros(rows, nkv, hd, dtype=model)
    K.write_kv(kv, kv, pool.k(0), pool.v(0), torch.zeros(rows, dtype=torch.long), *scales)
    tables = torch.zeros(rows, 64, dtype=torch.int32)
    lens = torch.ones(rows, dtype=torch.int32)
    ws = (torch.zeros(rows, nh, 8, hd), torch.zeros(rows, nh, 8))
    K.attention(q, q, pool.k(0), pool.v(0), *scales, tables, lens, None, 1, ws, scale=0.1, window=window,
                softcap=softcap)
    if not LABEL.endswith(("int8", "fp8")):  # prefill's block shape
        q = torch.zeros(4096, nh, hd, dtype=model)
        K.attention(q, q, pool.k(0), pool.v(0), *scales, tables[:1], lens[:1], torch.zeros(2, dtype=torch.int32),
                    4096, None, scale=0.1, window=window, softcap=softcap)
if SHARD == 1:
    LABEL = "restore"
    pool = KVPool(8, 2, 16, 4, 64, bf16)
    K.scatter_blocks(pool.data, pool.data[:2].clone(), torch.zeros(2, dtype=torch.long))
    sys.exit(0)
LABEL = "norms"
x = torch.zeros(4, 2048, dtype=bf16)
w = torch.zeros(2048, dtype=bf16)
K.rms_norm(x, x, w, 1e-6, 0.0, x, None)
K.rms_norm(x, x, w, 1e-6, 1.0, x, w)
qkv = torch.zeros(4, 48, 128, dtype=bf16)
table = torch.zeros(64, 96, dtype=bf16)
K.rope_(qkv[:, :40], torch.zeros(4, dtype=torch.long), table, table, 32, w[:128], w[:128], 1e-6, 0.0)
'''


def _compiler() -> str:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        return f"triton is not importable ({e})"
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        return "this triton wheel has no CUDA backend (ptxas)"
    return ""


@pytest.mark.slow
@pytest.mark.skipif(bool(_compiler()), reason=_compiler() or "ok")
def test_every_kernel_compiles_for_hopper_without_spills(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_DEFAULT_FP_FUSION": "1"}  # fmt: skip
    env.pop("TRITON_INTERPRET", None)
    shards = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(shard)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env) for shard in (0, 1)]  # fmt: skip
    try:
        outs = [shard.communicate(timeout=600) for shard in shards]
    finally:
        for shard in shards:
            if shard.poll() is None:
                shard.kill()
    for shard, (_, err) in zip(shards, outs):
        assert shard.returncode == 0, err[-4000:]
    stdout = "".join(out for out, _ in outs)
    lines = stdout.splitlines()
    kernels = {line.split()[1] for line in lines}
    assert kernels == {"_write_rows_kernel", "_write_quant_kernel", "_attention_kernel", "_reduce_kernel",
                       "_rms_norm_kernel", "_rope_kernel", "_scatter_kernel"}, stdout
    # a stack of a word or two is one value kept across the loop (one STL before it, one
    # LDL after it: seen in the int8 decode kernel's SASS); more is register spilling
    spilled = [line for line in lines if int(line.split("STACK=")[1].split()[0]) > 16 or "LOCAL=0 " not in line]
    assert not spilled, "\n".join(spilled)
    assert len([line for line in lines if "_attention_kernel" in line]) == 8
    print(stdout)
