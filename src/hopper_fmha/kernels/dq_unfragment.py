"""The backward's last step with `sm90_bwd.DQ_FRAGMENTS` (and `DQ_FRAGMENTS_WIDE`,
`VARLEN_DQ_FRAGMENTS`): dQ in order, scaled and cast to 16 bits, from the fp32 accumulator that the
main kernel adds in its fragment order.

`sm90_bwd.dq_from_fragments` does this with one torch elementwise pass from a permuted view of the
accumulator. Torch runs that pass with its general strided kernel: 0.159 ms at d64 (B4 N4096 H32
bf16, 2.95 ms in all) and 0.208 ms at d128 causal tile 64 with the scale, against 0.066 ms for the
plain contiguous scale-and-cast of the same bytes (H200, session 34, `bwd_profile`). This kernel
reads the accumulator in its own order, 16 bytes a thread, every warp one contiguous 512-byte run,
and writes each thread's four values as two 4-byte pairs of dQ (tile 80: four 2-byte values).

The fragment order (`sm90_bwd.fragment_dims`; `unit_place` below): per (batch, head) the
accumulator holds whole blocks of tile_m queries x d; a block holds, per warpgroup wg and j < J,
the 128 threads' 4 accumulator values, value 4 j + 2 h2 + e of thread 32 warp + lane at GEMM row
16 warp + 8 h2 + lane // 4 and column 8 j + 2 (lane % 4) + e. Tile 128: rows are the block's
queries 64 wg + ..., columns d (J = d / 8). Tile 64: rows are the queries, columns d / 2 wg + ...
(J = d / 16). Tile 80 (d128 only) holds dQ transposed: GEMM rows are d, 64 wg + ..., columns the
queries (J = 10), so a thread's values land as four 2-byte stores (a warp's store: 4 queries x
16 contiguous bytes).

Memory-bound, no TMA, no shared memory: a CTA per (batch, head, block), its thread t taking
floats 4 t .. 4 t + 3 of each of the block's 512-float chunks, whose place in dQ is a compile-time
offset plus the thread's own. Compile-time: dtype, head_dim, tile_m, mapped; batch, heads, blocks
and seqlen_q are runtime values (rows past seqlen_q, the last block's padding, are not written).
Mapped (`unfragment_dq_rows`, the varlen backward): one batch of padded rows, each sequence's from
its padded start, and an int32 map from padded row to packed row (-1: padding, not written), so
that the un-permute, scale, cast and gather are one pass.
"""

from __future__ import annotations

import sys
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .cache import load_or_compile

_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
TILES = (64, 80, 128)
THREADS = 128


def supports(tile_m: int, head_dim: int) -> bool:
    """Whether the kernel takes this query tile and head dim (tile 80 is d128's, `fragment_dims`)."""
    if tile_m == 80:
        return head_dim == 128
    return tile_m in TILES and head_dim % 16 == 0 and 16 <= head_dim <= 256


def thread_place(thread, tile_m: int):
    """(row, column) in dQ's block of a warpgroup thread's value h2 = 0, e = 0 within a chunk
    (SM90's accumulator layout; tile 80's GEMM is transposed: its rows are dQ's columns)."""
    warp, lane = thread // 32, thread % 32
    if tile_m == 80:
        return 2 * (lane % 4), 16 * warp + lane // 4
    return 16 * warp + lane // 4, 2 * (lane % 4)


def value_offset(h2: int, e: int, tile_m: int) -> tuple[int, int]:
    """(row, column) of a thread's value 2 h2 + e (of its 4 in a chunk) from its value 0."""
    return (e, 8 * h2) if tile_m == 80 else (8 * h2, e)


