"""The backward's preprocess: per query row, D = rowsum(dO * O) - dLSE and LSE * log2 e, in fp32,
padded to whole 64-row blocks for the backward kernel's TMA loads.

`backward.row_delta` computes D with torch, through fp32 copies of O and dO (about 0.9 GB of memory
traffic at B4 N4096 H16 d128: a third of the backward kernel's time at the peers' rate); this kernel
reads O and dO once, as 16-bit values. Memory-bound, no TMA, `combine.py`'s layout: a CTA takes
`tile_m` rows in (b, h, q) order (the outputs' order, so its stores are coalesced) and gives each
row `threads_per_row` consecutive lanes of one warp; a lane loads 8 columns of O and of dO per
128-bit load (units lane, lane + threads_per_row, ...), multiplies and sums them in fp32, and the
row's lanes sum by shuffles. dLSE (the LSE's own gradient, where the caller used the LSE) is
subtracted when given: d lse / d s = P, so it enters dS = P (dP - D) through D.

The outputs are (b, h, s_pad) with s_pad >= s_q (the host takes a multiple of 64, so each head's
row is 256-byte aligned and a 64-row block is one TMA box): rows past s_q get D = 0 and
LSE log2 e = +inf, and rows without keys (LSE = -inf) LSE log2 e = +inf (their D is computed as
any row's), so P = exp2(S log2 e scale - that) = 0 there without a test in the backward's loop.

Compile-time: dtype, head_dim_v (a multiple of 8 up to 256) and whether dLSE is given. Batch,
lengths, heads and strides are runtime values.
"""

from __future__ import annotations

import sys
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .cache import load_or_compile
from .sm90_common import LOG2_E

UNIT = 8  # columns per 128-bit load of 16-bit values
_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def row_lanes(name: str, cols: int) -> tuple[int, int, int, int]:
    """(units, threads_per_row, tile_m, units_per_thread) for rows of `cols` 16-bit columns split
    into units of 8 (one 128-bit access each) over CTAs of 128 threads: threads_per_row = the
    largest power of two <= min(16, units), tile_m = 128 / threads_per_row rows per CTA, each lane
    ceil(units / threads_per_row) units. Raises (naming `name`) unless cols is a multiple of 8 in
    [8, 256]. This kernel's layout, and `dq_gather`'s."""
    if cols % UNIT or not 0 < cols <= 256:
        raise ValueError(f"{name} must be a multiple of {UNIT} in [8, 256], got {cols}")
    units = cols // UNIT
    threads_per_row = 1 << (min(16, units).bit_length() - 1)
    return units, threads_per_row, 128 // threads_per_row, -(-units // threads_per_row)


