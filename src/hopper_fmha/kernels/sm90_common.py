"""Pieces both SM90 kernels use: accumulator layout views, the WGMMA issue helper, the paired
fp32 -> fp16/bf16 conversion, constants."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def tiled_mma_64(
    dtype, b_major, n: int, num_wg: int = 1, a_source=warpgroup.OperandSource.SMEM, a_major=OperandMajorMode.K
) -> cute.TiledMma:
    """A warpgroup MMA on 64 x n tiles, A K-major unless a_major says (MN-major: from shared
    memory only), fp32 accumulators; num_wg warpgroups stack along M (warpgroup w computes rows
    [64w, 64w + 64))."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        a_major,
        b_major,
        Float32,
        atom_layout_mnk=(num_wg, 1, 1),
        tiler_mn=(64, n),
        a_source=a_source,
    )


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None):
    """A (rows, cols[, stages]) row-major buffer in shared memory, swizzled as widely as cols
    allows (128B at 64 16-bit columns and more), as TMA and WGMMA read it."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """Row/column view of an SM90 accumulator: ((2,2,V),MMA_M,MMA_N) -> ((2,MMA_M),(2,V,MMA_N)).

    In the WGMMA accumulator a thread owns, per 64-row MMA block, rows r and r+8 (mode 0[1])
    and column pairs spaced 8 apart (modes 0[0] and 0[2]).
    """
    flat = cute.make_layout(acc_layout.shape)
    if const_expr(len(flat.shape[0]) == 2):  # N = 8: one column pair, ((2,2),MMA_M,MMA_N)
        shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[2]))
        stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[2]))
    else:
        shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[0][2], flat.shape[2]))
        stride = (
            (flat.stride[0][1], flat.stride[1]),
            (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
        )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_to_operand_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """The paper's ReshapeTStoTP: GEMM-I accumulator layout -> GEMM-II register-A layout.

    ((2,2,V),MMA_M,1):((1,2,4),sM,_) -> ((2,2,2),MMA_M,V/2):((1,2,4),sM,8). A 64x16 A-operand
    block takes two neighbouring 8-column groups of the 64xN accumulator, so the value mode
    keeps its first two sub-modes, takes 2 of the V column groups, and the remaining V/2
    groups become the K-block mode of GEMM-II. No data moves: it is a new view of the same
    registers.
    """
    s = acc_layout.shape
    d = acc_layout.stride
    shape = ((s[0][0], s[0][1], 2), s[1], s[0][2] // 2)
    stride = ((d[0][0], d[0][1], d[0][2]), d[1], d[0][2] * 2)
    return cute.make_layout(shape, stride=stride)


def atom_rows(t: cute.Tensor, m: int, num_k: int | None = None) -> cute.Tensor:
    """The 64-row MMA block m of a register fragment (V, MMA_M, K) as a (V, 1, K) view, its K
    mode cut to the first num_k blocks if given (an accumulator's K mode is its N mode)."""
    shape, stride = t.layout.shape, t.layout.stride
    k = shape[2] if num_k is None else num_k
    layout = cute.make_layout((shape[0], 1, k), stride=(stride[0], 0, stride[2]))
    return cute.make_tensor(t.iterator + m * stride[1], layout)


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wg_wait: cutlass.Constexpr[int] = 0,
    then=None,
    then_zero_init: cutlass.Constexpr[bool] = False,
):
    """Issue one warpgroup GEMM over all K blocks as one commit group; wait_group(wg_wait) if >= 0.

    then: (tiled_mma, acc, A, B) of a second GEMM issued after the first in the same commit
    group, over A's K blocks, accumulating into its acc (or overwriting it: then_zero_init).
    """
    warpgroup.fence()
    gemms = [(tiled_mma, acc, tCrA, tCrB, zero_init)]
    if const_expr(then is not None):
        gemms.append((*then, then_zero_init))
    for mma, c, a, b, overwrite in gemms:
        # A fresh atom per GEMM: ACCUMULATE is mutated below, which must not leak across loop regions.
        mma_atom = cute.make_mma_atom(mma.op)
        mma_atom.set(warpgroup.Field.ACCUMULATE, not overwrite)
        for k in cutlass.range_constexpr(cute.size(a.shape[2])):
            cute.gemm(mma_atom, c, a[None, None, k], b[None, None, k], c)
            mma_atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)


