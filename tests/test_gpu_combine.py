"""GPU tier, split-KV combine (`kernels/combine.py`) against `emulate.combine_splits` in fp64.

Partials are random; about 30% of (split, row) pairs are empty (lse -inf, out_partial NaN: the
kernel must ignore it, the reference gets zeros), some rows empty in every split, and short rows'
trailing splits empty (what the split kernel leaves when a row has fewer key blocks than splits).
out and lse are views into larger tensors (strided, offset), whose other elements must stay as
they were.

Tolerances: lse within 1e-5 (fp32 with approximate exp2/log2, |lse| <= ~20 here); out within 2
ulp of its dtype relative (the final rounding is half an ulp) plus 1e-4 absolute (fp32
accumulation and approximate exp2 over up to 100 splits of O(1) partials stay near 1e-5). Empty
rows exactly: out 0, lse -inf.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hopper_fmha.emulate import combine_splits

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
SPLITS = [1, 2, 3, 17, 100]  # one split; a few; past 16 (max_splits 32); past 64 (max_splits 128)
HEAD_DIMS_V = [64, 128, 192, 256, 72]  # 192 and 72: rows that leave the last round's lanes idle
# rtol: 2 ulp (10 and 7 mantissa bits); atol: see the module docstring.
OUT_TOL = {torch.float16: (2 * 2**-10, 1e-4), torch.bfloat16: (2 * 2**-7, 1e-4)}
LSE_ATOL = 1e-5
SENTINEL = 7.0


def make_partials(splits: int, batch: int, seqlen_q: int, heads: int, dv: int, seed: int, extra: int = 0):
    """(out_partial, lse_partial, clean out_partial for the reference, empty rows (b, h, s_q)).

    `extra` splits past the first `splits` hold lse = +100 and NaN partials: a kernel that read
    them would be off everywhere."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (splits, batch, heads, seqlen_q)
    lse_partial = torch.randn(shape, generator=g, device="cuda") * 3 + 5
    empty = torch.rand(shape, generator=g, device="cuda") < 0.3
    rows_empty = torch.rand(shape[1:], generator=g, device="cuda") < 0.1
    rows_empty.view(-1)[0] = True
    empty |= rows_empty
    used = torch.randint(1, splits + 1, shape[1:], generator=g, device="cuda")  # short rows
    empty |= torch.arange(splits, device="cuda").view(-1, 1, 1, 1) >= used
    lse_partial[empty] = -torch.inf
    out_partial = torch.randn(splits, batch, seqlen_q, heads, dv, generator=g, device="cuda")
    garbage = empty.transpose(2, 3).unsqueeze(-1)  # (splits, b, s_q, h, 1)
    clean = out_partial.masked_fill(garbage, 0.0)
    out_partial.masked_fill_(garbage, torch.nan)
    if extra:
        lse_partial = torch.cat([lse_partial, torch.full((extra, *shape[1:]), 100.0, device="cuda")])
        nan = torch.full((extra, *out_partial.shape[1:]), torch.nan, device="cuda")
        out_partial = torch.cat([out_partial, nan])
    return out_partial.contiguous(), lse_partial.contiguous(), clean, rows_empty


def strided_outputs(batch: int, seqlen_q: int, heads: int, dv: int, dtype):
    """(out, lse, out's base, lse's base): out a (b, s_q, h, dv) view with every stride and the
    offset a multiple of 8 elements, lse a (b, h, s_q) view at an odd offset; bases hold SENTINEL."""
    out_base = torch.full((batch, seqlen_q + 1, heads + 2, dv + 16), SENTINEL, dtype=dtype, device="cuda")
    lse_base = torch.full((batch, heads + 1, seqlen_q + 3), SENTINEL, device="cuda")
    out = out_base[:, 1:, 1 : heads + 1, 8 : 8 + dv]
    lse = lse_base[:, 1:, 2 : 2 + seqlen_q]
    return out, lse, out_base, lse_base