class BwdPreprocessSm90:
    """D for one (dtype, head_dim_v, with dLSE); see the module docstring. threads_per_row = the
    largest power of two <= min(16, dv / 8), tile_m = 128 / threads_per_row rows per CTA of 128
    threads, each lane ceil(dv / 8 / threads_per_row) units."""

    def __init__(self, dtype: type[cutlass.Numeric], head_dim_v: int, with_dlse: bool):
        lanes = row_lanes("head_dim_v", head_dim_v)
        self.units, self.threads_per_row, self.tile_m, self.units_per_thread = lanes
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.with_dlse = with_dlse

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mD: cute.Tensor,
        mLSE2: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mO, mdO (b, s_q, h, dv) self.dtype, last mode contiguous, 16-byte aligned rows; mLSE and
        mdLSE (b, h, s_q) float32 (mdLSE or None); mD, mLSE2 (b, h, s_pad) float32, s_pad >= s_q."""
        rows = mD.shape[0] * mD.shape[1] * mD.shape[2]
        self.kernel(mO, mdO, mLSE, mdLSE, mD, mLSE2).launch(
            grid=[cute.ceil_div(rows, self.tile_m), 1, 1],
            block=[128, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            preferred_smem_carveout=-1,
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mD: cute.Tensor,
        mLSE2: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, heads, seqlen_pad = mD.shape
        seqlen_q = mO.shape[1]
        lane = tidx % self.threads_per_row
        row = bidx * self.tile_m + tidx // self.threads_per_row
        valid = row < batch * heads * seqlen_pad
        row = cutlass.min(row, batch * heads * seqlen_pad - 1)  # past the end: stores nothing
        q = row % seqlen_pad
        b = row // seqlen_pad // heads
        h = row // seqlen_pad % heads
        inside = q < seqlen_q
        q_in = cutlass.min(q, seqlen_q - 1)  # a padding row loads the last row and stores 0, +inf

        gO, gdO = mO[b, q_in, h, None], mdO[b, q_in, h, None]  # (dv,)
        o = cute.make_rmem_tensor((UNIT,), self.dtype)
        do = cute.make_rmem_tensor((UNIT,), self.dtype)
        total = Float32(0.0)
        for u in cutlass.range_constexpr(self.units_per_thread):
            unit = lane + u * self.threads_per_row
            if unit < self.units:
                cute.autovec_copy(cute.local_tile(gO, (UNIT,), (unit,)), o)
                cute.autovec_copy(cute.local_tile(gdO, (UNIT,), (unit,)), do)
                prod = o.load().to(Float32) * do.load().to(Float32)
                total += prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        total = cute.arch.warp_reduction_sum(total, threads_in_group=self.threads_per_row)
        if valid and lane == 0:
            lse2 = Float32.inf
            if inside:
                if const_expr(self.with_dlse):
                    total -= mdLSE[b, h, q]
                lse = mLSE[b, h, q]
                if lse != -Float32.inf:
                    lse2 = lse * LOG2_E
            else:
                total = Float32(0.0)
            mD[b, h, q] = total
            mLSE2[b, h, q] = lse2


def fake_arguments(dtype_name: str, head_dim_v: int, with_dlse: bool):
    """Compile-time stand-ins for (o, do, lse, dlse, d, lse2, stream): batch, s_q, s_pad, heads
    symbolic; o and do with strides that are multiples of 8 elements and 16-byte aligned data; the
    fp32 tensors any strides."""
    b, sq, h, sp = (cute.sym_int() for _ in range(4))

    def by8():
        return cute.sym_int64(divisibility=8)

    def bshd():
        return cute.runtime.make_fake_tensor(
            _DTYPES[dtype_name], (b, sq, h, head_dim_v), stride=(by8(), by8(), by8(), 1), assumed_align=16
        )

    def bhs(seqlen):
        stride = (cute.sym_int64(), cute.sym_int64(), cute.sym_int64())
        return cute.runtime.make_fake_tensor(Float32, (b, h, seqlen), stride=stride, assumed_align=4)

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return bshd(), bshd(), bhs(sq), bhs(sq) if with_dlse else None, bhs(sp), bhs(sp), stream


def compile_preprocess(dtype_name: str, head_dim_v: int, with_dlse: bool, *, options: str = ""):
    """Compile for sm_90a with TVM-FFI; no GPU needed (`options`: e.g. "--keep-cubin --dump-dir=DIR")."""
    kernel = BwdPreprocessSm90(_DTYPES[dtype_name], head_dim_v, with_dlse)
    opts = " ".join(o for o in ("--enable-tvm-ffi", options) if o)
    return cute.compile(kernel, *fake_arguments(dtype_name, head_dim_v, with_dlse), options=opts)


_compiled: dict[tuple[str, int, bool], Any] = {}


def row_stats_kernel(out, dout, lse, dlse, delta, lse2) -> None:
    """delta, lse2 (b, h, s_pad) float32 <- rowsum(dout * out) - dlse and lse * log2 e (module
    docstring: 0 and +inf past s_q, +inf where lse = -inf), on the current stream. out, dout
    (b, s_q, h, dv) float16/bfloat16 with the kernel's strides (last dim contiguous, others
    multiples of 8, 16-byte aligned), s_q >= 1; lse, dlse (b, h, s_q) float32 (dlse or None)."""
    key = (str(out.dtype).removeprefix("torch."), out.shape[-1], dlse is not None)
    fn = _compiled.get(key)
    if fn is None:
        modules = (sys.modules[__name__], sys.modules[f"{__package__}.sm90_common"])
        fn = _compiled[key] = load_or_compile("bwd_pre", key, modules, lambda: compile_preprocess(*key))
    if delta.numel():
        fn(out, dout, lse, dlse, delta, lse2)
