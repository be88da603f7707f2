"""The backward's preprocess: D = rowsum(dO * O) - dLSE per query row, in fp32 (compile tier only:
not yet run on a GPU).

`backward.row_delta` computes the same with torch, through fp32 copies of O and dO (about 0.9 GB of
memory traffic at B4 N4096 H16 d128: a third of the backward kernel's time at the peers' rate);
this kernel reads O and dO once, as 16-bit values. Memory-bound, no TMA, `combine.py`'s layout: a
CTA takes `tile_m` rows in (b, h, q) order (D's order, so its stores are coalesced) and gives each
row `threads_per_row` consecutive lanes of one warp; a lane loads 8 columns of O and of dO per
128-bit load (units lane, lane + threads_per_row, ...), multiplies and sums them in fp32, and the
row's lanes sum by shuffles. dLSE (the LSE's own gradient, where the caller used the LSE) is
subtracted when given: d lse / d s = P, so it enters dS = P (dP - D) through D.

Compile-time: dtype, head_dim_v (a multiple of 8 up to 256) and whether dLSE is given. Batch,
lengths, heads and strides are runtime values.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

UNIT = 8  # columns per 128-bit load of 16-bit values
_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


class BwdPreprocessSm90:
    """D for one (dtype, head_dim_v, with dLSE); see the module docstring. threads_per_row = the
    largest power of two <= min(16, dv / 8), tile_m = 128 / threads_per_row rows per CTA of 128
    threads, each lane ceil(dv / 8 / threads_per_row) units."""

    def __init__(self, dtype: type[cutlass.Numeric], head_dim_v: int, with_dlse: bool):
        if head_dim_v % UNIT or not 0 < head_dim_v <= 256:
            raise ValueError(f"head_dim_v must be a multiple of {UNIT} in [8, 256], got {head_dim_v}")
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.with_dlse = with_dlse
        self.units = head_dim_v // UNIT
        self.threads_per_row = 1 << (min(16, self.units).bit_length() - 1)
        self.tile_m = 128 // self.threads_per_row
        self.units_per_thread = -(-self.units // self.threads_per_row)

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mD: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mO, mdO (b, s_q, h, dv) self.dtype, last mode contiguous, 16-byte aligned rows; mdLSE
        (b, h, s_q) float32 or None; mD (b, h, s_q) float32."""
        rows = mD.shape[0] * mD.shape[1] * mD.shape[2]
        self.kernel(mO, mdO, mdLSE, mD).launch(
            grid=[cute.ceil_div(rows, self.tile_m), 1, 1],
            block=[128, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            preferred_smem_carveout=-1,
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mdLSE: cute.Tensor | None, mD: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, heads, seqlen_q = mD.shape
        lane = tidx % self.threads_per_row
        row = bidx * self.tile_m + tidx // self.threads_per_row
        valid = row < batch * heads * seqlen_q
        row = cutlass.min(
            row, batch * heads * seqlen_q - 1
        )  # past the end: loads the last row, stores nothing
        q = row % seqlen_q
        b = row // seqlen_q // heads
        h = row // seqlen_q % heads

        gO, gdO = mO[b, q, h, None], mdO[b, q, h, None]  # (dv,)
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
            if const_expr(self.with_dlse):
                total -= mdLSE[b, h, q]
            mD[b, h, q] = total


def fake_arguments(dtype_name: str, head_dim_v: int, with_dlse: bool):
    """Compile-time stand-ins for (o, do, dlse, d, stream): batch, s_q, heads symbolic; o and do
    with strides that are multiples of 8 elements and 16-byte aligned data; dlse and d any strides."""
    b, sq, h = (cute.sym_int() for _ in range(3))

    def by8():
        return cute.sym_int64(divisibility=8)

    def bshd():
        return cute.runtime.make_fake_tensor(
            _DTYPES[dtype_name], (b, sq, h, head_dim_v), stride=(by8(), by8(), by8(), 1), assumed_align=16
        )

    def bhs():
        stride = (cute.sym_int64(), cute.sym_int64(), cute.sym_int64())
        return cute.runtime.make_fake_tensor(Float32, (b, h, sq), stride=stride, assumed_align=4)

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return bshd(), bshd(), bhs() if with_dlse else None, bhs(), stream


def compile_preprocess(dtype_name: str, head_dim_v: int, with_dlse: bool, *, options: str = ""):
    """Compile for sm_90a with TVM-FFI; no GPU needed (`options`: e.g. "--keep-cubin --dump-dir=DIR")."""
    kernel = BwdPreprocessSm90(_DTYPES[dtype_name], head_dim_v, with_dlse)
    opts = " ".join(o for o in ("--enable-tvm-ffi", options) if o)
    return cute.compile(kernel, *fake_arguments(dtype_name, head_dim_v, with_dlse), options=opts)


_compiled: dict[tuple[str, int, bool], Any] = {}


def row_delta_kernel(out, dout, dlse, delta) -> None:
    """delta (b, h, s_q) float32 <- rowsum(dout * out) - dlse, on the current stream. out, dout
    (b, s_q, h, dv) float16/bfloat16 with the kernel's strides (last dim contiguous, others
    multiples of 8, 16-byte aligned); dlse (b, h, s_q) float32 or None."""
    key = (str(out.dtype).removeprefix("torch."), out.shape[-1], dlse is not None)
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = compile_preprocess(*key)
    if delta.numel():
        fn(out, dout, dlse, delta)
