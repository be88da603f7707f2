"""Backward pass for head dims past 128: (256, 256), and DeepSeek's (192, 128) (q, k's and v's);
the others in (128, 256] run one of them on zero-padded copies.

The second version's kernel (`sm90_bwd_ws`: a producer warp, two consumer warpgroups, the same
preprocess, dQ reduce-add, deterministic turns, masks, softcap and varlen) cannot hold these head
dims: there each consumer warpgroup keeps dK and dV of 64 keys x d in registers (WGMMA's M is 64
rows per warpgroup), 256 fp32 values per thread at d256. Here the GEMMs that make dK and dV are
turned around so that d is their M (FlashAttention-3's dKV_swapAB, FA4's configurations at these
head dims), and a CTA owns tile_n keys (`SHAPES`: 64 at d256, 96 at 192/128):

    S    = Q_m K^T          SS-WGMMA, M = 64 queries, N = tile_n keys, a warpgroup per half of them
    dP   = dO_m V^T         the same
    P, dS in registers      rows are queries here: a thread's LSE and D are those of its two rows
    P, dS -> sP, sdS        4-byte stores; both warpgroups' columns, then a named barrier
    dV^T += dO_m^T P        SS-WGMMA, M = dv or d, N = keys, K = 64 queries; A and B both MN-major
    dK^T += Q_m^T dS        views of the row-major buffers. The warpgroups split them by d (64-row
                            blocks alternating: d256, 64 keys, 64 values each a thread) or by keys
                            (half each: 192/128, 96 keys, dK^T 72 and dV^T 48 values a thread)
    dQ_m[:, half w] = dS K[:, half w]
                            SS-WGMMA, M = 64 queries, N = d / 2 (warpgroup w's half of d), K =
                            tile_n keys; staged and added into dQacc by one TMA reduce-add per
                            warpgroup, as `sm90_bwd_ws` at tile_m 64

Shared memory: d256 K, V 32 KB each, Q one stage and dO one (32 KB each), sP and sdS one buffer
each (8 KB each), the dQ staging 64 KB: 214.5 KB of 227 (at 48 keys, until v41: K, V 24 KB, Q two
stages, sP and sdS 6 KB: 222 KB); 192/128 K 36, V 24, Q 48, dO two stages 32,
sP, sdS 12 each, dQ 48: 214 KB (K's swizzle atoms 32 columns wide there, `smem_layouts`). With one
sP/sdS buffer, a warpgroup writes block m + 1's P and dS only after both warpgroups' GEMMs of block
m have read them (`BARRIER_PDS_FREE`).

dK and dV leave from registers (the accumulators' (d, key) pairs: 2-byte stores in the inputs'
type with MHA, fp32 per q head otherwise, which the host sums per kv head); no atomic GQA sums.
Deterministic: the turns and dQ's adds by `sm90_bwd_ws`'s writer warp (`dq_writer`, since session
27), along the rotated walk only with `sm90_bwd.WIDE_ROTATE` (session 28, not yet run). Everything
else (arguments, layouts, host side) is `sm90_bwd_ws`'s,
with v, dO and dV of head dim head_dim_v.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from .mask import Mask
from .sm90_bwd_ws import (
    BARRIER_DS,
    BARRIER_PDS_FREE,
    NUM_MMA_THREADS,
    TILE_M,
    WARPGROUP,
    BwdWsSm90,
)
from .sm90_common import LOG2_E, acc_mn_layout, convert, gemm, smem_layout


@dataclass(frozen=True)
class Shape:
    """A (head_dim, head_dim_v) kernel's tiling: keys per CTA, dO stages, how the consumer
    warpgroups split dK^T and dV^T: "d" (64-row blocks of d alternating) or "keys" (half each), Q
    stages, and the order of a block's last three GEMMs: dV^T, dQ, dK^T ("vqk": dO's stage goes
    back first, Q's at the block's end), dK^T, dQ, dV^T ("kqv": Q's first, for one Q stage), or
    dK^T, dV^T, dQ ("kvq": both back before dQ is staged, which then waits for its GEMM)."""

    tile_n: int
    do_stages: int
    dkv_split: str
    q_stages: int = 2
    order: str = "vqk"


# d256: 64 keys a CTA (FA4's sm90 takes 48): a quarter fewer dQ reduce-adds than 48, which bound
# it on the H100 (v39's ncu). With 64 KB of dQ staging only one Q stage fits (214.5 KB), so the
# block's GEMMs run dK^T, dV^T, dQ and give both stages back before dQ is staged (v41, H100: 321 ->
# 404 TFLOP/s non-causal, 298 -> 375 causal; "kqv" 286 and "vqk" 280 lost). v42 (H100): 48 keys in
# "kvq" ran 328 against 320 in "vqk", so the tile makes the gain once "kvq" hides its single Q
# stage. (192, 128): FA4's; "kvq" there lost (438 against 446, v42). Both measured variants are in
# git at 1c35ee0.
SHAPES = {(256, 256): Shape(64, 1, "d", q_stages=1, order="kvq"), (192, 128): Shape(96, 2, "keys")}
SHAPES_D256_48 = {**SHAPES, (256, 256): Shape(48, 1, "d")}  # (the default until v41)


# The 16-bit K-major swizzle atoms by their width in columns.
_ATOMS = {
    64: warpgroup.SmemLayoutAtomKind.K_SW128,
    32: warpgroup.SmemLayoutAtomKind.K_SW64,
    16: warpgroup.SmemLayoutAtomKind.K_SW32,
    8: warpgroup.SmemLayoutAtomKind.K_INTER,
}


def row_major_layout(dtype, rows: int, cols: int, width: int):
    """A (rows, cols) row-major 16-bit buffer of `width`-column swizzle atoms (8: unswizzled)."""
    atom = warpgroup.make_smem_layout_atom(_ATOMS[width], dtype)
    return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))


class BwdWideSm90(BwdWsSm90):
    """Compile-time configuration of the backward kernel for the head dims of `SHAPES`; `__call__`
    takes `sm90_bwd.BwdSm90.__call__`'s arguments (q, k, dQacc, dK of head_dim; v, dO, dV of
    head_dim_v)."""

    p_in_smem = True

    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: int,
        causal: bool,
        deterministic: bool = False,
        window_left: bool = False,
        window_right: bool = False,
        softcap: bool = False,
        varlen: bool = False,
        dq_unscaled: bool = False,
        dq_writer: bool = False,
        rotate: bool = False,
        dq_chains: int = 1,
        dq_writer_warps: int = 1,
        dq_fragments: bool = False,
        multicast: bool = False,
    ):
        assert (head_dim, head_dim_v) in SHAPES, f"the wide backward kernel takes {list(SHAPES)}"
        assert not (causal and window_right), "causal is the right limit 0"
        shape = SHAPES[head_dim, head_dim_v]
        self.tile_n = shape.tile_n
        self.do_stages = shape.do_stages
        self.dkv_by_keys = shape.dkv_split == "keys"
        self.q_stages = shape.q_stages
        assert sorted(shape.order) == ["k", "q", "v"], shape.order
        self.order = shape.order
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.deterministic = deterministic
        self.dkv_atomic = False
        self.window_left = window_left
        self.window_right = window_right
        self.softcap = softcap
        self.varlen = varlen
        self.tile_m = TILE_M
        self.dq_unscaled = dq_unscaled
        # dQ as `sm90_bwd_ws` at tile_m 64: warpgroup w adds columns [d/2 w, d/2 (w + 1)) of a block;
        # with dq_fragments (`sm90_bwd.DQ_FRAGMENTS_WIDE`, varlen: `VARLEN_DQ_FRAGMENTS`) staged in the
        # accumulator's order and added by one 1-D bulk reduce-add onto the warpgroup's half of the
        # block's fragments.
        self.dq_fragments = dq_fragments
        self.dq_by_rows = False
        self.dq_swapped = False
        self.dq_tile = (TILE_M, head_dim // 2)
        self.dq_mma_tile = self.dq_tile
        self.rows_stride = TILE_M
        self.mask = Mask(TILE_M, self.tile_n, causal, window_left, window_right)
        self.descending = causal or window_right
        # Without causal or window (deterministic: with a head's key blocks resident at once; not:
        # `sm90_bwd.PLAIN_ROTATE`): the rotated walk (and turns) of `sm90_bwd_ws` (`walk`,
        # `walk_block`, `turn`; `sm90_bwd.rotates`).
        assert not rotate or not (causal or window_left or window_right), "rotate: no causal or window"
        self.rotate = rotate
        self.dkv_tma = False
        # dQ's adds (deterministic: and the turns) by the producer warpgroup's second warp, as
        # `sm90_bwd_ws` (`write_dq`, along the same walk; `sm90_bwd.DQ_WRITER_WARP`,
        # `DQ_WRITER_PLAIN_WIDE`).
        self.dq_writer = dq_writer
        self.set_dq_writer(dq_chains, dq_writer_warps)
        self.set_pairs(multicast)  # (Q and dO shared by CTA pairs: `sm90_bwd.QDO_MULTICAST`)

    # ---------------------------------------------------------------- host side
    def _tiled_mmas(self):
        K, MN = OperandMajorMode.K, OperandMajorMode.MN

        def mma(a_major, b_major, atoms, tile):
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, a_major, b_major, Float32, atom_layout_mnk=atoms, tiler_mn=tile
            )

        tile_n = self.tile_n
        return (
            # S = Q K^T, dP = dO V^T: M = 64 queries, N = tile_n keys as two halves (a warpgroup
            # each), K = d or dv; both K-major.
            mma(K, K, (1, 2, 1), (TILE_M, tile_n // 2)),
            # dV^T += dO^T P, dK^T += Q^T dS: M = dv or d, N = tile_n keys, K = 64 queries; A =
            # dO^T or Q^T, B = P^T or dS^T: views of row-major buffers, MN-major. The warpgroups
            # take half the keys each, or 64-row blocks of d in turn.
            mma(MN, MN, *(((1, 2, 1), (64, tile_n // 2)) if self.dkv_by_keys else ((2, 1, 1), (64, tile_n)))),
            # dQ = dS K: M = 64 queries, N = d as two halves, K = tile_n keys; A = dS K-major,
            # B = K^T MN-major.
            mma(K, MN, (1, 2, 1), self.dq_tile),
        )

    def smem_layouts(self):
        """`BwdWsSm90.smem_layouts` for this kernel: K in swizzle atoms no wider than half of d (dQ's
        B operand, K^T, splits d between the warpgroups, and an MN-major operand cannot start
        inside an atom: d192 takes 32 columns); Q two stages, dO `do_stages`; P and dS (queries x
        keys, one buffer each) in unswizzled 8 x 8 atoms (a warpgroup's 24 or 48 columns are whole
        atoms; a 16- or 32-column swizzle atom splits them, and no copy partitions that)."""
        d, dv, tile_n = self.head_dim, self.head_dim_v, self.tile_n
        kv = row_major_layout(self.dtype, tile_n, d, max(w for w in (8, 16, 32, 64) if (d // 2) % w == 0))
        v = smem_layout(self.dtype, tile_n, dv)
        q = smem_layout(self.dtype, TILE_M, d, self.q_stages)
        do = smem_layout(self.dtype, TILE_M, dv, self.do_stages)
        ps = row_major_layout(self.dtype, TILE_M, tile_n, 8)
        dq = smem_layout(Float32, *self.dq_tile, 2)
        return kv, v, q, do, ps, dq

    # ---------------------------------------------------------------- consumers
    @cute.jit
    def consumer(
        self, tidx, sQ, sdO, sK, sV, sPdS, sLSE, sD, sdQ, mbar_KV, pipes, tiled_mma_s, tiled_mma_kv,
        tiled_mma_dq, tma_atom_dQ, mdQacc, tma_atom_dK, mdK, tma_atom_dV, mdV, mSem, softmax_scale, softcap,
        mask, seqlen, n_block, head, head_kv, batch, m_min, m_max, walk,
    ):  # fmt: skip
        """Both consumer warpgroups (tidx 0..255): the query blocks [m_min, m_max), then dK, dV."""
        d, dv, tile_n = self.head_dim, self.head_dim_v, self.tile_n
        sP, sdS = sPdS
        pipe_q, pipe_do = pipes
        scale_log2 = softmax_scale * LOG2_E
        softcap_scale = None
        if const_expr(self.softcap):
            scale_log2 = softcap * LOG2_E
            softcap_scale = softmax_scale / softcap
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        n0 = n_block * tile_n

        # Transposed views: Q^T (d, 64 queries, stages), dO^T (dv, ...); P^T, dS^T (tile_n keys,
        # 64 queries); K^T (d, tile_n keys).
        sQt = cute.composition(sQ, cute.make_ordered_layout((d, TILE_M, self.q_stages), order=(1, 0, 2)))
        sdOt = cute.composition(sdO, cute.make_ordered_layout((dv, TILE_M, self.do_stages), order=(1, 0, 2)))
        keys_q = cute.make_ordered_layout((tile_n, TILE_M), order=(1, 0))
        sPt, sdSt = cute.composition(sP, keys_q), cute.composition(sdS, keys_q)
        sKt = cute.composition(sK, cute.make_ordered_layout((d, tile_n), order=(1, 0)))

        wg_s, wg_kv, wg_dq = (m.get_slice(wg * WARPGROUP) for m in (tiled_mma_s, tiled_mma_kv, tiled_mma_dq))
        thr_s, thr_kv, thr_dq = (m.get_slice(tidx) for m in (tiled_mma_s, tiled_mma_kv, tiled_mma_dq))
        tSrQ = wg_s.make_fragment_A(wg_s.partition_A(sQ))
        tSrK = wg_s.make_fragment_B(wg_s.partition_B(sK))
        tPrdO = wg_s.make_fragment_A(wg_s.partition_A(sdO))
        tPrV = wg_s.make_fragment_B(wg_s.partition_B(sV))
        tVrdOt = wg_kv.make_fragment_A(wg_kv.partition_A(sdOt))
        tVrP = wg_kv.make_fragment_B(wg_kv.partition_B(sPt))
        tKrQt = wg_kv.make_fragment_A(wg_kv.partition_A(sQt))
        tKrdS = wg_kv.make_fragment_B(wg_kv.partition_B(sdSt))
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))

        acc_shape_S = thr_s.partition_shape_C((TILE_M, tile_n))
        acc_dV = thr_kv.make_fragment_C(thr_kv.partition_shape_C((dv, tile_n)))
        acc_dK = thr_kv.make_fragment_C(thr_kv.partition_shape_C((d, tile_n)))
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # This thread's (query, key) coordinates in an S tile, as rows and columns.
        cS = thr_s.partition_C(cute.make_identity_tensor((TILE_M, tile_n)))
        tScS = cute.make_tensor(cS.iterator, acc_mn_layout(cS.layout))
        # A thread's column pairs, one 4-byte store each (stmatrix does not partition 24-column halves).
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        smem_copy = cute.make_tiled_copy_C(store_atom, tiled_mma_s).get_slice(tidx)
        tPsP, tPsdS = smem_copy.partition_D(sP), smem_copy.partition_D(sdS)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        cute.arch.mbarrier_wait(mbar_KV, 0)
        held = Int32(-1)  # deterministic: the query block whose turn this CTA still holds
        for i in cutlass.range(m_min, m_max, unroll=1):
            m_block = self.walk_block(i, m_min, m_max, walk)
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
            pipe_q.consumer_wait(q_state)
            gemm(tiled_mma_s, acc_S, tSrQ[None, None, None, q_state.index], tSrK, zero_init=True, wg_wait=-1)
            pipe_do.consumer_wait(do_state)
            gemm(
                tiled_mma_s, acc_dP, tPrdO[None, None, None, do_state.index], tPrV, zero_init=True, wg_wait=-1
            )
            if const_expr(self.deterministic and not self.dq_writer):
                if held >= 0:
                    self.release_turn(mSem, held, head, batch, tidx)
            masked = mask.tile_needs_mask(m_block, n_block, seqlen)
            warpgroup.wait_group(1)  # S done; dP may still run
            self.row_gradients(
                acc_S, acc_dP, tScS, sLSE, q_state.index, sD, do_state.index, mask, seqlen, m_block, n0,
                scale_log2, softcap_scale, masked,
            )  # fmt: skip
            rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
            convert(acc_S, rP)
            rdS = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
            convert(acc_dP, rdS)
            # The previous block's GEMMs (both warpgroups', each waited for below) have read sP and
            # sdS; then both warpgroups' columns before either GEMM reads them.
            cute.arch.barrier(barrier_id=BARRIER_PDS_FREE, number_of_threads=NUM_MMA_THREADS)
            cute.copy(smem_copy, smem_copy.retile(rP), tPsP)
            cute.copy(smem_copy, smem_copy.retile(rdS), tPsdS)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BARRIER_DS, number_of_threads=NUM_MMA_THREADS)

            # The three GEMMs in `Shape.order` (three commit groups; "vqk": dV^T, dQ, dK^T). After
            # wait_group(1) the first two are done: a stage whose reader ("v": dO's, "k": Q's) is
            # among them goes back to the producer. The third runs on while dQ is staged and its
            # reduce-add issued, unless it is dQ's own GEMM, which staging waits for.
            acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((TILE_M, d)))
            gemms = {
                "v": (tiled_mma_kv, acc_dV, tVrdOt[None, None, None, do_state.index], tVrP),
                "k": (tiled_mma_kv, acc_dK, tKrQt[None, None, None, q_state.index], tKrdS),
                "q": (tiled_mma_dq, acc_dQ, tQrdS, tQrKt),
            }
            for j in cutlass.range_constexpr(3):
                name = self.order[j]
                gemm(*gemms[name], zero_init=name == "q", wg_wait=1 if j == 2 else -1)
            if const_expr("k" in self.order[:2]):
                pipe_q.consumer_release(q_state)  # S and dK^T, Q's readers, are done
                q_state.advance()
            if const_expr("v" in self.order[:2]):
                pipe_do.consumer_release(do_state)  # dP and dV^T, dO's readers, are done
                do_state.advance()
            if const_expr(self.order[2] == "q"):
                warpgroup.wait_group(0)

            self.stage_dq(acc_dQ, sdQ, softmax_scale, tidx, i > m_min, (i - m_min) % 2 == 1)
            held = self.add_dq_at_turn(
                sdQ, tma_atom_dQ, mdQacc, mSem, mask, seqlen, m_block, n_block, head, batch, m_min, walk,
                held, tidx,
            )  # fmt: skip
            if const_expr(self.order[2] == "k"):
                warpgroup.wait_group(0)  # dK^T done: Q's stage goes back
                pipe_q.consumer_release(q_state)
                q_state.advance()
            if const_expr(self.order[2] == "v"):
                warpgroup.wait_group(0)  # dV^T done: dO's stage goes back
                pipe_do.consumer_release(do_state)
                do_state.advance()

        if const_expr(self.deterministic and not self.dq_writer):
            if held >= 0:
                self.release_turn(mSem, held, head, batch, tidx)
        if const_expr(not self.dq_writer):  # (else the writer warp waits for its own)
            if tidx % WARPGROUP < 32:  # the last reduce-add has read its buffer
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.store_dkdv_t(acc_dK, acc_dV, thr_kv, mdK, mdV, softmax_scale, n0, head, batch, seqlen)

    @cute.jit
    def row_gradients(
        self, acc_S, acc_dP, tScS, sLSE, q_stage, sD, do_stage, mask, seqlen, m_block, n0, scale_log2,
        softcap_scale, masked,
    ):  # fmt: skip
        """P and dS in place of S and dP (rows are queries, columns keys; waits for dP): P =
        exp2(S scale log2 e - LSE log2 e), or with softcap T = tanh(S scale / cap) and P =
        exp2(T cap log2 e - LSE log2 e); 0 where masked (`masked`: the tile holds a key some row
        does not see). dS = P (dP - D), times 1 - T^2 with softcap. A thread's rows' LSE log2 e and
        D come from shared memory (+inf and 0 past the end: P = 0 there)."""
        acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        acc_dP_mn = cute.make_tensor(acc_dP.iterator, acc_mn_layout(acc_dP.layout))
        rows = cute.size(acc_S_mn, mode=[0])
        cols = cute.size(acc_S_mn, mode=[1])
        tanh_mn = None
        if const_expr(self.softcap):  # T kept for dS: 12 registers a thread at 24 columns
            rT = cute.make_rmem_tensor(acc_S.layout, Float32)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                rT[i] = cute.math.tanh(acc_S[i] * softcap_scale, approx=True)
                acc_S[i] = rT[i]
            tanh_mn = cute.make_tensor(rT.iterator, acc_mn_layout(rT.layout))
        for r in cutlass.range_constexpr(rows):
            row = tScS[r, 0][0]
            lse_log2 = sLSE[row, q_stage]
            for c in cutlass.range_constexpr(cols):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - lse_log2, fastmath=True)
            if masked:
                start, limit = mask.key_bounds(m_block * TILE_M + row, seqlen)
                for c in cutlass.range_constexpr(cols):
                    key = n0 + tScS[r, c][1]
                    if const_expr(self.window_left):
                        if key >= limit or key < start:
                            acc_S_mn[r, c] = Float32(0.0)
                    elif key >= limit:
                        acc_S_mn[r, c] = Float32(0.0)
        warpgroup.wait_group(0)  # dP done
        for r in cutlass.range_constexpr(rows):
            dsum = sD[tScS[r, 0][0], do_stage]
            for c in cutlass.range_constexpr(cols):
                ds = acc_S_mn[r, c] * (acc_dP_mn[r, c] - dsum)
                if const_expr(self.softcap):
                    t = tanh_mn[r, c]
                    ds = ds * (1.0 - t * t)
                acc_dP_mn[r, c] = ds

    @cute.jit
    def store_dkdv_t(self, acc_dKt, acc_dVt, thr_kv, mdK, mdV, scale, n0, head, batch, seqlen):
        """dK * scale and dV of this CTA's keys from the transposed accumulators dK^T (d, keys) and
        dV^T (dv, keys), keys inside the sequence: in mdK's type (the inputs' with MHA, fp32 per q
        head otherwise) at q head `head`."""
        seqlen_k = seqlen.seqlen_k
        if const_expr(self.varlen):
            # Offsets the host could not check (graph capture) are cut at the packed tensor's ends.
            seqlen_k = cutlass.min(seqlen_k, mdK.shape[0] - seqlen.offset_k)
            if seqlen.offset_k < 0:
                seqlen_k = Int32(0)
        parts = ((acc_dKt, mdK, self.head_dim, scale), (acc_dVt, mdV, self.head_dim_v, None))
        for acc, mX, dim, factor in parts:
            c = thr_kv.partition_C(cute.make_identity_tensor((dim, self.tile_n)))
            gX = seqlen.rows(mX, head, batch, seqlen.offset_k)
            for i in cutlass.range_constexpr(cute.size(acc)):
                col, key = c[i][0], n0 + c[i][1]
                if key < seqlen_k:
                    value = acc[i] if const_expr(factor is None) else acc[i] * factor
                    gX[key, col] = value.to(mX.element_type)
