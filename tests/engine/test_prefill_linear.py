"""``Linear``'s prefill path (models/layers.py): from ONEDNN_MIN_ROWS rows a float32 CPU
weight of at least PACK_MIN_ELEMENTS runs oneDNN's GEMM on the dense weight (MKL's
generic path on AMD CPUs is 2-3x slower there); the result is F.linear's to float32
rounding, and which op ran is read from torch's profiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kvserve.service.models import layers
from kvserve.service.models.layers import Linear

pytestmark = pytest.mark.skipif(not layers.ONEDNN_F32, reason="torch built without oneDNN")


def ops_of(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(72,), (3, 70), (1, 577)], ids=["2d", "batch", "long"])
def test_prefill_rows_run_onednn_and_match_f_linear(bias, shape):
    torch.manual_seed(0)
    lin = Linear(768, 512, bias=bias)  # 393K elements
    x = torch.randn(*shape, 768)
    with torch.inference_mode():
        ran = ops_of(lambda: lin(x))
        y = lin(x)
        ref = F.linear(x, lin.weight, lin.bias)
    assert "mkldnn::_linear_pointwise" in ran
    assert y.shape == ref.shape == (*shape, 512)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_decode_rows_and_small_weights_keep_their_paths():
    torch.manual_seed(0)
    big, small = Linear(768, 512), Linear(64, 160)
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" not in ops_of(lambda: big(torch.randn(64, 768)))  # decode-sized
        assert "mkldnn::_linear_pointwise" not in ops_of(lambda: small(torch.randn(100, 64)))  # below the size
        y = small(x := torch.randn(100, 64))
        torch.testing.assert_close(y, F.linear(x, small.weight, small.bias))
