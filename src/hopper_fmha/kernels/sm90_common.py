"""Pieces both SM90 kernels use: accumulator layout views, the WGMMA issue helper, constants."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """Row/column view of an SM90 accumulator: ((2,2,V),MMA_M,MMA_N) -> ((2,MMA_M),(2,V,MMA_N)).

    In the WGMMA accumulator a thread owns, per 64-row MMA block, rows r and r+8 (mode 0[1])
    and column pairs spaced 8 apart (modes 0[0] and 0[2]).
    """
    flat = cute.make_layout(acc_layout.shape)
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


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wg_wait: cutlass.Constexpr[int] = 0,
):
    """Issue one warpgroup GEMM over all K blocks as one commit group; wait_group(wg_wait) if >= 0."""
    warpgroup.fence()
    # A fresh atom per call: ACCUMULATE is mutated below, which must not leak across loop regions.
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        mma_atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)