def chunk_place(chunk: int, tile_m: int, head_dim: int) -> tuple[int, int]:
    """(row, column) offsets in dQ's block of a block's chunk (warpgroup wg, j): 128 threads' 4
    values, 512 floats. Tile 128: rows 64 wg + ..., columns 8 j + ...; tile 64: rows as the GEMM's,
    columns d / 2 wg + 8 j + ...; tile 80: rows (queries) 8 j + ..., columns (d) 64 wg + ..."""
    if tile_m == 128:
        wg, j = divmod(chunk, head_dim // 8)
        return 64 * wg, 8 * j
    if tile_m == 80:
        wg, j = divmod(chunk, 10)
        return 8 * j, 64 * wg
    wg, j = divmod(chunk, head_dim // 16)
    return 0, head_dim // 2 * wg + 8 * j


def unit_place(u: int, tile_m: int, head_dim: int) -> tuple[int, int, int]:
    """Where unit u (floats 4 u .. 4 u + 3) of a (batch, heads, blocks * tile_m, head_dim)
    fragment-ordered accumulator goes in dQ (batch, seqlen, heads, head_dim): (block of all
    (batch, head, block) in that order, row in dQ's block, col) of its float 4 u; float
    4 u + 2 h2 + e goes `value_offset(h2, e, tile_m)` further. The kernel's mapping, for the host
    tests."""
    per_block = tile_m * head_dim // 4
    flat, within = divmod(u, per_block)
    chunk, thread = divmod(within, THREADS)
    grow, gcol = thread_place(thread, tile_m)
    row, col = chunk_place(chunk, tile_m, head_dim)
    return flat, row + grow, col + gcol


def load_batch(chunks: int, copies: int = 1) -> int:
    """Chunks loaded before their stores: the most, up to 16 // copies (64 registers of loaded
    values), that divide `chunks`."""
    return max(n for n in range(1, 16 // copies + 1) if chunks % n == 0)


class DqUnfragmentSm90:
    """dq (b, s, h, d) dtype <- the fragment-ordered acc (flat float32), times scale. A CTA of 128
    threads per (batch, head, block), one 512-float chunk per step: thread t reads floats
    4 t .. 4 t + 3 of each chunk (a warp: 512 contiguous bytes) and writes them as two pairs
    (tile 80: four single values). copies > 1 (deterministic dQ's chains, `sm90_bwd.DQ_CHAINS`):
    the accumulator holds, per (batch, head), that many copies of its blocks one after another,
    and a thread adds its values of copy 0, 1, ... in that order (fp32, the order
    `sm90_bwd.sum_copies` adds in) before the scale and the cast."""

    def __init__(
        self, dtype: type[cutlass.Numeric], head_dim: int, tile_m: int, mapped: bool = False, copies: int = 1
    ):
        assert supports(tile_m, head_dim), (tile_m, head_dim)
        assert copies >= 1 and not (mapped and copies > 1)
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.chunks = tile_m * head_dim // (4 * THREADS)
        self.mapped = mapped
        self.copies = copies

    @cute.jit
    def __call__(
        self, mAcc: cute.Tensor, mDq: cute.Tensor, scale: Float32, mRows: cute.Tensor | None,
        stream: cuda.CUstream,
    ):  # fmt: skip
        """mAcc (n,) float32, 16-byte aligned, n = batch * heads * blocks * tile_m * head_dim with
        blocks * tile_m >= seqlen; mDq (batch, seqlen, heads, head_dim) self.dtype, last mode
        contiguous. `mapped` (the varlen backward's padded rows): batch 1, and row s of the
        accumulator's (blocks * tile_m) goes to dq row mRows[s] (int32; negative: nowhere)."""
        self.kernel(mAcc, mDq, scale, mRows).launch(
            grid=[mAcc.shape[0] // (self.tile_m * self.head_dim * self.copies), 1, 1],
            block=[THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def dest_row(self, s, b, seqlen, mRows):
        """(dq's batch and row for accumulator row s of batch b, whether it has one)."""
        if self.mapped:
            row = mRows[s]
            return 0, row, row >= 0
        return b, s, s < seqlen

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mDq: cute.Tensor, scale: Float32, mRows: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, seqlen, heads, _ = mDq.shape
        copies = self.copies
        blocks = mAcc.shape[0] // (self.tile_m * self.head_dim) // (batch * heads * copies)
        bh, m = bidx // blocks, bidx % blocks
        b, h = bh // heads, bh % heads
        grow, gcol = thread_place(tidx, self.tile_m)
        size = self.tile_m * self.head_dim
        if const_expr(copies == 1):
            gCopies = [cute.local_tile(mAcc, (size,), (Int64(bidx),))]
        else:  # copy k of block m: block (bh copies + k) blocks + m of the flat accumulator
            gCopies = [
                cute.local_tile(mAcc, (size,), (Int64(bh * copies + k) * blocks + m,)) for k in range(copies)
            ]
        # All of the thread's loads first, in batches of up to 16 chunks (64 registers) over the
        # copies, then the stores: ptxas keeps a load after any store to the same (for it, possibly
        # aliased) memory.
        batch_chunks = load_batch(self.chunks, copies)
        acc = cute.make_rmem_tensor(cute.make_layout((batch_chunks, 4), stride=(4, 1)), Float32)
        more = cute.make_rmem_tensor(
            cute.make_layout((batch_chunks, max(copies - 1, 1), 4), stride=(4 * max(copies - 1, 1), 4, 1)),
            Float32,
        )
        pair = cute.make_rmem_tensor((2,), self.dtype)
        for first in cutlass.range_constexpr(0, self.chunks, batch_chunks):
            for c in cutlass.range_constexpr(batch_chunks):
                unit = (first + c) * THREADS + tidx
                cute.autovec_copy(cute.local_tile(gCopies[0], (4,), (unit,)), acc[c, None])
                for k in cutlass.range_constexpr(1, copies):
                    cute.autovec_copy(cute.local_tile(gCopies[k], (4,), (unit,)), more[c, k - 1, None])
            for k in cutlass.range_constexpr(1, copies):  # (copy 0 + copy 1) + copy 2 ...
                for c in cutlass.range_constexpr(batch_chunks):
                    for i in cutlass.range_constexpr(4):
                        acc[c, i] = acc[c, i] + more[c, k - 1, i]
            # The stores by row: a row's address and bound once for all of its chunks.
            places = [chunk_place(first + c, self.tile_m, self.head_dim) for c in range(batch_chunks)]
            for row0 in sorted({row for row, _ in places}):
                if const_expr(self.tile_m == 80):
                    # transposed: value 2 h2 + e at row + e, column + 8 h2; 2-byte stores
                    for e in cutlass.range_constexpr(2):
                        bb, row, valid = self.dest_row(m * self.tile_m + row0 + grow + e, b, seqlen, mRows)
                        if valid:
                            gRow = mDq[bb, row, h, None]
                            for c in cutlass.range_constexpr(batch_chunks):
                                if const_expr(places[c][0] == row0):
                                    for h2 in cutlass.range_constexpr(2):
                                        col = places[c][1] + gcol + 8 * h2
                                        gRow[col] = (acc[c, 2 * h2 + e] * scale).to(self.dtype)
                else:
                    for h2 in cutlass.range_constexpr(2):
                        bb, row, valid = self.dest_row(
                            m * self.tile_m + row0 + grow + 8 * h2, b, seqlen, mRows
                        )
                        if valid:
                            gRow = mDq[bb, row, h, None]
                            for c in cutlass.range_constexpr(batch_chunks):
                                if const_expr(places[c][0] == row0):
                                    pair[0] = (acc[c, 2 * h2] * scale).to(self.dtype)
                                    pair[1] = (acc[c, 2 * h2 + 1] * scale).to(self.dtype)
                                    col = places[c][1] + gcol
                                    cute.autovec_copy(pair, cute.local_tile(gRow, (2,), (col // 2,)))


def fake_arguments(dtype_name: str, head_dim: int, mapped: bool = False):
    """Compile-time stand-ins for (acc, dq, scale, rows, stream): sizes symbolic, dq's strides
    multiples of 8 elements, the accumulator 16-byte aligned; rows (`mapped`) int32 contiguous,
    else None."""
    n = cute.sym_int64(divisibility=4)
    b, s, h = (cute.sym_int() for _ in range(3))

    def by8():
        return cute.sym_int64(divisibility=8)

    acc = cute.runtime.make_fake_tensor(Float32, (n,), stride=(1,), assumed_align=16)
    dq = cute.runtime.make_fake_tensor(
        _DTYPES[dtype_name], (b, s, h, head_dim), stride=(by8(), by8(), by8(), 1), assumed_align=16
    )
    rows = None
    if mapped:
        rows = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return acc, dq, Float32(1.0), rows, stream


def compile_dq_unfragment(
    dtype_name: str, head_dim: int, tile_m: int, mapped: bool = False, copies: int = 1, *, options: str = ""
):
    """Compile for sm_90a with TVM-FFI; no GPU needed (`options`: e.g. "--keep-cubin --dump-dir=DIR")."""
    kernel = DqUnfragmentSm90(_DTYPES[dtype_name], head_dim, tile_m, mapped, copies)
    opts = " ".join(o for o in ("--enable-tvm-ffi", options) if o)
    return cute.compile(kernel, *fake_arguments(dtype_name, head_dim, mapped), options=opts)


_compiled: dict[tuple[str, int, int, bool, int], Any] = {}


def _kernel(dtype, head_dim: int, tile_m: int, mapped: bool, copies: int = 1):
    key = (str(dtype).removeprefix("torch."), head_dim, tile_m, mapped, copies)
    fn = _compiled.get(key)
    if fn is None:
        modules = (sys.modules[__name__],)
        fn = _compiled[key] = load_or_compile(
            "dq_unfragment", key, modules, lambda: compile_dq_unfragment(*key)
        )
    return fn


def unfragment_dq(buf, seqlen_q: int, dtype, scale: float | None, tile_m: int, copies: int = 1):
    """dQ (b, seqlen_q, h, d) in `dtype`, contiguous, from the fragment-ordered fp32 `buf`
    (b, h, copies * blocks * tile_m, d), contiguous, times scale (None: 1), on the current stream:
    as `sm90_bwd.dq_from_fragments`, by this module's kernel (copies > 1: of the copies' sum)."""
    import torch

    b, h, rows, d = buf.shape
    assert rows % copies == 0
    rows //= copies
    assert buf.is_contiguous() and rows % tile_m == 0 and rows - tile_m < seqlen_q <= rows
    dq = torch.empty(b, seqlen_q, h, d, device=buf.device, dtype=dtype)
    if dq.numel() == 0:
        return dq
    fn = _kernel(dtype, d, tile_m, False, copies)
    fn(buf.view(-1), dq, 1.0 if scale is None else float(scale), None)
    return dq


def unfragment_dq_rows(buf, rows, total_q: int, dtype, scale: float | None, tile_m: int):
    """dQ (total_q, h, d) in `dtype`, contiguous, from the varlen backward's fragment-ordered fp32
    `buf` (h, blocks * tile_m, d), contiguous, its rows the padded ones (`sm90_bwd.padded_starts`),
    times scale (None: 1): row s goes to dq row rows[s] (int32 (blocks * tile_m,); negative for
    padding), every dq row from exactly one s."""
    import torch

    h, padded, d = buf.shape
    assert buf.is_contiguous() and padded % tile_m == 0 and rows.shape == (padded,)
    dq = torch.empty(total_q, h, d, device=buf.device, dtype=dtype)
    if dq.numel() == 0:
        return dq
    fn = _kernel(dtype, d, tile_m, True)
    fn(buf.view(-1), dq[None], 1.0 if scale is None else float(scale), rows)
    return dq