def check(out, lse, clean, lse_partial, rows_empty, out_base, lse_base, num_splits: int):
    out_ref, lse_ref = combine_splits(clean, lse_partial[:num_splits])
    out_ref, lse_ref = torch.from_numpy(out_ref), torch.from_numpy(lse_ref)
    got_out, got_lse = out.double().cpu(), lse.double().cpu()
    torch.testing.assert_close(
        got_lse, lse_ref, rtol=0.0, atol=LSE_ATOL
    )  # -inf where and only where expected
    rtol, atol = OUT_TOL[out.dtype]
    torch.testing.assert_close(got_out, out_ref, rtol=rtol, atol=atol)
    empty = rows_empty.cpu()
    assert torch.isneginf(got_lse[empty]).all()
    assert (got_out.transpose(1, 2)[empty] == 0).all(), "a row with every split empty gives out = 0"
    # Nothing written outside the views.
    out_base[:, 1:, 1 : out.shape[2] + 1, 8 : 8 + out.shape[3]] = SENTINEL
    lse_base[:, 1:, 2 : 2 + lse.shape[2]] = SENTINEL
    assert (out_base == SENTINEL).all() and (lse_base == SENTINEL).all()


@pytest.mark.parametrize("dv", HEAD_DIMS_V)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_combine_matches_emulation(hopper_gpu, dtype, splits, dv):
    from hopper_fmha.kernels.combine import combine

    batch, seqlen_q, heads = 2, 3, 5
    seed = zlib.crc32(repr((str(dtype), splits, dv)).encode())
    out_partial, lse_partial, clean, rows_empty = make_partials(splits, batch, seqlen_q, heads, dv, seed)
    out, lse, out_base, lse_base = strided_outputs(batch, seqlen_q, heads, dv, dtype)
    combine(out_partial, lse_partial, out, lse)
    torch.cuda.synchronize()
    check(out, lse, clean, lse_partial, rows_empty, out_base, lse_base, splits)


# (batch, s_q, heads): one row; decode (s_q = 1) with many heads; rows that end mid-CTA over many
# CTAs; long s_q with few heads. num_splits below the workspace's splits (extra ones are garbage).
SHAPES = [(1, 1, 1), (4, 1, 32), (3, 113, 7), (1, 1000, 3)]


@pytest.mark.parametrize("splits", [3, 17])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_combine_shapes_and_num_splits(hopper_gpu, dtype, shape, splits):
    from hopper_fmha.kernels.combine import combine

    batch, seqlen_q, heads = shape
    dv = 128
    seed = zlib.crc32(repr((str(dtype), shape, splits)).encode())
    out_partial, lse_partial, clean, rows_empty = make_partials(
        splits, batch, seqlen_q, heads, dv, seed, extra=4
    )
    out, lse, out_base, lse_base = strided_outputs(batch, seqlen_q, heads, dv, dtype)
    combine(out_partial, lse_partial, out, lse, num_splits=splits)
    torch.cuda.synchronize()
    check(out, lse, clean, lse_partial, rows_empty, out_base, lse_base, splits)


def test_combine_rejects_bad_arguments(hopper_gpu):
    """The host's checks (split count, out's dtype) and the TVM-FFI entry's (shapes, alignment)."""
    from hopper_fmha.kernels.combine import combine

    out_partial, lse_partial, _, _ = make_partials(2, 1, 4, 2, 64, seed=0)
    out, lse, _, _ = strided_outputs(1, 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError):
        combine(out_partial, lse_partial, out, lse, num_splits=3)  # more than the partials hold
    with pytest.raises(TypeError):
        combine(out_partial, lse_partial, out.float(), lse)
    with pytest.raises(ValueError):
        combine(out_partial, lse_partial[:, :, :1], out, lse)  # heads disagree
    misaligned = torch.empty(1, 4, 2, 72, dtype=torch.bfloat16, device="cuda")[..., 4:68]
    with pytest.raises(ValueError):
        combine(out_partial, lse_partial, misaligned, lse)  # 8 bytes past a 16-byte boundary