@dsl_user_op
def as_int32(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of an fp32 value as an int32 (no conversion)."""
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _bulk_s2g(instruction: str, gmem_ptr, smem_ptr, nbytes: int, loc, ip):
    """One bulk copy instruction from shared to global memory ([$0] global, [$1] shared, $2 bytes)."""
    llvm.inline_asm(
        None,
        [
            gmem_ptr.llvm_ptr,
            smem_ptr.toint(loc=loc, ip=ip).ir_value(),
            Int32(nbytes).ir_value(loc=loc, ip=ip),
        ],
        instruction,
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr, smem_ptr, nbytes: int, *, loc=None, ip=None):
    """gmem[:n] += smem[:n], n = nbytes / 4 fp32 values, contiguous on both sides (16-byte aligned,
    nbytes a multiple of 16): one cp.reduce.async.bulk in the calling thread's bulk async-group
    (commit and wait as for TMA stores)."""
    _bulk_s2g(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        gmem_ptr, smem_ptr, nbytes, loc, ip,
    )  # fmt: skip


@dsl_user_op
def bulk_store_f32(gmem_ptr, smem_ptr, nbytes: int, *, loc=None, ip=None):
    """gmem[:n] = smem[:n], as `bulk_reduce_add_f32` but a plain copy (cp.async.bulk)."""
    _bulk_s2g(
        "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", gmem_ptr, smem_ptr, nbytes, loc, ip
    )


@cute.jit
def pinned_wait_group(p: Float32):
    """wait_group(0) that ptxas keeps after `p` is computed: both arms of a branch on p wait.

    Left to itself, ptxas (CUDA 13) hoists a wait_group above the arithmetic that does not
    depend on the GEMMs waited for. The branch is warp-uniform (lane 0's value), so it costs a
    shuffle, a compare and a branch; 0x7FC00001 is a NaN bit pattern exp2 does not produce, but
    either way the wait happens.
    """
    key = cute.arch.make_warp_uniform(as_int32(p))
    if key != Int32(0x7FC00001):
        warpgroup.wait_group(0)
    else:
        warpgroup.wait_group(0)


@dsl_user_op
def pack_f32x2(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None) -> Int32:
    """Two fp32 values -> one register of fp16x2/bf16x2 (round to nearest even), `lo` in bits 0-15."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    packed = llvm.inline_asm(
        T.i32(),
        [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $2, $1;",  # cvt.rn.*x2 puts its first source in the upper half
        "=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(packed)


@cute.jit
def convert(src: cute.Tensor, dst: cute.Tensor):
    """fp32 register tensor -> fp16/bf16 tensor of the same compact layout, two values per instruction.

    `dst.store(src.load().to(dtype))` packs fp16 pairs but, for bf16, converts many values one at a
    time and merges them with PRMT (60 extra instructions per 64x80 tile at d256, and a spill).
    """
    dst_words = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst_words)):
        dst_words[i] = pack_f32x2(src[2 * i], src[2 * i + 1], dst.element_type)


def tma_load(atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, mbar: cute.Pointer, nbytes: int):
    """A TMA load (whole warp) into `dst` whose bytes `mbar` expects (one elected thread arms it)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, nbytes)
    cute.copy(atom, src, dst, tma_bar_ptr=mbar)


def stmatrix_copy(dtype, tiled_mma: cute.TiledMma, thread: Int32):
    """Thread `thread`'s slice of a registers -> smem stmatrix copy of `tiled_mma`'s accumulator."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    return cute.make_tiled_copy_C(atom, tiled_mma).get_slice(thread)
