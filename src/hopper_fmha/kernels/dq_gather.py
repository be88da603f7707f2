"""The varlen backward's last step: dQ of the packed rows, from the fp32 accumulator of the padded
layout, scaled and cast in one pass.

`sm90_bwd.backward_varlen` accumulates dQ in fp32 with each sequence's rows followed by padding
(`padded_starts`). Torch took two passes from there: the scale-and-cast of every padded row, then
a gather of the packed rows (H100, session 28, the backward-features preset's varlen cell: 0.52 and
0.33 ms of a 14.7 ms backward; FlashAttention-4's postprocess does both in one kernel). This
kernel reads each packed row's fp32 values once, at its padded row, and writes the 16-bit row:

    dq[r, h, :] = (dq_acc[rows[r], h, :] * scale).to(dtype)

Memory-bound, no TMA, `bwd_preprocess`'s layout (`row_lanes`): a CTA of 128 threads takes `tile_m` (row, head)
pairs in (row, head) order (the output's, so its stores are coalesced), `threads_per_row`
consecutive lanes per pair, each lane 8 columns per step (two 128-bit loads, one 128-bit store).

Compile-time: dtype and head_dim (a multiple of 8 up to 256); total rows, heads and strides are
runtime values.
"""

from __future__ import annotations

import sys
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from .bwd_preprocess import UNIT, row_lanes
from .cache import load_or_compile

_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


class DqGatherSm90:
    """dq (total_q, h, d) dtype <- dq_acc (total_pad, h, d) float32 at rows (total_q,) int64, times
    scale. threads_per_row = the largest power of two <= min(16, d / 8), tile_m = 128 /
    threads_per_row pairs per CTA, each lane ceil(d / 8 / threads_per_row) steps."""

    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int):
        self.units, self.threads_per_row, self.tile_m, self.units_per_thread = row_lanes("head_dim", head_dim)
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        mAcc: cute.Tensor,
        mRows: cute.Tensor,
        mDq: cute.Tensor,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mAcc (total_pad, h, d) float32, last mode contiguous, 16-byte aligned rows; mRows
        (total_q,) int64, each in [0, total_pad); mDq (total_q, h, d) self.dtype, last mode
        contiguous, 16-byte aligned rows."""
        pairs = mDq.shape[0] * mDq.shape[1]
        self.kernel(mAcc, mRows, mDq, scale).launch(
            grid=[cute.ceil_div(pairs, self.tile_m), 1, 1],
            block=[128, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            preferred_smem_carveout=-1,
        )

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mRows: cute.Tensor, mDq: cute.Tensor, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        total_q, heads, _ = mDq.shape
        lane = tidx % self.threads_per_row
        pair = Int64(bidx) * self.tile_m + tidx // self.threads_per_row
        if pair < Int64(total_q) * heads:
            r = pair // heads
            h = pair % heads
            gSrc = mAcc[mRows[r], h, None]  # (d,) float32
            gDst = mDq[r, h, None]  # (d,)
            acc = cute.make_rmem_tensor((UNIT,), Float32)
            out = cute.make_rmem_tensor((UNIT,), self.dtype)
            for u in cutlass.range_constexpr(self.units_per_thread):
                unit = lane + u * self.threads_per_row
                if unit < self.units:
                    cute.autovec_copy(cute.local_tile(gSrc, (UNIT,), (unit,)), acc)
                    out.store((acc.load() * scale).to(self.dtype))
                    cute.autovec_copy(out, cute.local_tile(gDst, (UNIT,), (unit,)))


def fake_arguments(dtype_name: str, head_dim: int):
    """Compile-time stand-ins for (dq_acc, rows, dq, scale, stream): total_pad, total_q and heads
    symbolic; the float32 and 16-bit tensors with strides that are multiples of 8 elements and
    16-byte aligned data."""
    tp, tq, h = (cute.sym_int() for _ in range(3))

    def by8():
        return cute.sym_int64(divisibility=8)

    acc = cute.runtime.make_fake_tensor(
        Float32, (tp, h, head_dim), stride=(by8(), by8(), 1), assumed_align=16
    )
    rows = cute.runtime.make_fake_tensor(Int64, (tq,), stride=(1,), assumed_align=8)
    dq = cute.runtime.make_fake_tensor(
        _DTYPES[dtype_name], (tq, h, head_dim), stride=(by8(), by8(), 1), assumed_align=16
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return acc, rows, dq, Float32(1.0), stream


def compile_dq_gather(dtype_name: str, head_dim: int, *, options: str = ""):
    """Compile for sm_90a with TVM-FFI; no GPU needed (`options`: e.g. "--keep-cubin --dump-dir=DIR")."""
    kernel = DqGatherSm90(_DTYPES[dtype_name], head_dim)
    opts = " ".join(o for o in ("--enable-tvm-ffi", options) if o)
    return cute.compile(kernel, *fake_arguments(dtype_name, head_dim), options=opts)


_compiled: dict[tuple[str, int], Any] = {}


def gather_dq(dq_acc, rows, dtype, scale: float | None):
    """dq (total_q, h, d) in `dtype` from dq_acc (total_pad, h, d) float32 (last dim contiguous,
    other strides multiples of 8, 16-byte aligned) at `rows` (total_q,) int64 on its device, times
    scale (None: 1), on the current stream."""
    import torch

    dq = torch.empty((rows.shape[0], *dq_acc.shape[1:]), device=dq_acc.device, dtype=dtype)
    if dq.numel() == 0:
        return dq
    key = (str(dtype).removeprefix("torch."), dq_acc.shape[-1])
    fn = _compiled.get(key)
    if fn is None:
        modules = (sys.modules[__name__], sys.modules[row_lanes.__module__])
        fn = _compiled[key] = load_or_compile("dq_gather", key, modules, lambda: compile_dq_gather(*key))
    fn(dq_acc, rows, dq, 1.0 if scale is None else float(scale))
    return dq
