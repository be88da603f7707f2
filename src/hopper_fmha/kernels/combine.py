"""Split-KV combine ("flash decoding"): merge each row's split partials by their log-sum-exp.

The split kernel leaves, per split s, an output normalized within the split and its LSE:
out_partial (splits, b, s_q, h, dv) and lse_partial (splits, b, h, s_q), both float32 and
contiguous; a split that saw no key of a row has lse = -inf and an out_partial row that is
ignored (zero or garbage, NaN included). This kernel writes, per row (b, q, h),

    lse = log sum_s exp(lse_s),    out = sum_s exp(lse_s - lse) * out_s,

and out = 0, lse = -inf for a row whose every lse_s is -inf: `hopper_fmha.emulate.combine_splits`.

Kernel (`CombineSm90`), memory-bound, no TMA: a CTA takes `tile_m` rows, in (b, h, q) order (the
order of lse_partial and lse, so their loads and stores are coalesced), and gives each row
`threads_per_row` consecutive lanes of one warp. Columns go in units of 8 (dv is a multiple of
8): two 128-bit loads of fp32 partials, one 128-bit store of 8 fp16/bf16 outputs; lane l of a row
takes units l, l + threads_per_row, ... (where dv / 8 is not a multiple of threads_per_row, the
last round's lanes past the row load its last unit again and store nothing). Per CTA:

1. Each row's lanes load the row's lse_s, s = lane, lane + threads_per_row, ..., into shared
   memory (rows past the end read as -inf), reduce the max m by shuffles, then turn each lse_s
   into the weight w_s = 2^(lse_s log2 e - m log2 e) (exp2 with log2 e folded in, as the forward
   kernels; m -> 0 for an all -inf row, so every w_s is 0 and never NaN) and reduce their sum Σ.
   lse = m + ln Σ (-inf where Σ = 0) goes to global memory. A __syncwarp publishes the weights:
   a row's readers are the warp that wrote them.
2. Each lane walks the splits `splits_in_flight` at a time (8 units of loads, 64 registers): all
   the group's loads, then out += w_s * out_s in fp32 registers for the splits with w_s > 0. A
   group whose weights are all 0 is not read (rows past the end, and the empty splits at the end
   of short rows); in a group that is read, a split of weight 0 is loaded but never added, so
   -inf splits' garbage (NaN included) never enters the sum.
3. out * (1 / Σ) (0 for an empty row), converted, stored by 128-bit vectors.

Compile-time: dtype, dv, and max_splits, the bound on the runtime split count that sizes the
weights' shared memory (tile_m x (max_splits + 1) floats, the +1 keeping the warp's rows in
different banks). Batch, lengths, heads, strides and num_splits (lse_partial's first extent) are
runtime values: one compiled kernel per (dtype, dv, max_splits).

Host: `combine` (torch tensors; compiled kernels cached in memory by that key) and
`compile_combine` (no GPU needed: the compile tier inspects its registers).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .cache import load_or_compile
from .sm90_common import LN_2, LOG2_E

# Split counts: `max_splits_for` rounds up to a power of two from MIN_MAX_SPLITS (a few kernels,
# not one per count), up to MAX_SPLITS (the weights of 64 rows x 129 splits fill 33 KB of
# shared memory, below the 48 KB a launch gets without opting in).
MIN_MAX_SPLITS = 16
MAX_SPLITS = 128
UNIT = 8  # columns per lane per step: two 128-bit fp32 loads, one 128-bit 16-bit store
MAX_HEAD_DIM_V = 256
_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


class CombineSm90:
    """The combine kernel for one (dtype, head_dim_v, max_splits); see the module docstring.

    Tile rule: threads_per_row = the largest power of two <= min(16, dv / 8); tile_m =
    min(64, 128 / threads_per_row) rows per CTA (128 threads, 64 where dv = 8); each lane holds
    ceil(dv / 8 / threads_per_row) units (at most 2 at dv <= 256) and loads `splits_in_flight` =
    8 / (its units) splits of them before accumulating (64 fp32 registers of loads in flight).
    ptxas: 118-124 registers, no stack, at dv = 64, 72, 128, 256 (tests/test_compile_combine.py).
    """

    def __init__(self, dtype: type[cutlass.Numeric], head_dim_v: int, max_splits: int):
        if head_dim_v % UNIT or not 0 < head_dim_v <= MAX_HEAD_DIM_V:
            raise ValueError(f"head_dim_v must be a multiple of {UNIT} in [8, 256], got {head_dim_v}")
        if not 1 <= max_splits <= MAX_SPLITS:
            raise ValueError(f"max_splits must be in [1, {MAX_SPLITS}], got {max_splits}")
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.max_splits = max_splits
        self.units = head_dim_v // UNIT
        self.threads_per_row = 1 << (min(16, self.units).bit_length() - 1)
        self.tile_m = min(64, 128 // self.threads_per_row)
        self.num_threads = self.tile_m * self.threads_per_row
        self.units_per_thread = -(-self.units // self.threads_per_row)
        self.splits_in_flight = 8 // self.units_per_thread

    @cute.jit
    def __call__(
        self,
        mOPartial: cute.Tensor,
        mLSEPartial: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mOPartial (splits, b, s_q, h, dv) and mLSEPartial (splits, b, h, s_q) float32; mO
        (b, s_q, h, dv) self.dtype, last mode contiguous, 16-byte aligned rows; mLSE (b, h, s_q)
        float32, any strides. splits = mLSEPartial's first extent, 1 <= splits <= max_splits."""
        rows = mLSE.shape[0] * mLSE.shape[1] * mLSE.shape[2]
        self.kernel(mOPartial, mLSEPartial, mO, mLSE).launch(
            grid=[cute.ceil_div(rows, self.tile_m), 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            # Registers at ptxas's choice: without a bound it keeps occupancy by moving each load
            # next to its adds, 2 splits in flight instead of splits_in_flight (SASS, d = 128).
            # A carveout is given so that compiling asks no device (see sm90_paper._occupancy).
            min_blocks_per_mp=1,
            preferred_smem_carveout=-1,
            # Programmatic dependent launch: the CTAs may start while the split kernel's last CTAs
            # run (it lets them go as each of its CTAs runs out of tiles); each waits for that
            # kernel's completion and memory flush (`griddepcontrol_wait`) before reading.
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, mOPartial: cute.Tensor, mLSEPartial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        weights_layout = cute.make_layout((self.tile_m, self.max_splits), stride=(self.max_splits + 1, 1))
        sW = smem.allocate_tensor(Float32, weights_layout, 16)

        num_splits = mLSEPartial.shape[0]
        batch, heads, seqlen_q = mLSE.shape
        row_local = tidx // self.threads_per_row
        lane = tidx % self.threads_per_row
        row = bidx * self.tile_m + row_local
        valid = row < batch * heads * seqlen_q
        q = row % seqlen_q
        b = row // seqlen_q // heads
        h = row // seqlen_q % heads

        cute.arch.griddepcontrol_wait()  # the partials are complete from here on
        # 1. Weights and LSE.
        lse_max = -Float32.inf
        for s in cutlass.range(lane, num_splits, self.threads_per_row):
            lse_s = -Float32.inf
            if valid:
                lse_s = mLSEPartial[s, b, h, q]
            sW[row_local, s] = lse_s
            lse_max = cute.arch.fmax(lse_max, lse_s)
        lse_max = cute.arch.warp_reduction_max(lse_max, threads_in_group=self.threads_per_row)
        max_log2 = lse_max * LOG2_E
        if lse_max == -Float32.inf:
            max_log2 = Float32(0.0)
        total = Float32(0.0)
        for s in cutlass.range(lane, num_splits, self.threads_per_row):
            w = cute.math.exp2(sW[row_local, s] * LOG2_E - max_log2, fastmath=True)
            sW[row_local, s] = w
            total += w
        total = cute.arch.warp_reduction_sum(total, threads_in_group=self.threads_per_row)
        inv_total = Float32(0.0)
        lse = -Float32.inf
        if total > 0.0:
            inv_total = cute.arch.rcp_approx(total)
            lse = lse_max + cute.math.log2(total, fastmath=True) * LN_2
        if valid and lane == 0:
            mLSE[b, h, q] = lse
        cute.arch.sync_warp()

        # 2. Weighted sum of the partials, splits_in_flight splits at a time.
        group = self.splits_in_flight
        acc = cute.make_rmem_tensor((UNIT, self.units_per_thread), Float32)
        acc.fill(0.0)
        parts = cute.make_rmem_tensor((UNIT, self.units_per_thread, group), Float32)
        w_group = cute.make_rmem_tensor((group,), Float32)
        gRow = mOPartial[None, b, q, h, None]  # (splits, dv)
        for s0 in cutlass.range(0, num_splits, group, unroll=1):
            w_max = Float32(0.0)
            for k in cutlass.range_constexpr(group):
                w_group[k] = Float32(0.0)
                if s0 + k < num_splits:
                    w_group[k] = sW[row_local, s0 + k]
                w_max = cute.arch.fmax(w_max, w_group[k])
            if w_max > 0.0:
                for k in cutlass.range_constexpr(group):
                    split = cutlass.min(s0 + k, num_splits - 1)  # past the end: loaded, not added
                    for u in cutlass.range_constexpr(self.units_per_thread):
                        src = cute.local_tile(gRow[split, None], (UNIT,), (self._unit(lane, u),))
                        cute.autovec_copy(src, parts[None, u, k])
                for k in cutlass.range_constexpr(group):
                    if w_group[k] > 0.0:
                        for u in cutlass.range_constexpr(self.units_per_thread):
                            acc[None, u].store(acc[None, u].load() + w_group[k] * parts[None, u, k].load())

        # 3. Normalize, convert, store.
        if valid:
            gOut = mO[b, q, h, None]  # (dv,)
            out = cute.make_rmem_tensor((UNIT,), self.dtype)
            for u in cutlass.range_constexpr(self.units_per_thread):
                if self._in_row(lane, u):
                    out.store((acc[None, u].load() * inv_total).to(self.dtype))
                    cute.autovec_copy(out, cute.local_tile(gOut, (UNIT,), (self._unit(lane, u),)))

    def _tail(self, u: int) -> bool:
        """Whether round u of a row's units may pass its end (dv / 8 not a multiple of
        threads_per_row, last round)."""
        return (u + 1) * self.threads_per_row > self.units

    @cute.jit
    def _unit(self, lane: Int32, u: cutlass.Constexpr[int]) -> Int32:
        """The unit a lane takes in round u; in a tail round the row's last unit for lanes past
        the end (a load that stays inside the row, its result never stored)."""
        unit = lane + u * self.threads_per_row
        if const_expr(self._tail(u)):
            unit = cutlass.min(unit, self.units - 1)
        return unit

    @cute.jit
    def _in_row(self, lane: Int32, u: cutlass.Constexpr[int]):
        """Whether the lane's unit of round u lies inside the row (a runtime test in tail rounds)."""
        if const_expr(self._tail(u)):
            return lane + u * self.threads_per_row < self.units
        return True


def max_splits_for(num_splits: int) -> int:
    """The compile-time split bound for `num_splits`: the next power of two, at least 16."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    return max(MIN_MAX_SPLITS, 1 << (num_splits - 1).bit_length())


def fake_arguments(dtype_name: str, head_dim_v: int):
    """Compile-time stand-ins for (out_partial, lse_partial, out, lse, stream): splits, batch,
    s_q and heads symbolic; out_partial and out strides symbolic multiples of 8 elements, their
    data 16-byte aligned (128-bit vectors); lse_partial's last mode contiguous, lse any strides."""
    splits, b, sq, h = (cute.sym_int() for _ in range(4))

    def by8():
        return cute.sym_int64(divisibility=8)

    def any_stride():
        return cute.sym_int64()

    o_partial = cute.runtime.make_fake_tensor(
        Float32, (splits, b, sq, h, head_dim_v), stride=(by8(), by8(), by8(), by8(), 1), assumed_align=16
    )
    lse_partial = cute.runtime.make_fake_tensor(
        Float32, (splits, b, h, sq), stride=(any_stride(), any_stride(), any_stride(), 1), assumed_align=4
    )
    out = cute.runtime.make_fake_tensor(
        _DTYPES[dtype_name], (b, sq, h, head_dim_v), stride=(by8(), by8(), by8(), 1), assumed_align=16
    )
    lse = cute.runtime.make_fake_tensor(
        Float32, (b, h, sq), stride=(any_stride(), any_stride(), any_stride()), assumed_align=4
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return o_partial, lse_partial, out, lse, stream


def compile_combine(dtype_name: str, head_dim_v: int, max_splits: int, *, options: str = ""):
    """Compile the combine kernel for ("float16" | "bfloat16", dv, max_splits) with TVM-FFI (torch
    tensors pass straight; the current stream is used). No GPU needed. `options` adds to the
    compiler's, e.g. "--keep-cubin --dump-dir=DIR" for `compiled.artifacts.CUBIN`."""
    kernel = CombineSm90(_DTYPES[dtype_name], head_dim_v, max_splits)
    opts = " ".join(o for o in ("--enable-tvm-ffi", options) if o)
    return cute.compile(kernel, *fake_arguments(dtype_name, head_dim_v), options=opts)


_compiled: dict[tuple[str, int, int], Any] = {}
_lock = threading.Lock()


def get_combine(dtype_name: str, head_dim_v: int, max_splits: int):
    """The compiled kernel for the key, compiled on first use and kept in memory."""
    key = (dtype_name, head_dim_v, max_splits)
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                modules = (sys.modules[__name__], sys.modules[f"{__package__}.sm90_common"])
                fn = _compiled[key] = load_or_compile("combine", key, modules, lambda: compile_combine(*key))
    return fn


def combine(out_partial, lse_partial, out, lse, num_splits: int | None = None) -> None:
    """Merge split partials into out and lse, in place, on the current CUDA stream.

    out_partial: (S, b, s_q, h, dv) float32; lse_partial: (S, b, h, s_q) float32 (contiguous, as
    the split kernel writes them); the first num_splits (default S) splits are merged, 1 <=
    num_splits <= min(S, 128). out: (b, s_q, h, dv) float16/bfloat16, dv a multiple of 8 up to
    256, last dim contiguous, other strides multiples of 8, 16-byte aligned data (a view of a
    larger tensor works). lse: (b, h, s_q) float32, any strides.

    The per-call path checks only what the compiled kernel cannot: the split count and out's
    dtype. Its TVM-FFI entry checks the rest (dtypes, shapes agreeing, dv, stride divisibility,
    alignment, device type) and raises ValueError.
    """
    splits = out_partial.shape[0]
    if num_splits is not None and num_splits != splits:
        if not 1 <= num_splits <= splits:
            raise ValueError(f"num_splits must be in [1, {splits}] (the partials' splits), got {num_splits}")
        out_partial, lse_partial = out_partial[:num_splits], lse_partial[:num_splits]
        splits = num_splits
    dtype_name = str(out.dtype).removeprefix("torch.")
    if dtype_name not in _DTYPES:
        raise TypeError(f"out must be float16 or bfloat16, got {out.dtype}")
    if out.numel() == 0:
        return
    get_combine(dtype_name, out.shape[-1], max_splits_for(splits))(out_partial, lse_partial, out, lse)
