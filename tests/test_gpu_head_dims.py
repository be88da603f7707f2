"""GPU tier, head dims beyond 64/128/256: the ws kernel at d = 96, 192 (v at 128 and 192), and
data dims that run a padded kernel (80 on the d = 96 kernel, 48/32 on d = 64, 256/128 on d = 256,
8 on d = 64), through `flash_attn_func`, by tests/test_gpu_kernels.py's rule, on FlashAttention's
grid of tails; plus the varlen call at 192/128.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from test_gpu_kernels import assert_close_to_reference  # noqa: E402  (tests/ is on sys.path)

import hopper_fmha

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
DIMS = [(96, 96), (192, 128), (192, 192), (80, 80), (48, 32), (256, 128), (8, 8)]
SEQLENS = [(1, 1), (113, 203), (239, 1), (1023, 1024), (4224, 4224)]
HEADS = {"mha": (6, 6), "gqa": (6, 2)}


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", DIMS, ids=[f"{d}v{dv}" for d, dv in DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_head_dims(hopper_gpu, dtype, dims, causal, seqlens, heads):
    d, dv = dims
    sq, sk = seqlens
    h, hkv = HEADS[heads]
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((dims, seqlens, heads)).encode()))
    q = torch.randn(2, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, sk, hkv, dv, device="cuda", dtype=dtype, generator=g)
    out, lse = hopper_fmha.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, sq, h, dv)
    assert_close_to_reference(q, k, v, d**-0.5, causal, out, lse)
    out_only = hopper_fmha.flash_attn_func(q, k, v, causal=causal)
    assert_close_to_reference(q, k, v, d**-0.5, causal, out_only, lse)


def test_varlen_192_128(hopper_gpu):
    from test_gpu_varlen import check_sequences, packed_problem

    lengths = [300, 0, 1, 777, 128]
    q, k, _, cu_q, cu_k = packed_problem(lengths, lengths, 8, 2, 192, torch.bfloat16, 7)
    v = torch.randn(k.shape[0], 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = hopper_fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 777, 777, causal=True, return_lse=True)
    assert out.shape == (q.shape[0], 8, 128)
    check_sequences(q, k, v, cu_q, cu_k, None, 192**-0.5, True, None, 0.0, None, out, lse)
