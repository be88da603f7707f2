"""The backward kernels' host side (`kernels.sm90_bwd.backward`) on CPU: the compiled kernels are
replaced by recording stand-ins that check each launch against the kernel's `__call__` (argument
count, dtypes, shapes, the views of a chunked launch) and compute their part densely, so the host's
allocation, GQA reduction, MHA shortcut and chunking past the 65535 grid limit are checked against
torch's autograd of the reference without a GPU (the kernels: tests/test_gpu_backward.py)."""

import inspect
import math

import pytest
import torch

from hopper_fmha.emulate_bwd import dq_order
from hopper_fmha.reference import reference, visible_keys

pytestmark = pytest.mark.cpu

sm90_bwd = pytest.importorskip("hopper_fmha.kernels.sm90_bwd")  # needs the CuTe DSL
from tvm_ffi_binding import assert_binds  # noqa: E402

from hopper_fmha.kernels import bwd_preprocess, sm90_bwd_ws  # noqa: E402
from hopper_fmha.kernels.sm90_bwd_ws import BwdWsSm90  # noqa: E402

# v2's query tile at d64 (without softcap), as the host picks it.
T64 = sm90_bwd.query_tile(2, 64)


def fragment_index(rows: int, tile: int = 80, d: int = 128):
    """Where the kernel puts dQ in the fragment-ordered dQacc (`sm90_bwd.DQ_FRAGMENTS`), derived
    from the kernel's side: for each (row, column) of one head's (rows, d) buffer, the flat index
    into that buffer. Block m, warpgroup wg, thread 32 warp + lane, accumulator value
    4 j + 2 h2 + e sits at m tile d + wg tile d / 2 + 512 j + 4 thread + 2 h2 + e, and SM90's
    accumulator puts that value at its GEMM's row 16 warp + 8 h2 + lane // 4 and column
    8 j + 2 (lane % 4) + e. The GEMM per warpgroup: tile 80, dQ^T's rows d [64 wg, 64 wg + 64),
    columns the block's queries; tile 128, dQ's rows [64 wg, 64 wg + 64) of the block; tile 64,
    dQ's columns [d / 2 wg, d / 2 (wg + 1))."""
    q = torch.arange(rows)[:, None]
    col = torch.arange(d)[None, :]
    m, qq = q // tile, q % tile
    if tile == 80:  # GEMM rows are d, columns queries
        wg, grow, gcol = col // 64, col % 64, qq
    elif tile == 128:  # rows queries, a warpgroup per 64 of them
        wg, grow, gcol = qq // 64, qq % 64, col
    else:  # rows queries, a warpgroup per half of d
        wg, grow, gcol = col // (d // 2), qq, col % (d // 2)
    warp, h2, lq = grow // 16, (grow % 16) // 8, grow % 8
    j, lr, e = gcol // 8, (gcol % 8) // 2, gcol % 2
    thread = 32 * warp + 4 * lq + lr
    return m * tile * d + wg * (tile * d // 2) + 512 * j + 4 * thread + 2 * h2 + e


def add_fragments(dq_acc, part, tile: int):
    """dQacc += part as the fragment-ordered kernel adds it: dq_acc is the (b, s_q, h, d) view the
    host passes, of a (b, h, blocks * tile, d) buffer (`sm90_bwd.backward`)."""
    b, sq, h, d = dq_acc.shape
    rows = -(-sq // tile) * tile
    buf = dq_acc.as_strided((b, h, rows * d), (dq_acc.stride(0), dq_acc.stride(2), 1))
    index = fragment_index(rows, tile, d)[:sq].reshape(-1)
    for bi in range(b):
        for hi in range(h):
            buf[bi, hi].index_add_(0, index, part[bi, :, hi].reshape(-1).to(buf.dtype))


def unfragment_by_map(acc, b: int, h: int, tile_m: int, head_dim: int):
    """`dq_unfragment`'s kernel as its own map says (`unit_place`, `value_offset`): the fp32
    accumulator (b, h, blocks * tile_m, head_dim) in fragment order -> (b, blocks * tile_m, h,
    head_dim) in order, for the kernel's torch stand-ins."""
    from hopper_fmha.kernels import dq_unfragment

    per_block = tile_m * head_dim // 4
    places = [dq_unfragment.unit_place(u, tile_m, head_dim) for u in range(per_block)]
    rows = torch.tensor([r for _, r, _ in places])
    cols = torch.tensor([c for _, _, c in places])
    units = acc.view(b, h, -1, per_block, 2, 2)  # (b, h, block, unit, h2, e)
    blocks = units.shape[2]
    full = torch.zeros(b, blocks * tile_m, h, head_dim)
    for h2 in range(2):
        for e in range(2):
            dr, dc = dq_unfragment.value_offset(h2, e, tile_m)
            r = (torch.arange(blocks)[:, None] * tile_m + rows + dr).reshape(-1)
            full[:, r, :, (cols + dc).repeat(blocks)] = (
                units[..., h2, e].reshape(b, h, -1).permute(2, 0, 1)  # (the indexed mode first)
            )
    return full


def dense_kernel(
    launches,
    atomic: bool,
    causal: bool,
    window_sides=(False, False),
    softcap_on=False,
    dq_unscaled=False,
    dq_fragments=False,
    tile_m=64,
    dq_chains=1,
    stored=False,
    block_keys=128,
    laps=False,
):
    """A stand-in for a compiled backward kernel: the same 18 arguments, its part of the work
    done densely in float64 (P from LSE log2 e, dS with the given D, both padded to 64-row blocks;
    the mask and softcap the compile key names, their sizes from the launch), written where the
    kernel writes; dQacc without the softmax scale where the key says so (`DQ_SCALE_AT_CAST`), in
    fragment order where it says so (`DQ_FRAGMENTS`); with `DQ_CHAINS` k > 1, dQacc holds k copies of
    the padded rows, and key block n's part at query block m (`block_keys`: the kernel's keys per
    CTA, 128, or the wide kernel's 48 or 96) goes to copy turn % k, the pair's turn at the block
    as the kernel numbers them (`laps`, `sm90_bwd_ws.DQ_LAPS`: to its lap's copy,
    `sm90_bwd_ws.lap_of`). stored
    (`sm90_bwd_ws.store_first`): each query block of a copy that one of the copy's key blocks
    visits (causal and windows: by the forward's block range) is written whole (its padded rows
    too) before the adds, as the kernel's first turn stores; others are left as they were."""

    def run(
        q, k, v, dout, lse2, delta, dq_acc, dk, dv, sem, scale, group, left, right, softcap, cu_q, cu_k, max_k
    ):
        window = (left, right)
        launches.append(
            dict(q=q, dk=dk, sem=sem, group=group, lse2=lse2, delta=delta, window=window, softcap=softcap)
        )
        if dq_fragments:  # the rows of one head's buffer behind the (b, s_q, h, d) view
            launches[-1]["dq_rows"] = dq_acc.stride(2) // dq_acc.shape[3]
        pad = -(-q.shape[1] // tile_m) * tile_m
        if dq_chains > 1:
            launches[-1]["dq_acc_rows"] = dq_acc.shape[1]
            assert dq_acc.shape[1] == dq_chains * pad and sem.shape[-1] == dq_chains * pad // tile_m
        assert lse2.shape[-1] % 64 == 0 and lse2.shape == delta.shape and lse2.shape[-1] >= q.shape[1]
        assert (left >= 0, right >= 0) == window_sides and bool(softcap) == softcap_on
        assert cu_q is None and cu_k is None  # dense
        lse2, delta = lse2[..., : q.shape[1]], delta[..., : q.shape[1]]
        # q head h of the part reads kv head h // group, as the kernel maps them (a part may hold
        # a slice of one group: all its q heads then read its one kv head).
        kv_of = torch.arange(q.shape[2]) // group
        kk, vv = (t.double()[:, :, kv_of] for t in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
        dtanh = 1.0
        if softcap_on:
            t = torch.tanh(s / softcap)
            s, dtanh = softcap * t, 1 - t * t
        right_ = 0 if causal else right
        seen = visible_keys(torch.arange(q.shape[1]), q.shape[1], k.shape[1], left, right_)
        p = torch.where(seen, torch.exp2(s * math.log2(math.e) - lse2.double()[..., None]), 0.0)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout.double(), vv)
        ds = p * (dp - delta.double()[..., None]) * dtanh
        num_n, blocks = -(-k.shape[1] // block_keys), pad // tile_m
        # The copy of each (query block, key block) pair: the pair's turn % k, in the emulator's
        # turn order (`emulate_bwd.dq_order`, the kernel's `dq_turn` but for the rotated walk,
        # whose turns are only reordered; `laps`: the key block's lap).
        sq, sk = q.shape[1], k.shape[1]
        orders = [dq_order(m, tile_m, block_keys, sq, sk, left, right_) for m in range(blocks)]
        copy_of = torch.zeros(blocks, num_n, dtype=torch.long)
        for m, order in enumerate(orders):
            for turn, n in enumerate(order):
                copy_of[m, n] = n // -(-num_n // dq_chains) if laps else turn % dq_chains
        pair = copy_of[torch.arange(q.shape[1]) // tile_m][:, torch.arange(k.shape[1]) // block_keys]
        for c in range(dq_chains):
            dq_part = torch.einsum("bhqk,bkhd->bqhd", ds * (pair == c), kk) * (1.0 if dq_unscaled else scale)
            copy = dq_acc[:, c * pad : c * pad + q.shape[1]]
            for m, order in enumerate(orders if stored else ()):  # the first turn's store: the
                # block's padded rows, where one of the key blocks its rows see adds into this copy
                if not any(copy_of[m, n] == c for n in order):
                    continue
                if dq_fragments:
                    rows = (copy.shape[0], copy.shape[2], tile_m * q.shape[3])
                    at = copy.storage_offset() + m * tile_m * q.shape[3]
                    copy.as_strided(rows, (*copy.stride()[::2], 1), at).zero_()
                else:
                    end = c * pad + (m + 1) * tile_m if dq_chains > 1 else min((m + 1) * tile_m, q.shape[1])
                    dq_acc[:, c * pad + m * tile_m : end].zero_()
            if dq_fragments:
                add_fragments(copy, dq_part.float(), tile_m)
            else:
                copy += dq_part.float()
        dk_heads = torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale
        dv_heads = torch.einsum("bhqk,bqhd->bkhd", p, dout.double())
        if not atomic:  # per q head (or MHA): stored
            dk.copy_(dk_heads)
            dv.copy_(dv_heads)
        else:  # per kv head (dkv_atomic): each q head of a group added
            dk.index_add_(2, kv_of, dk_heads.float())
            dv.index_add_(2, kv_of, dv_heads.float())

    return run


def binding_checked(key, kernel):
    """`kernel` behind the checks TVM-FFI makes at a compiled kernel's call (`tvm_ffi_binding`),
    against `fake_arguments` of the compile key."""
    copies = key[17] > 1  # (`DQ_CHAINS`: dQacc's rows their own size)
    fake = sm90_bwd.fake_arguments(
        sm90_bwd._DTYPES[key[0]], key[1], key[3], key[5], key[6], key[10], key[15], copies
    )

    def run(*args):
        assert_binds(fake[:-1], args, str(key))  # (the stream is TVM-FFI's current one)
        return kernel(*args)

    return run


def stub_preprocess(monkeypatch):
    """`bwd_preprocess`'s kernel (D, LSE log2 e; the dense and, since session 27, the varlen host
    call it) in torch on the CPU."""
    monkeypatch.setattr(bwd_preprocess, "_compiled", {})

    def compile_preprocess(dtype_name, dv, with_dlse):
        def run(out, dout, lse, dlse, delta, lse2):
            # bwd_preprocess's contract: padded rows 0 and +inf, +inf for a row without keys.
            assert (dlse is not None) == with_dlse and delta.dtype == lse2.dtype == torch.float32
            sq = out.shape[1]
            d = (out.double() * dout.double()).sum(-1).transpose(1, 2)
            delta.zero_()
            delta[..., :sq] = d - dlse if dlse is not None else d
            lse2.fill_(math.inf)
            lse2[..., :sq] = torch.where(lse == -math.inf, math.inf, lse * math.log2(math.e))

        return run

    monkeypatch.setattr(bwd_preprocess, "compile_preprocess", compile_preprocess)


@pytest.fixture
def kernels(monkeypatch):
    launches = []
    monkeypatch.setattr(sm90_bwd, "_compiled", {})
    keys = []

    def compile_bwd(*key):
        keys.append(key)
        # (dtype, d, causal, deterministic, version, mha, dkv_atomic, left, right, softcap, varlen,
        # tile_m, rotate, dq_unscaled, dq_fragments, dv, dq_writer, dq_chains, dq_writer_warps)
        assert key[10] is False
        stored = sm90_bwd_ws.store_first(key[3], key[16], key[2] or any(key[7:9]), key[10])
        laps = sm90_bwd_ws.DQ_LAPS and key[12] and key[17] > 1  # (the kernel's `laps`)
        kernel = dense_kernel(
            launches, key[6], key[2], key[7:9], key[9], *key[13:15], tile_m=key[11], dq_chains=key[17],
            stored=stored, block_keys=sm90_bwd.keys_per_cta(key[1], key[15]), laps=laps,
        )  # fmt: skip
        return binding_checked(key, kernel)

    monkeypatch.setattr(sm90_bwd, "compile_bwd", compile_bwd)
    # dQ's un-permute by torch on these CPU tensors (`test_dq_unfragment_kernel_host` stands in for
    # `DQ_UNFRAGMENT_KERNEL`'s kernel)
    monkeypatch.setattr(sm90_bwd, "DQ_UNFRAGMENT_KERNEL", False)
    stub_preprocess(monkeypatch)
    return launches, keys


def inputs(batch=2, sq=9, sk=11, heads=4, kv_heads=2, d=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, sq, heads, d, generator=g).to(dtype)
    k, v = (torch.randn(batch, sk, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    out, lse = reference(q, k, v)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    return q, k, v, out.to(dtype), dout, lse


def reference_grads(q, k, v, dout):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, _ = reference(*leaves, dtype=torch.float64)
    return torch.autograd.grad(out, leaves, dout.double())


def test_launch_matches_the_kernel_signature(kernels):
    launches, keys = kernels
    q, k, v, out, dout, lse = inputs()
    sm90_bwd.backward(q, k, v, out, dout, lse, 0.125, False)
    params = inspect.signature(BwdWsSm90.__call__).parameters
    assert len(params) - 2 == 18  # self and the stream (TVM-FFI's current one) are not passed
    assert len(inspect.signature(sm90_bwd.BwdSm90.__call__).parameters) == len(params)
    (launch,) = launches
    assert launch["group"] == 2 and launch["sem"] is None
    # GQA, not deterministic, v2: dK, dV summed per kv head in the kernel (atomic); no features.
    assert keys == [
        (
            "bfloat16",
            64,
            False,
            False,
            sm90_bwd.DEFAULT_VERSION,
            False,
            True,
            False,
            False,
            False,
            False,
            T64,
            False,
            sm90_bwd.tile_switch(sm90_bwd.DQ_SCALE_AT_CAST, T64),
            sm90_bwd.tile_switch(sm90_bwd.DQ_FRAGMENTS, T64),
            64,
            False,
            1,
            1,
            False,  # multicast (`QDO_MULTICAST`, off)
        )
    ]
    assert launch["window"] == (-1, -1) and launch["softcap"] == 0.0
    assert launch["dk"].shape[2] == 2 and launch["dk"].dtype == torch.float32


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gradients_and_their_types(kernels, kv_heads, deterministic, version):
    launches, keys = kernels
    q, k, v, out, dout, lse = inputs(kv_heads=kv_heads)
    dq, dk, dv = sm90_bwd.backward(
        q, k, v, out, dout, lse, 64**-0.5, False, deterministic=deterministic, version=version
    )
    mha = kv_heads == 4
    atomic = version == 2 and not mha and not deterministic
    # MHA: the kernel writes dK, dV in the inputs' type; GQA: fp32, per kv head (v2's atomic
    # sums) or per q head (v1, deterministic), summed here.
    assert launches[-1]["dk"].dtype == (torch.bfloat16 if mha else torch.float32)
    assert launches[-1]["dk"].shape[2] == (kv_heads if atomic else 4)
    assert keys[-1][5:7] == (mha, atomic)
    for ours, ref in zip((dq, dk, dv), reference_grads(q, k, v, dout), strict=True):
        assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("version", [1, 2])
def test_dq_scale_at_cast(kernels, monkeypatch, version):
    # `DQ_SCALE_AT_CAST`: the compile key asks for an unscaled dQacc (the stand-in leaves the scale
    # out as the kernel then does) and the host's cast applies it: the same gradients.
    launches, keys = kernels
    monkeypatch.setattr(sm90_bwd, "DQ_SCALE_AT_CAST", True)
    q, k, v, out, dout, lse = inputs(kv_heads=2)
    dq, dk, dv = sm90_bwd.backward(q, k, v, out, dout, lse, 64**-0.5, False, version=version)
    assert keys[-1][13] is True
    ref = reference_grads(q, k, v, dout)
    for ours, r in zip((dq, dk, dv), ref, strict=True):
        assert ours.dtype == torch.bfloat16 and ours.is_contiguous()
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tile, d", [(80, 128), (64, 128), (128, 64), (64, 64)])
def test_fragment_order_round_trip(monkeypatch, tile, d):
    # `dq_from_fragments` undoes the kernel's fragment order (`fragment_index`): every element back
    # in its place, the padded rows cut (torch's pass; `dq_unfragment`'s map: the tests below).
    monkeypatch.setattr(sm90_bwd, "DQ_UNFRAGMENT_KERNEL", False)
    g = torch.Generator().manual_seed(3)
    rows = 2 * tile
    dense = torch.randn(2, rows, 3, d, generator=g)
    buf = torch.zeros(2, 3, rows * d)
    index = fragment_index(rows, tile, d).reshape(-1)
    for b in range(2):
        for h in range(3):
            buf[b, h, index] = dense[b, :, h].reshape(-1)
    assert sorted(index.tolist()) == list(range(rows * d))  # a permutation
    for sq in (rows - 9, rows, tile, 1):
        padded = -(-sq // tile) * tile
        part = buf.view(2, 3, rows, d)[:, :, :padded]
        out = sm90_bwd.dq_from_fragments(part, sq, torch.float32, None, tile)
        assert out.is_contiguous() and torch.equal(out, dense[:, :sq])
    scaled = sm90_bwd.dq_from_fragments(buf.view(2, 3, rows, d), rows - 9, torch.bfloat16, 0.5, tile)
    assert scaled.dtype == torch.bfloat16
    assert torch.equal(scaled, (dense[:, : rows - 9] * 0.5).to(torch.bfloat16))


def test_dq_unfragment_supports():
    # The tiles and head dims `dq_from_fragments` hands to the kernel (`dq_unfragment.supports`):
    # 64 and 128 at multiples of 16, 80 at d128 alone (its transposed map); else torch's pass.
    from hopper_fmha.kernels.dq_unfragment import supports

    assert all(supports(t, d) for t in (64, 128) for d in (16, 64, 96, 128, 192, 256))
    assert supports(80, 128) and not supports(80, 64) and not supports(64, 72) and not supports(96, 64)


@pytest.mark.parametrize("tile, d", [(128, 64), (64, 128), (64, 64), (128, 128), (80, 128)])
def test_dq_unfragment_places(tile, d):
    # `dq_unfragment.unit_place` and `value_offset`, the postprocess kernel's map (unit u: floats
    # 4 u .. 4 u + 3 of the fragment-ordered buffer -> their places in dQ), against
    # `fragment_index`, derived from the main kernel's side: every float of two blocks lands where
    # the main kernel put it.
    from hopper_fmha.kernels.dq_unfragment import unit_place, value_offset

    rows = 2 * tile
    index = fragment_index(rows, tile, d)  # (row, col) -> flat index in one head's buffer
    for u in range(rows * d // 4):
        block, row, col = unit_place(u, tile, d)
        for h2 in range(2):
            for e in range(2):
                dr, dc = value_offset(h2, e, tile)
                assert index[block * tile + row + dr, col + dc] == 4 * u + 2 * h2 + e


@pytest.mark.parametrize("unscaled", [False, True], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("d, causal, tile", [(128, False, 80), (128, True, 64), (64, False, T64)])
def test_dq_fragments(kernels, monkeypatch, kv_heads, deterministic, unscaled, d, causal, tile):
    # `DQ_FRAGMENTS` (dense, every query tile): the host lays dQacc out per head in whole blocks,
    # the stand-in adds in the kernel's fragment order, the host puts it back in order (and
    # scales it, with `DQ_SCALE_AT_CAST`): the reference's gradients, contiguous. Varlen keeps the
    # plain dQacc.
    launches, keys = kernels
    monkeypatch.setattr(sm90_bwd, "DQ_FRAGMENTS", True)
    monkeypatch.setattr(sm90_bwd, "DQ_SCALE_AT_CAST", unscaled)
    q, k, v, out, dout, lse = inputs(sq=170, sk=150, kv_heads=kv_heads, d=d)
    if causal:
        out, lse = reference(q, k, v, d**-0.5, True)
        out = out.to(q.dtype)
    grads = sm90_bwd.backward(q, k, v, out, dout, lse, d**-0.5, causal, deterministic=deterministic)
    assert keys[-1][11] == tile and keys[-1][13:15] == (unscaled, True)
    assert launches[-1]["dq_rows"] == -(-170 // tile) * tile  # whole blocks per head
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, d**-0.5, causal, dtype=torch.float64)
    for ours, ref in zip(grads, torch.autograd.grad(o, leaves, dout.double()), strict=True):
        assert ours.dtype == torch.bfloat16 and ours.is_contiguous()
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty filled with NaN (floating point): a buffer the host leaves unwritten shows."""
    empty = torch.empty

    def nan_filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_filled)


@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
@pytest.mark.parametrize("chains, sk", [(1, 300), (3, 300), (3, 170), (1, 0)])
def test_dq_store_first(kernels, monkeypatch, nan_empty, chains, sk, fragments):
    # `sm90_bwd_ws.DQ_STORE_FIRST`: a deterministic call without causal or window gets dQacc
    # unzeroed (the kernel stores each block's first turn, as the stand-in does); the host zeroes
    # the chain copies no turn reaches (170 keys: 2 key blocks, 3 copies) and all of dQacc where
    # no kernel runs (no keys). torch.empty gives NaN here, so a copy left unwritten shows.
    monkeypatch.setattr(sm90_bwd_ws, "DQ_STORE_FIRST", True)
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS", {(128, 128): chains})
    monkeypatch.setattr(sm90_bwd, "DQ_FRAGMENTS", fragments)
    q, k, v, out, dout, lse = inputs(sq=150, sk=sk, kv_heads=2, d=128)
    expected = reference_grads(q, k, v, dout) if sk else None
    for causal in (False, True):
        if causal and not sk:
            continue
        if causal:
            out, lse = reference(q, k, v, 128**-0.5, True)
            out = out.to(q.dtype)
            leaves = [t.double().requires_grad_() for t in (q, k, v)]
            o, _ = reference(*leaves, 128**-0.5, True, dtype=torch.float64)
            expected = torch.autograd.grad(o, leaves, dout.double())
        grads = sm90_bwd.backward(q, k, v, out, dout, lse, 128**-0.5, causal, deterministic=True)
        if not sk:
            assert not grads[0].isnan().any() and not grads[0].any()
            continue
        for ours, ref in zip(grads, expected, strict=True):
            torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
@pytest.mark.parametrize("chains", [1, 3])
@pytest.mark.parametrize(
    "sq, sk, causal, window, fewest",
    [
        (150, 300, True, (-1, -1), 2),  # block 0's rows see keys < 214: two key blocks
        (300, 150, True, (-1, -1), 0),  # rows 0-149 see no key: blocks 0-1 get no turn
        (150, 300, False, (20, 0), 1),  # a narrow window: block 0 sees key block 1 only
        (150, 300, False, (-1, 40), 2),  # a right limit only
        (170, 170, True, (60, 0), 1),  # causal and a left limit
    ],
)
@pytest.mark.parametrize("by_block", [False, True], ids=["whole-copies", "by-block"])
def test_dq_store_first_masked(
    kernels, monkeypatch, nan_empty, chains, fragments, sq, sk, causal, window, fewest, by_block
):
    # `sm90_bwd_ws.DQ_STORE_FIRST_MASKED`: with causal or a window the kernel stores a block's
    # first turn (of each copy) where the block's rows see one of the copy's key blocks; the host
    # leaves dQacc unzeroed only where every block gets as many turns as copies
    # (`sm90_bwd.block_turns`), zeroes copy c of the blocks with c turns or fewer otherwise
    # (session 43, `DQ_ZERO_BY_BLOCK`: only those blocks; else the whole copy), all of it where
    # some block gets none.
    # torch.empty gives NaN here; the stand-in stores per block as the kernel. With the turns
    # overstated (`key_blocks_seen`, under both), the unwritten blocks show: the check can fail.
    monkeypatch.setattr(sm90_bwd_ws, "DQ_STORE_FIRST", True)
    monkeypatch.setattr(sm90_bwd_ws, "DQ_STORE_FIRST_MASKED", True)
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS", {(128, 128): chains})
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS_MASKED", True)
    monkeypatch.setattr(sm90_bwd, "DQ_FRAGMENTS", fragments)
    monkeypatch.setattr(sm90_bwd, "DQ_ZERO_BY_BLOCK", by_block)
    q, k, v, out, dout, lse = inputs(sq=sq, sk=sk, kv_heads=2, d=128)
    scale = 128**-0.5
    out, lse = reference(q, k, v, scale, causal, window_size=window)
    out = out.to(q.dtype)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, scale, causal, window_size=window, dtype=torch.float64)
    expected = torch.autograd.grad(o, leaves, dout.double())
    call = dict(deterministic=True, window_size=window)
    zeroed = []
    zero_blocks = sm90_bwd.zero_blocks
    monkeypatch.setattr(
        sm90_bwd, "zero_blocks", lambda copy, which: zeroed.append(list(which)) or zero_blocks(copy, which)
    )
    grads = sm90_bwd.backward(q, k, v, out, dout, lse, scale, causal, **call)
    for ours, ref in zip(grads, expected, strict=True):
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)
    right = 0 if causal else window[1]
    assert sm90_bwd.fewest_turns(sq, sk, 64, 128, window[0], right) == fewest  # (d128's tile 64)
    turns = sm90_bwd.block_turns(sq, sk, 64, 128, window[0], right)
    # copy c of the blocks with c turns or fewer, each copy past the fewest (none with no turn at all)
    expected_zeroed = [[t <= c or not by_block for t in turns] for c in range(fewest, chains)]
    assert zeroed == (expected_zeroed if fewest else [])
    if fewest < chains:  # overstated: some block's copy is left as torch.empty left it
        seen = sm90_bwd.key_blocks_seen
        monkeypatch.setattr(sm90_bwd, "key_blocks_seen", lambda *args: seen(*args) + chains)
        grads = sm90_bwd.backward(q, k, v, out, dout, lse, scale, causal, **call)
        assert grads[0].isnan().any()


def test_fewest_turns():
    # `sm90_bwd.fewest_turns` against the emulator's turns per query block (`emulate_bwd.dq_order`,
    # the key blocks of the forward's block range, the rule `Mask.block_range_local` follows): the
    # fewest over blocks, 0 where some block gets none; random shapes and windows.
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        sq, sk = (int(x) for x in torch.randint(0, 700, (2,), generator=g))
        tile_m, tile_n = (64, 80, 128)[int(torch.randint(3, (1,), generator=g))], (48, 64, 96, 128)[_ % 4]
        left, right = (int(x) - 1 if x < 300 else -1 for x in torch.randint(0, 400, (2,), generator=g))
        case = (sq, sk, tile_m, tile_n, left, right)
        turns = [len(dq_order(m, tile_m, tile_n, sq, sk, left, right)) for m in range(-(-sq // tile_m))]
        assert sm90_bwd.block_turns(*case).tolist() == turns, case
        assert sm90_bwd.fewest_turns(*case) == min(turns, default=0), case


def test_zero_blocks():
    # `sm90_bwd.zero_blocks`: the blocks (dim -2) where `which` holds, and nothing else, runs
    # of them included; one slice per run.
    for which in ([True, False, False, True, True, False, True], [False] * 3, [True] * 4, [False, True]):
        copy = torch.ones(2, 3, len(which), 5)
        sm90_bwd.zero_blocks(copy, which)
        assert torch.equal(
            copy[:, :, torch.tensor(which, dtype=torch.bool)], torch.zeros_like(copy[:, :, which])
        )
        assert (copy[:, :, [not w for w in which]] == 1).all()


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked-only", "chains-masked"])
@pytest.mark.parametrize("cast", [False, True], ids=["sum", "cast_copies"])
@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
@pytest.mark.parametrize("chains", [2, 3])
@pytest.mark.parametrize("d, causal, tile", [(128, False, 80), (128, True, 64), (64, False, T64)])
def test_dq_chains(kernels, monkeypatch, chains, fragments, d, causal, tile, cast, masked):
    # `DQ_CHAINS` (compile-key element 17): deterministic calls with the writer warp and no causal
    # or window (or any, with `DQ_CHAINS_MASKED`) ask for k chains; dQacc holds k copies of the
    # padded rows (fragment order or not), the semaphores k per query block; the host sums the
    # copies: the reference's gradients. Atomic calls, and causal ones without the switch: 1 chain.
    launches, keys = kernels
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS", {(d, d): chains, (256, 256): 1})
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS_MASKED", masked)
    monkeypatch.setattr(sm90_bwd, "DQ_FRAGMENTS", fragments)
    monkeypatch.setattr(sm90_bwd, "CAST_COPIES", cast)  # (the rows' copies: fragments sum first)
    q, k, v, out, dout, lse = inputs(sq=170, sk=300, kv_heads=2, d=d)
    if causal:
        out, lse = reference(q, k, v, d**-0.5, True)
        out = out.to(q.dtype)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, d**-0.5, causal, dtype=torch.float64)
    expected = torch.autograd.grad(o, leaves, dout.double())
    for deterministic in (False, True):
        grads = sm90_bwd.backward(q, k, v, out, dout, lse, d**-0.5, causal, deterministic=deterministic)
        chained = deterministic and (masked or not causal)
        assert keys[-1][11] == tile and keys[-1][17] == (chains if chained else 1)
        assert ("dq_acc_rows" in launches[-1]) is chained
        if chained:
            assert launches[-1]["dq_acc_rows"] == chains * -(-170 // tile) * tile
        for ours, ref in zip(grads, expected, strict=True):
            assert ours.dtype == torch.bfloat16 and ours.is_contiguous()
            torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("laps", [2, 3, 4])
def test_laps_partition_key_blocks(laps):
    # `sm90_bwd_ws.lap_of` (`DQ_LAPS`): every key block in exactly one lap, laps contiguous and in
    # order, each lap's blocks indexed 0.. its size - 1; `laps_reached` counts the non-empty ones.
    from hopper_fmha.kernels.sm90_bwd_ws import lap_of, laps_reached

    for num_n in range(1, 200):
        places = [lap_of(n, num_n, laps) for n in range(num_n)]
        sizes = {}
        for n, (lap, index, size) in enumerate(places):
            assert 0 <= index < size and 0 <= lap < laps
            assert sizes.setdefault(lap, size) == size
            assert n == sum(sizes.get(l, 0) for l in range(lap)) + index  # contiguous, in order
        assert sum(sizes.values()) == num_n and sorted(sizes) == list(range(len(sizes)))
        assert laps_reached(num_n, laps) == len(sizes)
    assert laps_reached(0, laps) == 0


@pytest.mark.parametrize(
    "num_n, blocks, laps", [(86, 64, 2), (43, 64, 1), (200, 64, 4), (5, 3, 2), (7, 64, 3)]
)
def test_lap_turns_follow_arrival(num_n, blocks, laps):
    # A model of the rotated walk in laps (`BwdWsSm90.walk`, `turn`, `lap_of`; the kernel's
    # arithmetic, the turn's wrap written as a modulo): in each lap every query block gets each
    # turn 0 .. size - 1 once, in the order its CTAs reach it, and with a stride (a lap no larger
    # than the blocks) a CTA's first block is its turn 0 and at each later step its predecessor
    # reached the block one step before it: no CTA waits at the start (d256 N4096: 86 CTAs, 64
    # blocks, 2 laps of 43).
    from hopper_fmha.kernels.sm90_bwd_ws import lap_of

    arrivals, starts = {}, []
    for n in range(num_n):
        lap, index, size = lap_of(n, num_n, laps) if laps > 1 else (0, n, num_n)
        stride = blocks // size
        first = index * stride
        for step in range(blocks):
            m = (first + step) % blocks
            if stride > 0:
                turn = (min(m // stride, size - 1) - index) % size
            else:
                turn = size - 1 - index  # (no rotation: every CTA at block 0 first)
            arrivals.setdefault((lap, m), []).append((turn, step, stride > 0))
            if step == 0:
                starts.append((turn, stride > 0))
    for got in arrivals.values():
        got.sort()
        assert [t for t, _, _ in got] == list(range(len(got)))  # each turn once
        if got[0][2]:  # rotated: each turn's CTA reaches the block at least a step after the last
            assert all(b[1] > a[1] for a, b in zip(got, got[1:], strict=False))
    assert all(turn == 0 for turn, rotated in starts if rotated)  # no wait at the first block


@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
def test_dq_laps_host(kernels, monkeypatch, nan_empty, fragments):
    # `sm90_bwd_ws.DQ_LAPS` with the rotated deterministic walk and chains: copy c holds lap c's
    # key blocks (the stand-in), and the host zeroes the copies no lap reaches: 4 key blocks in 3
    # laps of 2 leave copy 2 empty. torch.empty gives NaN here, so an unzeroed copy shows.
    monkeypatch.setattr(sm90_bwd_ws, "DQ_LAPS", True)
    monkeypatch.setattr(sm90_bwd_ws, "DQ_STORE_FIRST", True)
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS", {(128, 128): 3})
    monkeypatch.setattr(sm90_bwd, "DQ_FRAGMENTS", fragments)
    launches, keys = kernels
    q, k, v, out, dout, lse = inputs(sq=150, sk=4 * 128 - 10, kv_heads=2, d=128)
    grads = sm90_bwd.backward(q, k, v, out, dout, lse, 128**-0.5, False, deterministic=True)
    assert keys[-1][12] is True and keys[-1][17] == 3  # rotated, 3 chains: laps
    for ours, ref in zip(grads, reference_grads(q, k, v, dout), strict=True):
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("grid", [(32, 16, 4), (86, 8, 4), (5, 3, 7), (1, 1, 1), (7, 65535, 1)])
def test_lpt_place_is_an_order_of_the_grid(grid, group):
    # `sm90_bwd_ws.lpt_place` (`LPT_HEADS`): every (key block, head, batch) exactly once; in
    # launch order, groups of `group` (head, batch) pairs one after another (the last one smaller),
    # each taking key block 0 of all its pairs, then key block 1, ... (longest first, causal).
    from hopper_fmha.kernels.sm90_bwd_ws import lpt_place

    x_len, y_len, z_len = grid
    pairs = y_len * z_len
    if x_len * pairs > 200_000:
        y_len, pairs = 997, 997 * z_len  # (the same shape of groups, fewer CTAs to check)
    seen, order = set(), []
    for bz in range(z_len):
        for by in range(y_len):
            for bx in range(x_len):
                n, h, b = lpt_place(bx, by, bz, (x_len, y_len, z_len), group)
                assert 0 <= n < x_len and 0 <= h < y_len and 0 <= b < z_len
                seen.add((n, h, b))
                order.append((n, h + y_len * b))
    assert len(seen) == x_len * pairs  # a bijection
    expected = []
    for first in range(0, pairs, group):
        members = range(first, min(first + group, pairs))
        expected += [(n, hb) for n in range(x_len) for hb in members]
    assert order == expected


def test_sum_copies_adds_in_order():
    # fp32 addition is not associative: the copies are added first to last, always.
    a, b, c = torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])
    assert sm90_bwd.sum_copies([a, b, c]).item() == 1.0  # (a + b) + c; a + (b + c) would be 0
    assert sm90_bwd.sum_copies([a, b]).item() == 0.0


@pytest.mark.parametrize("chains", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_copies_is_the_cast_of_the_sum(dtype, chains):
    # `cast_copies` (the chains' sum cast in its last addition) gives the bits of the fp32 sum's
    # cast, on copies viewed as the host views them (strided: padded rows cut off).
    acc = torch.randn(2, chains, 80, 3, 16) * torch.logspace(-3, 3, 16)
    copies = acc[:, :, :70].unbind(1)
    expected = sm90_bwd.cast_dq(sm90_bwd.sum_copies(copies), dtype, None)
    got = sm90_bwd.cast_copies(copies, dtype, None)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == (2, 70, 3, 16)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    a, b, c = torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])
    assert sm90_bwd.cast_copies([a, b, c], dtype, None).item() == 1.0  # in order, as sum_copies
    scaled = sm90_bwd.cast_copies(copies, dtype, 0.125)
    assert torch.equal(scaled, sm90_bwd.cast_dq(sm90_bwd.sum_copies(copies), dtype, 0.125))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_writer_warp_only_where_deterministic(kernels, monkeypatch, causal):
    # `DQ_WRITER_WARP` (compile-key element 16): deterministic calls of the v2 kernel ask for the
    # writer warp (the wide kernel's too, since session 27); atomic ones do not. Gradients as before.
    import hopper_fmha.backward as host

    launches, keys = kernels
    monkeypatch.setattr(sm90_bwd, "DQ_WRITER_WARP", True)
    monkeypatch.setattr(sm90_bwd, "DQ_WRITER_PLAIN", ())  # (atomic calls: `test_dq_writer_plain_...`)
    q, k, v, out, dout, lse = inputs(sq=150, sk=170, kv_heads=2, d=128)
    if causal:
        out, lse = reference(q, k, v, 128**-0.5, True)
        out = out.to(q.dtype)
    for deterministic in (False, True):
        grads = sm90_bwd.backward(q, k, v, out, dout, lse, 128**-0.5, causal, deterministic=deterministic)
        assert keys[-1][16] is deterministic and keys[-1][3] is deterministic
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        o, _ = reference(*leaves, 128**-0.5, causal, dtype=torch.float64)
        for ours, ref in zip(grads, torch.autograd.grad(o, leaves, dout.double()), strict=True):
            torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(host, "WIDE_BACKWARD", True)
    wide = [torch.nn.functional.pad(t, (0, 128)) for t in (q, k, v, out, dout)]
    sm90_bwd.backward(*wide, lse, 0.1, causal, deterministic=True)
    assert keys[-1][1] == 256 and keys[-1][16] is True


def test_dq_writer_plain_asks_for_the_writer(kernels, monkeypatch):
    # `DQ_WRITER_PLAIN` (session 29): non-deterministic v2 calls at its tiles ask for the writer
    # warp (key element 16); not the wide kernel, unless `DQ_WRITER_PLAIN_WIDE` (session 31); off:
    # deterministic calls only.
    import hopper_fmha.backward as host

    _, keys = kernels
    q, k, v, out, dout, lse = inputs(sq=150, sk=170, kv_heads=2, d=128)
    wide = [torch.nn.functional.pad(t, (0, 128)) for t in (q, k, v, out, dout)]
    for plain in ((), (64, 80), True):
        monkeypatch.setattr(sm90_bwd, "DQ_WRITER_PLAIN", plain)
        sm90_bwd.backward(q, k, v, out, dout, lse, 128**-0.5, False)
        assert keys[-1][11] == 80 and keys[-1][16] is bool(plain)
    monkeypatch.setattr(host, "WIDE_BACKWARD", True)
    for on in (False, True):
        monkeypatch.setattr(sm90_bwd, "DQ_WRITER_PLAIN_WIDE", on)
        sm90_bwd.backward(*wide, lse, 0.1, False)
        assert keys[-1][1] == 256 and keys[-1][11] == 64 and keys[-1][16] is on
        # (chains, writer warps: deterministic; CTA pairs: `QDO_MULTICAST`, off)
        assert keys[-1][3] is False and keys[-1][17:] == (1, 1, False)


@pytest.mark.parametrize("plain", [(), (80,), True])
def test_varlen_dq_writer_plain(varlen_kernels, monkeypatch, plain):
    # d64 (tile 128) causal, and d128 non-causal (tile 80, where the default asks for the writer).
    _, keys = varlen_kernels
    monkeypatch.setattr(sm90_bwd, "DQ_WRITER_PLAIN", plain)
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([70, 0, 33], [90, 5, 40], causal=True)
    sm90_bwd.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, 70, 90, 64**-0.5, True)
    assert keys[-1][11] == 128 and keys[-1][16] is (plain is True)
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([70, 0, 33], [90, 5, 40], d=128)
    sm90_bwd.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, 70, 90, 128**-0.5, False)
    assert keys[-1][11] == 80 and keys[-1][16] is bool(plain)


def test_varlen_dq_writer_warp(varlen_kernels, monkeypatch):
    launches, keys = varlen_kernels
    monkeypatch.setattr(sm90_bwd, "DQ_WRITER_WARP", True)
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([70, 0, 33], [90, 5, 40], causal=True)
    for deterministic in (False, True):
        sm90_bwd.backward_varlen(
            q, k, v, out, dout, lse, cu_q, cu_k, 70, 90, 64**-0.5, True, deterministic=deterministic
        )
        assert keys[-1][16] is deterministic


def test_deterministic_gets_zeroed_semaphores(kernels):
    launches, keys = kernels
    q, k, v, out, dout, lse = inputs(sq=130)
    sm90_bwd.backward(q, k, v, out, dout, lse, 0.125, True, deterministic=True)
    sem = launches[-1]["sem"]
    assert sem.dtype == torch.int32 and sem.shape == (2, 4, -(-130 // T64)) and not sem.any()  # query blocks
    assert keys[-1][2:4] == (True, True)


@pytest.mark.parametrize(
    "heads,kv_heads,limit",
    [(6, 3, 3), (6, 3, 4), (6, 1, 4), (6, 2, 2)],
    ids=["groups-of-2-limit-3", "groups-of-2-limit-4", "mqa-group-past-limit", "group-past-limit"],
)
def test_launches_in_parts_past_the_grid_limit(kernels, monkeypatch, heads, kv_heads, limit):
    # Batch 7 and the heads in parts of at most `limit` (the forward's `kernels.grid_spans`): whole
    # GQA groups, or slices of one group larger than the limit with its kv head.
    monkeypatch.setattr(sm90_bwd, "GRID_YZ_MAX", limit)
    launches, _ = kernels
    q, k, v, out, dout, lse = inputs(batch=7, heads=heads, kv_heads=kv_heads)
    dq, dk, dv = sm90_bwd.backward(q, k, v, out, dout, lse, 64**-0.5, False)
    assert all(l["q"].shape[0] <= limit and l["q"].shape[2] <= limit for l in launches)
    assert len(launches) > -(-7 // limit)  # the heads were split too
    for ours, ref in zip((dq, dk, dv), reference_grads(q, k, v, dout), strict=True):
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2)


def test_lse_gradient_enters_d(kernels):
    q, k, v, out, dout, lse = inputs()
    dlse = torch.randn(lse.shape)
    with_dlse = sm90_bwd.backward(q, k, v, out, dout, lse, 64**-0.5, False, dlse=dlse)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, l = reference(*leaves, dtype=torch.float64)
    ref = torch.autograd.grad((o * dout.double()).sum() + (l * dlse.double()).sum(), leaves)
    for ours, r in zip(with_dlse, ref, strict=True):
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "causal, window, softcap",
    [(True, (9, -1), 0.0), (False, (4, 2), 0.0), (False, (-1, 3), 0.0), (False, (-1, -1), 4.0),
     (True, (5, 7), 3.0)],
    ids=["causal-left", "both", "right", "softcap", "causal-softcap-right-dropped"],
)  # fmt: skip
def test_score_features_reach_the_kernel(kernels, causal, window, softcap):
    # The compile key names which features (sides of the window, softcap), the launch their sizes;
    # with causal the right side is the causal mask's (dropped). Gradients against torch's autograd
    # of the reference with the same features.
    launches, keys = kernels
    q, k, v, _, dout, _ = inputs(sq=70, sk=75)
    features = dict(window_size=window, softcap=softcap)
    out, lse = reference(q, k, v, 64**-0.5, causal, **features)
    grads = sm90_bwd.backward(q, k, v, out.to(q.dtype), dout, lse, 64**-0.5, causal, **features)
    right = -1 if causal else window[1]
    assert keys[-1][7:12] == (window[0] >= 0, right >= 0, softcap > 0, False, 64 if softcap else T64)
    assert launches[-1]["window"] == (window[0], right) and launches[-1]["softcap"] == softcap
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, 64**-0.5, causal, dtype=torch.float64, **features)
    ref = torch.autograd.grad(o, leaves, dout.double())
    for ours, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)


def test_sink_gradient_comes_fourth(kernels):
    q, k, v, _, dout, _ = inputs(sq=70, sk=75)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(2))
    out, lse = reference(q, k, v, 64**-0.5, True, learnable_sink=sink)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3))
    dq, dk, dv, dsink = sm90_bwd.backward(
        q, k, v, out.to(q.dtype), dout, lse, 64**-0.5, True, dlse=dlse, learnable_sink=sink
    )
    leaves = [t.double().requires_grad_() for t in (q, k, v, sink)]
    o, l = reference(*leaves[:3], 64**-0.5, True, dtype=torch.float64, learnable_sink=leaves[3])
    ref = torch.autograd.grad((o * dout.double()).sum() + (l * dlse.double()).sum(), leaves)
    for ours, r in zip((dq, dk, dv), ref[:3], strict=True):
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)
    assert dsink.shape == (4,) and dsink.dtype == torch.float32
    torch.testing.assert_close(dsink.double(), ref[3], rtol=1e-2, atol=1e-2)


def test_version_1_refuses_score_features(kernels):
    q, k, v, out, dout, lse = inputs()
    with pytest.raises(NotImplementedError, match="version 1 has no window or softcap"):
        sm90_bwd.backward(q, k, v, out, dout, lse, 0.125, False, softcap=2.0, version=1)


def test_no_keys_or_no_queries_launch_nothing(kernels):
    launches, _ = kernels
    q, k, v, out, dout, lse = inputs(sk=0)
    dq, dk, dv = sm90_bwd.backward(q, k, v, out, dout, lse, 0.125, False)
    assert not launches and dk.shape == k.shape and not dq.any()


@pytest.mark.parametrize("kernel", [True, False], ids=["preprocess", "torch"])
def test_row_stats_are_padded_to_whole_blocks(kernels, monkeypatch, kernel):
    # D and LSE log2 e as both kernels read them: 130 rows padded to 192 (3 blocks of 64), the
    # padding and a row without keys at 0 / +inf. "torch" checks the fallback's values; "preprocess"
    # only the host side around the kernel (allocation, arguments), the kernel being the fixture's
    # stand-in here (the kernel itself: test_gpu_backward.py::test_preprocess_kernel_matches_torch).
    monkeypatch.setattr(sm90_bwd, "PREPROCESS_KERNEL", kernel)
    q, k, v, out, dout, lse = inputs(sq=130)
    lse = lse.clone()
    lse[1, 2, 5] = -math.inf
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1))
    delta, lse2 = sm90_bwd.row_stats(out, dout, lse, dlse)
    assert delta.shape == lse2.shape == (2, 4, 192)
    assert torch.equal(delta[..., 130:], torch.zeros(2, 4, 62))
    assert torch.isinf(lse2[..., 130:]).all() and (lse2[..., 130:] > 0).all()
    assert lse2[1, 2, 5] == math.inf
    expected = (out.double() * dout.double()).sum(-1).transpose(1, 2) - dlse.double()
    torch.testing.assert_close(delta[..., :130].double(), expected, rtol=1e-5, atol=1e-5)
    finite = lse != -math.inf
    torch.testing.assert_close(lse2[..., :130][finite].double(), lse[finite].double() * math.log2(math.e))


# ---- varlen (`backward_varlen`): packed sequences, the query side's buffers padded per sequence ----


def varlen_kernel(
    launches,
    atomic: bool,
    causal: bool,
    window_sides=(False, False),
    softcap_on=False,
    tile=64,
    dq_unscaled=False,
    dq_fragments=False,
):
    """A stand-in for the varlen backward kernel: per sequence b, its query rows read from and added
    into the padded buffers from (cu_seqlens_q[b] + tile_m b) rounded down to a multiple of tile_m
    (the kernel's `padded_rows`, asserted 16-byte aligned as its TMA boxes need), the rows
    past the sequence's end in the last query block included (their LSE log2 e must be +inf there:
    a finite value would add their P into dK, dV); keys from the packed k, v. dq_fragments
    (`VARLEN_DQ_FRAGMENTS`): dQacc is a (rows, h, d) view of a per-head (h, rows, d) buffer, each
    sequence's blocks added in fragment order from its padded start."""

    def run(
        q, k, v, dout, lse2, delta, dq_acc, dk, dv, sem, scale, group, left, right, softcap, cu_q, cu_k, max_k
    ):
        launches.append(
            dict(q=q, dk=dk, sem=sem, lse2=lse2, max_k=max_k, window=(left, right), softcap=softcap)
        )
        assert q.shape[0] == 1 and lse2.shape[0] == 1
        if dq_fragments:  # whole blocks of every head's padded rows, one head after another
            assert dq_acc.shape[1] % tile == 0 and dq_acc.shape[1] >= lse2.shape[2]
            assert dq_acc.stride(2) == dq_acc.shape[1] * dq_acc.shape[3]
        else:
            assert dq_acc.shape[1] == lse2.shape[2]
        assert (left >= 0, right >= 0) == window_sides and bool(softcap) == softcap_on
        q, k, v, dout, lse2, delta, dq_acc, dk, dv = (
            t[0] for t in (q, k, v, dout, lse2, delta, dq_acc, dk, dv)
        )
        kv_of = torch.arange(q.shape[1]) // group
        for b in range(cu_q.shape[0] - 1):
            q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            sq, sk = q1 - q0, k1 - k0
            if sk == 0 or sq == 0:
                continue
            rows = -(-sq // tile) * tile  # whole query blocks, as the kernel walks them
            p0 = (q0 + tile * b) // tile * tile
            assert p0 % 4 == 0  # LSE's and D's boxes start on 16 bytes
            qq = torch.zeros(rows, *q.shape[1:], dtype=torch.float64)
            do = torch.zeros(rows, *dout.shape[1:], dtype=torch.float64)
            qq[:sq], do[:sq] = q[q0:q1].double(), dout[q0:q1].double()
            qq[sq:] = 7.0  # rows past the end hold other data on the GPU: only +inf LSEs hide them
            kk, vv = (t[k0:k1].double()[:, kv_of] for t in (k, v))
            s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
            dtanh = 1.0
            if softcap_on:
                t = torch.tanh(s / softcap)
                s, dtanh = softcap * t, 1 - t * t
            seen = visible_keys(torch.arange(rows), sq, sk, left, 0 if causal else right)
            lse_rows, d_rows = lse2[:, p0 : p0 + rows].double(), delta[:, p0 : p0 + rows].double()
            p = torch.where(seen, torch.exp2(s * math.log2(math.e) - lse_rows[..., None]), 0.0)
            dp = torch.einsum("qhd,khd->hqk", do, vv)
            ds = p * (dp - d_rows[..., None]) * dtanh
            dq_part = (torch.einsum("hqk,khd->qhd", ds, kk) * (1.0 if dq_unscaled else scale)).float()
            if dq_fragments:
                add_fragments(dq_acc[p0 : p0 + rows][None], dq_part[None], tile)
            else:
                dq_acc[p0 : p0 + rows] += dq_part
            dk_heads = torch.einsum("hqk,qhd->khd", ds, qq) * scale
            dv_heads = torch.einsum("hqk,qhd->khd", p, do)
            if not atomic:
                dk[k0:k1] = dk_heads.to(dk.dtype)
                dv[k0:k1] = dv_heads.to(dv.dtype)
            else:
                dk[k0:k1].index_add_(1, kv_of, dk_heads.float())
                dv[k0:k1].index_add_(1, kv_of, dv_heads.float())

    return run


@pytest.fixture
def varlen_kernels(monkeypatch):
    launches, keys = [], []
    monkeypatch.setattr(sm90_bwd, "_compiled", {})

    def compile_bwd(*key):
        keys.append(key)
        assert key[4] == 2 and key[10] is True  # version 2, varlen
        return binding_checked(
            key, varlen_kernel(launches, key[6], key[2], key[7:9], key[9], key[11], key[13], key[14])
        )

    monkeypatch.setattr(sm90_bwd, "compile_bwd", compile_bwd)
    # dQ's un-permute by torch on these CPU tensors (`VARLEN_DQ_FRAGMENTS`; the mapped kernel's
    # stand-in: `test_varlen_dq_fragments_kernel_host`)
    monkeypatch.setattr(sm90_bwd, "DQ_UNFRAGMENT_KERNEL", False)
    stub_preprocess(monkeypatch)
    stub_dq_gather(monkeypatch, [])
    return launches, keys


def stub_dq_gather(monkeypatch, calls):
    """`dq_gather`'s kernel replaced by a torch stand-in behind its binding's checks; `calls` gets
    each launch's scale."""
    from hopper_fmha.kernels import dq_gather

    def compile_dq_gather(dtype_name, d):
        fake = dq_gather.fake_arguments(dtype_name, d)

        def run(acc, rows, dq, scale):
            assert_binds(fake[:3], (acc, rows, dq), "dq_gather")
            calls.append(scale)
            dq.copy_((acc[rows] * scale).to(dq.dtype))

        return run

    monkeypatch.setattr(dq_gather, "_compiled", {})
    monkeypatch.setattr(dq_gather, "compile_dq_gather", compile_dq_gather)


def varlen_inputs(lengths_q, lengths_k, heads=4, kv_heads=2, d=64, dtype=torch.bfloat16, dv=None, **features):
    from hopper_fmha.reference import reference_varlen

    g = torch.Generator().manual_seed(len(lengths_q))
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, d, generator=g).to(dtype)
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, n, generator=g).to(dtype) for n in (d, dv or d))
    out, lse = reference_varlen(q, k, v, cu_q, cu_k, softmax_scale=d**-0.5, **features)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    return q, k, v, out.to(dtype), dout, lse, cu_q, cu_k


@pytest.mark.parametrize(
    "causal, features",
    [(False, {}), (True, {}), (False, dict(window_size=(20, 3))), (True, dict(softcap=3.0)),
     (True, dict(learnable_sink=True, window_size=(50, -1)))],
    ids=["full", "causal", "window", "causal-softcap", "causal-left-sink"],
)  # fmt: skip
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_gradients(varlen_kernels, causal, features, kv_heads, deterministic):
    # Sequences of 70, 0, 1, 130 queries (an empty one, one of a single row, one of three blocks)
    # against 90, 5, 0, 128 keys (one without keys): the gradients of torch's autograd of the
    # per-sequence reference, dLSE included; the padded buffers and the gather are the host's.
    from hopper_fmha.reference import reference_varlen

    launches, keys = varlen_kernels
    sink = None
    if features.pop("learnable_sink", False):
        sink = torch.randn(4, generator=torch.Generator().manual_seed(7))
    lq, lk = [70, 0, 1, 130], [90, 5, 0, 128]
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs(
        lq, lk, kv_heads=kv_heads, causal=causal, learnable_sink=sink, **features
    )
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(8))
    grads = sm90_bwd.backward_varlen(
        q, k, v, out, dout, lse, cu_q, cu_k, 130, 128, 64**-0.5, causal, dlse=dlse,
        deterministic=deterministic, learnable_sink=sink, **features,
    )  # fmt: skip
    (launch,) = launches
    tile = 64 if features.get("softcap") else T64
    # 201 rows + 4 sequences x tile, rounded up to 64s
    assert launch["max_k"] == 128 and launch["lse2"].shape == (1, 4, -(-(201 + 4 * tile) // 64) * 64)
    assert (launch["sem"] is not None) == deterministic
    if deterministic:
        assert launch["sem"].shape == (4, 4, -(-201 // tile)) and not launch["sem"].any()  # query blocks
    leaves = [t.double().requires_grad_() for t in (q, k, v)] + (
        [] if sink is None else [sink.double().requires_grad_()]
    )
    o, l = reference_varlen(
        *leaves[:3], cu_q, cu_k, softmax_scale=64**-0.5, causal=causal, dtype=torch.float64,
        learnable_sink=None if sink is None else leaves[3], **features,
    )  # fmt: skip
    ref = torch.autograd.grad((o * dout.double()).sum() + (l * dlse.double()).sum(), leaves)
    assert len(grads) == len(ref)
    for name, ours, r in zip(("dq", "dk", "dv", "dsink"), grads, ref, strict=False):
        assert ours.shape == r.shape, name
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2, msg=name)


def test_varlen_dq_scale_at_cast(varlen_kernels, monkeypatch):
    # `DQ_SCALE_AT_CAST` through the varlen host: the padded dQacc gathered, then scaled and cast.
    monkeypatch.setattr(sm90_bwd, "DQ_SCALE_AT_CAST", True)
    test_varlen_gradients(varlen_kernels, True, {}, 2, False)
    assert varlen_kernels[1][-1][13] is True


@pytest.mark.parametrize("tile", [64, 128])
def test_varlen_padding_rows_are_infinite(varlen_kernels, monkeypatch, tile):
    # The query side's buffers: sequence b's rows from (cu_seqlens_q[b] + tile b) rounded down to a
    # multiple of tile (here 0 and tile), +inf LSE after them (so a block's rows past the sequence
    # get P = 0), D 0 there.
    monkeypatch.setattr(sm90_bwd, "D64_TILE_M", tile)
    launches, keys = varlen_kernels
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([3, 65], [4, 70])
    sm90_bwd.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, 65, 70, 0.125, False)
    assert keys[-1][11] == tile
    lse2 = launches[-1]["lse2"][0]
    finite = torch.isfinite(lse2[0])
    t = tile
    assert finite[:3].all() and not finite[3:t].any()
    assert finite[t : t + 65].all() and not finite[t + 65 :].any()
    torch.testing.assert_close(lse2[:, t : t + 65], lse[:, 3:68] * math.log2(math.e))


@pytest.mark.parametrize("tile", [64, 128])
def test_varlen_padded_starts_are_whole_blocks_that_never_overlap(tile):
    # Every sequence's padded start is a multiple of the tile (the LSE/D TMA boxes need 16-byte
    # starts: an unaligned one stopped the kernel with an illegal instruction, H200 2026-11-27),
    # its query blocks end before the next sequence's start, and the last ends inside the buffer.
    g = torch.Generator().manual_seed(tile)
    for _ in range(200):
        lengths = torch.randint(0, 300, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        lengths[torch.rand(lengths.shape, generator=g) < 0.2] = 0
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        starts = sm90_bwd.padded_starts(cu, tile)
        ends = starts[:-1] + -(-lengths // tile) * tile
        assert (starts % tile == 0).all()
        assert (ends <= starts[1:]).all()
        batch = lengths.shape[0]
        assert ends[-1] <= -(-(int(cu[-1]) + tile * batch) // 64) * 64


@pytest.mark.parametrize(
    "d, dv, kernel_d",
    [(96, 96, 128), (80, 64, 128), (32, 32, 64), (48, 64, 64), (64, 32, 64), (128, 72, 128)],
)
def test_other_head_dims_run_the_next_kernel_on_padded_copies(kernels, d, dv, kernel_d):
    # Zero columns add nothing to S, dP or D: the next kernel up on padded copies gives the exact
    # gradients, cut back to the inputs' head dims.
    launches, keys = kernels
    g = torch.Generator().manual_seed(d + dv)
    q = torch.randn(2, 70, 4, d, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 75, 2, d, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 75, 2, dv, generator=g).to(torch.bfloat16)
    out, lse = reference(q, k, v, d**-0.5, True)
    dout = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    grads = sm90_bwd.backward(q, k, v, out.to(q.dtype), dout, lse, d**-0.5, True)
    assert keys[-1][1] == kernel_d and launches[-1]["q"].shape[-1] == kernel_d
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, d**-0.5, True, dtype=torch.float64)
    ref = torch.autograd.grad(o, leaves, dout.double())
    for name, ours, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert ours.shape == r.shape and ours.is_contiguous(), name
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2, msg=name)


def test_head_dims_past_128_are_refused(kernels, monkeypatch):
    import hopper_fmha.backward as host

    monkeypatch.setattr(host, "WIDE_BACKWARD", False)  # the switch off: refused, rule named
    q = torch.zeros(1, 8, 2, 192, dtype=torch.bfloat16)
    v = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="head dims up to 128.*head_dim 192, head_dim_v 128"):
        sm90_bwd.backward(q, q, v, v, v, torch.zeros(1, 2, 8), 0.1, False)


@pytest.fixture
def wide(monkeypatch):
    """The wide kernel on (`backward.WIDE_BACKWARD`, on by default since session 27; pinned here)."""
    import hopper_fmha.backward as host

    monkeypatch.setattr(host, "WIDE_BACKWARD", True)


@pytest.mark.parametrize(
    "d, dv, kv_heads, causal, deterministic, kernel",
    [(256, 256, 2, True, False, (256, 256)), (192, 128, 2, True, False, (192, 128)),
     (160, 160, 4, False, True, (256, 256)), (256, 256, 1, False, True, (256, 256)),
     (136, 136, 4, True, False, (256, 256)), (136, 64, 2, False, False, (192, 128)),
     (192, 96, 4, False, True, (192, 128)), (200, 128, 2, True, False, (256, 256))],
    ids=["d256-gqa", "d192-dv128", "d160-mha-deterministic", "d256-mqa-deterministic", "d136-mha",
         "d136-dv64", "d192-dv96-mha-deterministic", "d200-dv128"],
)  # fmt: skip
@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
@pytest.mark.parametrize("wide_rotate", [False, True], ids=["plain-walk", "rotated"])
def test_head_dims_past_128_run_the_wide_kernel(
    kernels, wide, monkeypatch, d, dv, kv_heads, causal, deterministic, kernel, wide_rotate, fragments
):
    # Past 128 the wide kernel runs at (192, 128) or (256, 256), on zero-padded copies to the first
    # at least as large: dK, dV per q head (fp32 with GQA, summed by the host; no atomic sums),
    # 64-query steps; deterministic without causal, the rotated walk with WIDE_ROTATE (75 keys: 2
    # blocks per head, resident at once), else none. dQacc in fragment order with
    # DQ_FRAGMENTS_WIDE (d256 deterministic: its two chains' copies).
    monkeypatch.setattr(sm90_bwd, "WIDE_ROTATE", wide_rotate)
    monkeypatch.setattr(sm90_bwd, "DQ_FRAGMENTS_WIDE", fragments)
    launches, keys = kernels
    g = torch.Generator().manual_seed(d + dv)
    q = torch.randn(2, 70, 4, d, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 75, kv_heads, d, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 75, kv_heads, dv, generator=g).to(torch.bfloat16)
    out, lse = reference(q, k, v, d**-0.5, causal)
    dout = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    grads = sm90_bwd.backward(
        q, k, v, out.to(q.dtype), dout, lse, d**-0.5, causal, deterministic=deterministic
    )
    # (dtype, d, causal, deterministic, version, mha, dkv_atomic, left, right, softcap, varlen,
    # tile_m, rotate, dq_unscaled, dq_fragments, dv)
    key = keys[-1]
    assert (key[1], key[15]) == kernel and key[4] == 2 and key[6] is False and key[11] == 64
    assert key[12] is (wide_rotate and deterministic and not causal) and key[14] is fragments
    assert key[17] == (2 if kernel == (256, 256) and deterministic and not causal else 1)
    assert launches[-1]["q"].shape[-1] == kernel[0] and launches[-1]["dk"].shape[-1] == kernel[0]
    assert launches[-1]["dk"].dtype == (torch.bfloat16 if kv_heads == 4 else torch.float32)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, d**-0.5, causal, dtype=torch.float64)
    ref = torch.autograd.grad(o, leaves, dout.double())
    for name, ours, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert ours.shape == r.shape and ours.is_contiguous(), name
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2, msg=name)


def test_d256_refuses_version_1_and_past_256(kernels, wide):
    q = torch.zeros(1, 8, 2, 256, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="version 1 takes head dims up to 128"):
        sm90_bwd.backward(q, q, q, q, q, torch.zeros(1, 2, 8), 0.1, False, version=1)
    q = torch.zeros(1, 8, 2, 264, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="head dims up to 256.*head_dim 264"):
        sm90_bwd.backward(q, q, q, q, q, torch.zeros(1, 2, 8), 0.1, False)


@pytest.mark.parametrize(
    "d, dv, wide_on, kernel",
    [(96, 96, False, (128, 128)), (192, 128, True, (192, 128))],
    ids=["d96", "d192-dv128"],
)
def test_varlen_head_dims(varlen_kernels, monkeypatch, d, dv, wide_on, kernel):
    # d96 on padded copies of the d128 kernel; DeepSeek's (192, 128) natively on the wide kernel
    # (per-q-head dK, dV: no atomic sums).
    import hopper_fmha.backward as host
    from hopper_fmha.reference import reference_varlen

    monkeypatch.setattr(host, "WIDE_BACKWARD", wide_on)
    launches, keys = varlen_kernels
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([70, 0, 33], [90, 5, 40], d=d, dv=dv, causal=True)
    grads = sm90_bwd.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, 70, 90, d**-0.5, True)
    assert (keys[-1][1], keys[-1][15]) == kernel and launches[-1]["q"].shape[-1] == kernel[0]
    assert keys[-1][6] is not wide_on  # (GQA: atomic sums in the dense-dims kernel only)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference_varlen(*leaves, cu_q, cu_k, softmax_scale=d**-0.5, causal=True, dtype=torch.float64)
    ref = torch.autograd.grad(o, leaves, dout.double())
    for name, ours, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert ours.shape == r.shape, name
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2, msg=name)


def load_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_bwd_profile():
    return load_script("bwd_profile")


def test_turn_model():
    # scripts/turn_model.py (NOTES v36, `DQ_CHAINS_MASKED`'s prediction): without turns the
    # schedule is list scheduling (CTA lengths summed over the SMs, at least the longest CTA); a
    # zero latency costs the launch order nothing; the makespan never falls as the latency grows,
    # nor rises with more chains; d256 causal (48 keys against 64 queries) at L = 1.5 with one
    # chain and with two: the shares NOTES quotes.
    model = load_script("turn_model")
    num_n, num_m = 86, 64
    first = [48 * n // 64 for n in range(num_n)]
    launch, lpt = model.orders(32, num_n)
    assert sorted(launch) == sorted(lpt) == [(h, n) for h in range(32) for n in range(num_n)]
    assert lpt[:5] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]  # (four heads' longest CTAs first)
    work = 32 * sum(num_m - f for f in first)
    plain = model.makespan(lpt, first, num_m, 132)
    assert work / 132 <= plain <= work / 132 + num_m
    assert model.makespan(launch, first, num_m, 132, 0.0) == model.makespan(launch, first, num_m, 132)
    spans = {(L, k): model.makespan(launch, first, num_m, 132, L, k) for L in (0.5, 1.5, 3) for k in (1, 2)}
    for k in (1, 2):
        assert spans[(0.5, k)] <= spans[(1.5, k)] <= spans[(3, k)]
    for L in (0.5, 1.5, 3):
        assert spans[(L, 2)] <= spans[(L, 1)]
    assert round(plain / spans[(1.5, 1)], 2) == 0.62 and round(plain / spans[(1.5, 2)], 2) == 0.95


def test_bwd_profile_probes_match_the_methods_they_replace():
    # scripts/bwd_profile.py swaps kernel methods for no-ops: their parameters must stay the same.
    module = load_bwd_profile()
    for method, probe in module.PROBES.values():
        ours = inspect.signature(inspect.unwrap(probe)).parameters
        theirs = inspect.signature(inspect.unwrap(getattr(BwdWsSm90, method))).parameters
        assert list(ours) == list(theirs), method


def test_bwd_profile_interleaved_ab(monkeypatch, capsys):
    # `--ab`: each setting builds into a kernel dict of its own and is timed with its own switches
    # (the others as they were), in rounds whose order rotates; afterwards all is as before.
    profile = load_bwd_profile()
    monkeypatch.setattr(sm90_bwd, "_compiled", {"before": 1})
    monkeypatch.setattr(sm90_bwd, "DQ_SCALE_AT_CAST", (64, 80))
    monkeypatch.setattr(sm90_bwd_ws, "LSE_LOAD", "before_s")
    settings = [
        (text, profile.parse_setting(text)) for text in ("dq-at-cast=off", "dq-at-cast=on,lse-load=after_s")
    ]
    seen = []

    def call():
        state = (sm90_bwd.DQ_SCALE_AT_CAST, sm90_bwd_ws.LSE_LOAD)
        sm90_bwd._compiled.setdefault("built", state)  # a kernel built under these switches
        seen.append((state, sm90_bwd._compiled["built"]))

    def time_fn(fn):
        fn()
        return {(False, "before_s"): 2.0, (True, "after_s"): 1.0}[seen[-1][0]]

    times = profile.interleaved_ab(settings, call, time_fn, rounds=3)
    assert times == {"dq-at-cast=off": [2.0] * 3, "dq-at-cast=on,lse-load=after_s": [1.0] * 3}
    assert all(state == built for state, built in seen)  # each timed with the kernels of its setting
    assert [state[0] for state, _ in seen] == [False, True, False, True, True, False, False, True]
    assert sm90_bwd._compiled == {"before": 1}
    assert (sm90_bwd.DQ_SCALE_AT_CAST, sm90_bwd_ws.LSE_LOAD) == ((64, 80), "before_s")
    # A call that returns gradients: each later setting's are printed against the first's.
    monkeypatch.setattr(sm90_bwd, "_compiled", {})
    grads = {False: torch.tensor([1.0, -4.0]), True: torch.tensor([1.5, -4.0])}
    times = profile.interleaved_ab(
        settings, lambda: (grads[bool(sm90_bwd.DQ_SCALE_AT_CAST)], None), lambda fn: 1.0, rounds=1
    )
    assert times == {"dq-at-cast=off": [1.0], "dq-at-cast=on,lse-load=after_s": [1.0]}
    assert capsys.readouterr().out.splitlines() == [
        "[dq-at-cast=on,lse-load=after_s] gradients' max |diff| / max |the first setting's|: 1.2e-01"
    ]
    with pytest.raises(SystemExit, match="unknown switch"):
        profile.parse_setting("no-such=on")
    with pytest.raises(SystemExit, match="takes before_s / after_s / after_dp"):
        profile.parse_setting("lse-load=later")


def check_whole_query_blocks(kernels, d, sq, tile, padded, deterministic):
    """backward at head dim d, s_q = sq (non-causal, s_k = 75) runs the tile-`tile` kernel: LSE/D
    padded to `padded` rows (+inf past s_q), the semaphores count tile-row blocks, the gradients
    the reference's. Returns the inputs."""
    launches, keys = kernels
    q, k, v, out, dout, lse = inputs(sq=sq, sk=75, d=d)
    grads = sm90_bwd.backward(q, k, v, out, dout, lse, d**-0.5, False, deterministic=deterministic)
    assert keys[-1][11] == tile and launches[-1]["lse2"].shape[-1] == padded
    assert torch.isinf(launches[-1]["lse2"][..., sq:]).all()
    if deterministic:
        assert launches[-1]["sem"].shape[-1] == -(-sq // tile)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, d**-0.5, False, dtype=torch.float64)
    for ours, r in zip(grads, torch.autograd.grad(o, leaves, dout.double()), strict=True):
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)
    return q, k, v, out, dout, lse


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_d64_query_tile_128_pads_whole_blocks(kernels, monkeypatch, deterministic):
    # D64_TILE_M = 128 (FA4's d64 tile): the LSE/D rows padded to 128-row blocks (+inf, 0 past
    # s_q), the semaphores count 128-row blocks, the compile key carries the tile; d128 takes
    # its own tile, softcap keeps 64. The gradients as before.
    monkeypatch.setattr(sm90_bwd, "D64_TILE_M", 128)
    _, keys = kernels
    q, k, v, out, dout, lse = check_whole_query_blocks(kernels, 64, 130, 128, 256, deterministic)
    sm90_bwd.backward(q, k, v, out, dout, lse, 64**-0.5, False, softcap=5.0)
    assert keys[-1][11] == 64  # softcap keeps 64 (its kernel spills at 128)
    q128, k128, v128, out128, dout128, lse128 = inputs(d=128)
    sm90_bwd.backward(q128, k128, v128, out128, dout128, lse128, 128**-0.5, False)
    assert keys[-1][11] == sm90_bwd.D128_TILE_M != 128  # d128 takes its own switch's tile


def test_varlen_query_tile_128_pads_each_sequence_by_128(varlen_kernels, monkeypatch):
    monkeypatch.setattr(sm90_bwd, "D64_TILE_M", 128)
    launches, keys = varlen_kernels
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([70, 0, 130], [90, 5, 128], causal=True)
    grads = sm90_bwd.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, 130, 128, 64**-0.5, True)
    assert keys[-1][11] == 128 and launches[-1]["lse2"].shape[-1] == 640  # 200 + 3 x 128, to 64s
    from hopper_fmha.reference import reference_varlen

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference_varlen(*leaves, cu_q, cu_k, softmax_scale=64**-0.5, causal=True, dtype=torch.float64)
    for ours, r in zip(grads, torch.autograd.grad(o, leaves, dout.double()), strict=True):
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)


def test_varlen_rows_past_the_last_sequence_add_nothing(varlen_kernels):
    # Rows past cu_seqlens_q[-1] (allowed: the forward leaves them unwritten) may hold anything in
    # out and lse, nan included: no gradient, the sink's included, may take them in.
    from hopper_fmha.reference import reference_varlen

    q, k, v, _, dout, _, _, cu_k = varlen_inputs([70, 9], [90, 40])
    cu_q = torch.tensor([0, 70, 75], dtype=torch.int32)  # the last 4 rows are in no sequence
    sink = torch.randn(4, generator=torch.Generator().manual_seed(3))
    o, lse = reference_varlen(q[:75], k, v, cu_q, cu_k, softmax_scale=0.125, learnable_sink=sink)
    out = torch.cat([o.to(q.dtype), torch.full((4, *o.shape[1:]), float("nan"), dtype=q.dtype)])
    lse = torch.cat([lse, torch.full((4, 4), float("nan")).T], dim=1)
    grads = sm90_bwd.backward_varlen(
        q, k, v, out, dout, lse, cu_q, cu_k, 70, 90, 0.125, False, learnable_sink=sink
    )
    leaves = [t.double().requires_grad_() for t in (q, k, v, sink)]
    ro, _ = reference_varlen(
        leaves[0][:75],
        *leaves[1:3],
        cu_q,
        cu_k,
        softmax_scale=0.125,
        learnable_sink=leaves[3],
        dtype=torch.float64,
    )
    ref = torch.autograd.grad((ro * dout[:75].double()).sum(), leaves)
    for name, ours, r in zip(("dq", "dk", "dv", "dsink"), grads, ref, strict=True):
        assert torch.isfinite(ours).all(), name
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.parametrize(
    "causal, window, sm_count, rotated",
    [(False, (-1, -1), 132, True), (True, (-1, -1), 132, False), (False, (5, -1), 132, False),
     (False, (-1, 7), 132, False), (False, (-1, -1), 1, False)],
    ids=["full", "causal", "left", "right", "too-few-SMs"],
)  # fmt: skip
def test_deterministic_rotates_only_without_mask_and_where_a_head_fits(
    kernels, monkeypatch, causal, window, sm_count, rotated
):
    # The rotated walk (compile-key field 12): deterministic, no causal and no window (every key
    # block visits every query block), and a head's key blocks no more than the SMs (its one
    # wrap-around wait is on a later-launched CTA: all of them must be able to run at once).
    # Not without deterministic. Gradients as the reference's.
    monkeypatch.setattr(sm90_bwd, "HOST_SM_COUNT", sm_count)
    launches, keys = kernels
    q, k, v, _, dout, _ = inputs(sq=200, sk=300)  # 3 key blocks
    out, lse = reference(q, k, v, 0.125, causal, window_size=window)
    grads = sm90_bwd.backward(
        q, k, v, out.to(q.dtype), dout, lse, 0.125, causal, deterministic=True, window_size=window
    )
    assert keys[-1][3] is True and keys[-1][12] is rotated
    sm90_bwd.backward(q, k, v, out.to(q.dtype), dout, lse, 0.125, causal, window_size=window)
    assert keys[-1][12] is False
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, 0.125, causal, dtype=torch.float64, window_size=window)
    for ours, r in zip(grads, torch.autograd.grad(o, leaves, dout.double()), strict=True):
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_d128_query_tile_80_pads_whole_blocks(kernels, monkeypatch, deterministic):
    # D128_TILE_M = 80 (FA4's d128 non-causal tile): the LSE/D rows padded to 80-row blocks and
    # then to a multiple of 64 (the strides' divisibility), +inf past s_q, the semaphores count
    # 80-row blocks; causal, a window or softcap keep 64. The gradients as before.
    monkeypatch.setattr(sm90_bwd, "D128_TILE_M", 80)
    _, keys = kernels
    # 3 x 80 = 240 rows, to 64s: 256
    q, k, v, out, dout, lse = check_whole_query_blocks(kernels, 128, 170, 80, 256, deterministic)
    c_out, c_lse = reference(q, k, v, 128**-0.5, True)
    sm90_bwd.backward(q, k, v, c_out.to(q.dtype), dout, c_lse, 128**-0.5, True)
    assert keys[-1][11] == 64  # causal keeps 64
    w_out, w_lse = reference(q, k, v, 128**-0.5, False, window_size=(20, -1))
    sm90_bwd.backward(q, k, v, w_out.to(q.dtype), dout, w_lse, 128**-0.5, False, window_size=(20, -1))
    assert keys[-1][11] == 64  # so does a window


@pytest.mark.parametrize(
    "d, causal, tile", [(64, False, T64), (64, True, T64), (128, False, 80), (128, True, 64)],
    ids=["d64", "d64-causal", "d128-tile80", "d128-causal-tile64"],
)  # fmt: skip
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_dq_fragments(varlen_kernels, monkeypatch, d, causal, tile, deterministic):
    # `VARLEN_DQ_FRAGMENTS`: dQacc per head in whole blocks of the padded rows (its own row count:
    # a multiple of the tile), each sequence added in fragment order from its padded start; torch's
    # un-permute and the packed rows' gather give the reference's gradients (empty sequences, one
    # of a single row, rows past the last sequence in q).
    from hopper_fmha.reference import reference_varlen

    monkeypatch.setattr(sm90_bwd, "VARLEN_DQ_FRAGMENTS", True)
    launches, keys = varlen_kernels
    lq, lk = [70, 0, 1, 130], [90, 5, 0, 128]
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs(lq, lk, d=d, causal=causal)
    grads = sm90_bwd.backward_varlen(
        q, k, v, out, dout, lse, cu_q, cu_k, 130, 128, d**-0.5, causal, deterministic=deterministic
    )
    assert keys[-1][11] == tile and keys[-1][14] is True
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference_varlen(*leaves, cu_q, cu_k, softmax_scale=d**-0.5, causal=causal, dtype=torch.float64)
    for ours, r in zip(grads, torch.autograd.grad(o, leaves, dout.double()), strict=True):
        assert ours.shape == r.shape and ours.is_contiguous()
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("d, causal, tile", [(64, False, T64), (128, False, 80), (128, True, 64)])
def test_varlen_dq_fragments_kernel_host(varlen_kernels, monkeypatch, d, causal, tile):
    # `VARLEN_DQ_FRAGMENTS` with `DQ_UNFRAGMENT_KERNEL`: the mapped `dq_unfragment` kernel (here a
    # torch stand-in behind its binding's checks placing each unit by `unit_place` and
    # `value_offset`, then the row map) gives torch's path's dq bit for bit; its row map sends
    # padding rows nowhere (-1) and every packed row from one padded row.
    from hopper_fmha.kernels import dq_unfragment

    calls = []

    def compile_dq_unfragment(dtype_name, head_dim, tile_m, mapped, copies):
        fake = dq_unfragment.fake_arguments(dtype_name, head_dim, mapped)

        def run(acc, dq, scale, rows_map):
            assert mapped and dq.shape[0] == 1 and copies == 1
            assert_binds((fake[0], fake[1], fake[3]), (acc, dq, rows_map), "dq_unfragment")
            calls.append((tile_m, scale))
            full = unfragment_by_map(acc, 1, dq.shape[2], tile_m, head_dim)[0]
            valid = rows_map >= 0
            assert sorted(rows_map[valid].tolist()) == list(range(dq.shape[1]))
            dq[0, rows_map[valid].long()] = (full[valid] * scale).to(dq.dtype)

        return run

    monkeypatch.setattr(dq_unfragment, "_compiled", {})
    monkeypatch.setattr(dq_unfragment, "compile_dq_unfragment", compile_dq_unfragment)
    monkeypatch.setattr(sm90_bwd, "VARLEN_DQ_FRAGMENTS", True)
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([7, 0, 1, 13], [9, 5, 0, 12], d=d, causal=causal)
    args = (q, k, v, out, dout, lse, cu_q, cu_k, 13, 12, d**-0.5, causal)
    before = sm90_bwd.backward_varlen(*args)
    assert not calls
    monkeypatch.setattr(sm90_bwd, "DQ_UNFRAGMENT_KERNEL", True)
    after = sm90_bwd.backward_varlen(*args)
    assert [t for t, _ in calls] == [tile]
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_varlen_query_tile_80_starts_on_whole_blocks(varlen_kernels, monkeypatch):
    # Packed sequences with the 80-row tile: each sequence's padded start a multiple of 80 (the
    # stand-in asserts 16-byte starts), gradients as the reference's.
    monkeypatch.setattr(sm90_bwd, "D128_TILE_M", 80)
    from hopper_fmha.reference import reference_varlen

    launches, keys = varlen_kernels
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs([70, 0, 93], [90, 5, 128], d=128)
    grads = sm90_bwd.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, 93, 128, 128**-0.5, False)
    assert keys[-1][11] == 80
    assert (sm90_bwd.padded_starts(cu_q.long(), 80) == torch.tensor([0, 80, 160, 400])).all()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, _ = reference_varlen(*leaves, cu_q, cu_k, softmax_scale=128**-0.5, dtype=torch.float64)
    for ours, r in zip(grads, torch.autograd.grad(o, leaves, dout.double()), strict=True):
        torch.testing.assert_close(ours.double(), r, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "head_dim, tile_m", [(64, 64), (64, 128), (128, 64), (128, 80)], ids=["d64", "d64-128", "d128", "d128-80"]
)
def test_row_stages_start_on_tma_alignment(head_dim, tile_m):
    # Each stage of sLSE / sD is the destination of a TMA load, which must start 128-byte aligned
    # in shared memory; tile_m 80's 320-byte stages, back to back, faulted on the GPU ("misaligned
    # address" from the second query block on).
    import cutlass

    kernel = BwdWsSm90(cutlass.BFloat16, head_dim, False, tile_m=tile_m)
    assert kernel.rows_stride >= tile_m
    assert (kernel.rows_stride * 4) % 128 == 0


def test_sass_hashes_configurations_bind_to_compile_bwd():
    # scripts/sass_hashes.py names compile_bwd's keyword arguments: they must stay its parameters.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "sass_hashes.py"
    spec = importlib.util.spec_from_file_location("sass_hashes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = inspect.signature(sm90_bwd.compile_bwd)
    configs = {**module.DENSE, **module.MORE}
    assert len(configs) == 21
    for name, kwargs in configs.items():
        signature.bind("bfloat16", **kwargs)  # raises TypeError on a name compile_bwd lacks
        assert kwargs["head_dim"] in (64, 128, 192, 256), name


@pytest.mark.parametrize("unscaled", [False, True], ids=["scaled", "unscaled"])
def test_varlen_dq_gather_kernel(varlen_kernels, monkeypatch, unscaled):
    """`VARLEN_DQ_GATHER`: dq from `dq_gather`'s kernel (here a torch stand-in behind its
    binding's checks) equals torch's cast-then-gather bit for bit (one fp32 product, rounded once)."""
    calls = []
    stub_dq_gather(monkeypatch, calls)
    monkeypatch.setattr(sm90_bwd, "DQ_SCALE_AT_CAST", unscaled)
    monkeypatch.setattr(sm90_bwd, "VARLEN_DQ_FRAGMENTS", False)  # (the row-order path's gather)
    monkeypatch.setattr(sm90_bwd, "VARLEN_DQ_GATHER", False)
    lq, lk = [70, 0, 1, 130], [90, 5, 0, 128]
    q, k, v, out, dout, lse, cu_q, cu_k = varlen_inputs(lq, lk)
    args = (q, k, v, out, dout, lse, cu_q, cu_k, 130, 128, 64**-0.5, False)
    before = sm90_bwd.backward_varlen(*args)
    assert not calls
    monkeypatch.setattr(sm90_bwd, "VARLEN_DQ_GATHER", True)
    after = sm90_bwd.backward_varlen(*args)
    assert calls == [64**-0.5 if unscaled else 1.0]
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("unscaled", [False, True], ids=["scaled", "unscaled"])
@pytest.mark.parametrize(
    "d, causal, tile, chains",
    [(64, False, T64, 1), (128, True, 64, 1), (64, True, T64, 1), (128, False, 80, 1), (128, True, 64, 3)],
)
@pytest.mark.parametrize("in_kernel", [False, True], ids=["torch-sum", "kernel-sum"])
def test_dq_unfragment_kernel_host(kernels, monkeypatch, d, causal, tile, chains, unscaled, in_kernel):
    """`DQ_UNFRAGMENT_KERNEL`: with fragments on, dq from `dq_unfragment`'s kernel (here a torch
    stand-in behind its binding's checks that places each unit by `unit_place`, the kernel's map)
    equals torch's un-permute bit for bit; tails included (sq 9 of a 64- or 128-row block).
    Deterministic `DQ_CHAINS` copies (session 43, `DQ_COPIES_IN_UNFRAGMENT`): the kernel adds
    them, in order (copy 0 + copy 1 + ...), in place of torch's sum before it (`sum_copies`): the
    same bits."""
    from hopper_fmha.kernels import dq_unfragment

    calls = []

    def compile_dq_unfragment(dtype_name, head_dim, tile_m, mapped, copies):
        assert not mapped
        fake = dq_unfragment.fake_arguments(dtype_name, head_dim)

        def run(acc, dq, scale, rows_map):
            assert_binds(fake[:2], (acc, dq), "dq_unfragment")
            assert rows_map is None
            calls.append((tile_m, scale, copies))
            b, sq, h, _ = dq.shape
            parts = acc.view(b, h, copies, -1).unbind(2)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            full = unfragment_by_map(total.reshape(-1), b, h, tile_m, head_dim)
            dq.copy_((full[:, :sq] * scale).to(dq.dtype))

        return run

    monkeypatch.setattr(dq_unfragment, "_compiled", {})
    monkeypatch.setattr(dq_unfragment, "compile_dq_unfragment", compile_dq_unfragment)
    monkeypatch.setattr(sm90_bwd, "DQ_FRAGMENTS", True)
    monkeypatch.setattr(sm90_bwd, "DQ_SCALE_AT_CAST", unscaled)
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS", {(d, d): chains})
    monkeypatch.setattr(sm90_bwd, "DQ_CHAINS_MASKED", True)
    monkeypatch.setattr(sm90_bwd, "DQ_COPIES_IN_UNFRAGMENT", in_kernel)
    q, k, v, out, dout, lse = inputs(sq=300, sk=300, d=d) if chains > 1 else inputs(d=d)
    args = (q, k, v, out, dout, lse, d**-0.5, causal)
    assert sm90_bwd.query_tile(2, d, masked=causal) == tile
    det = chains > 1  # (chains: deterministic mode's)
    before = sm90_bwd.backward(*args, version=2, deterministic=det)
    assert not calls
    monkeypatch.setattr(sm90_bwd, "DQ_UNFRAGMENT_KERNEL", True)
    after = sm90_bwd.backward(*args, version=2, deterministic=det)
    assert calls == [(tile, d**-0.5 if unscaled else 1.0, chains if in_kernel else 1)]
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_rotation_needs_a_heads_key_blocks_resident(monkeypatch):
    # One CTA per SM in both v2 kernels: a head's key blocks (128 keys, or the wide kernel's 64 /
    # 96) at most the SM count (HOST_SM_COUNT off the GPU), deterministic, no causal or window.
    sms = sm90_bwd.HOST_SM_COUNT
    assert [sm90_bwd.keys_per_cta(*dims) for dims in ((64, 64), (128, 128), (256, 256), (192, 128))] == [
        128, 128, 64, 96,
    ]  # fmt: skip
    cpu = torch.device("cpu")
    for dims, tile_n in (((128, 128), 128), ((256, 256), 64), ((192, 128), 96)):
        wide = dims[0] > 128
        for wide_rotate in (False, True):
            monkeypatch.setattr(sm90_bwd, "WIDE_ROTATE", wide_rotate)
            args = (True, 2, False, -1, -1)
            assert sm90_bwd.rotates(*args, sms * tile_n, cpu, *dims) == (wide_rotate or not wide)
            assert not sm90_bwd.rotates(*args, sms * tile_n + 1, cpu, *dims)
            assert not sm90_bwd.rotates(True, 2, True, -1, -1, tile_n, cpu, *dims)  # causal
            assert not sm90_bwd.rotates(False, 2, False, -1, -1, tile_n, cpu, *dims)
    # Not deterministic: only with `PLAIN_ROTATE`, at any length (no turns), never causal or windowed.
    monkeypatch.setattr(sm90_bwd, "PLAIN_ROTATE", True)
    for dims, tile_n in (((128, 128), 128), ((256, 256), 64)):
        assert sm90_bwd.rotates(False, 2, False, -1, -1, 2 * sms * tile_n, cpu, *dims)
        assert not sm90_bwd.rotates(False, 2, True, -1, -1, tile_n, cpu, *dims)
        assert not sm90_bwd.rotates(False, 2, False, 100, -1, tile_n, cpu, *dims)
        assert not sm90_bwd.rotates(False, 1, False, -1, -1, tile_n, cpu, *dims)


def test_qdo_multicast_takes_the_plain_dense_walk_only(monkeypatch):
    # `sm90_bwd.QDO_MULTICAST` (off by default): CTA pairs only where neighbouring key blocks walk
    # the same query blocks in the same order without turns; the kernels refuse anything else.
    import cutlass

    from hopper_fmha.kernels.sm90_bwd_wide import BwdWideSm90

    assert sm90_bwd.QDO_MULTICAST == frozenset()
    assert not sm90_bwd.multicasts(False, 2, False, -1, -1, False, 128)
    monkeypatch.setattr(sm90_bwd, "QDO_MULTICAST", frozenset({128, 256}))
    assert sm90_bwd.multicasts(False, 2, False, -1, -1, False, 128)
    assert sm90_bwd.multicasts(False, 2, False, -1, -1, False, 256)
    assert not sm90_bwd.multicasts(False, 2, False, -1, -1, False, 64)  # not listed
    for args in (
        (True, 2, False, -1, -1, False),  # deterministic: turns
        (False, 1, False, -1, -1, False),  # version 1
        (False, 2, True, -1, -1, False),  # causal: neighbours start at different blocks
        (False, 2, False, 100, -1, False),  # windows likewise
        (False, 2, False, -1, 0, False),
        (False, 2, False, -1, -1, True),  # rotated: different starts
    ):
        assert not sm90_bwd.multicasts(*args, 128), args
    bf16 = cutlass.BFloat16
    assert BwdWsSm90(bf16, 128, False, multicast=True).cluster_n == 2
    assert BwdWsSm90(bf16, 128, False).cluster_n == 1
    assert BwdWideSm90(bf16, 256, 256, False, multicast=True).cluster_n == 2
    for kwargs in (dict(causal=True), dict(deterministic=True), dict(varlen=True), dict(rotate=True)):
        with pytest.raises(AssertionError, match="multicast"):
            BwdWsSm90(bf16, 128, **{"causal": False, **kwargs}, multicast=True)
    with pytest.raises(AssertionError, match="multicast"):
        BwdWideSm90(bf16, 256, 256, False, window_left=True, multicast=True)


def test_disk_cache_names_follow_the_build(kernels, monkeypatch, tmp_path):
    # `cache.build_name`: a kernel module's constant (here dK/dV's TMA tiles) or a method (a
    # measurement's probe) changed in-process names another kernel, so a kernel built before the
    # change is not loaded after it, and the other way round; the stand-ins of these host tests
    # are not written to the disk cache.
    from hopper_fmha.kernels import cache, sm90_bwd_wide, sm90_bwd_ws

    key = ("bfloat16", 128, False, False, 2, True, False, False, False, False, False, 80, False, True, False)
    key += (128, True)
    modules = (sm90_bwd, sm90_bwd_ws, sm90_bwd_wide)
    before = cache.build_name("bwd", key, *modules)
    assert before == cache.build_name("bwd", key, *modules) and before.startswith("bwd_")
    assert cache.build_name("bwd", key[:-1] + (False,), *modules) != before
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sm90_bwd_ws, "DKV_TMA_TILES", (64,))
        constant = cache.build_name("bwd", key, *modules)
        patch.setattr(sm90_bwd_ws.BwdWsSm90, "reduce_dq", lambda self, *args: None)
        method = cache.build_name("bwd", key, *modules)
    assert len({before, constant, method}) == 3
    assert cache.build_name("bwd", key, *modules) == before
    monkeypatch.setenv("HOPPER_FMHA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "DISK_CACHE_ALL", True)
    monkeypatch.setattr(sm90_bwd, "compile_bwd", recording := _recording_compile())
    q, k, v, out, dout, lse = inputs(sq=70, sk=90, kv_heads=2, d=64)
    sm90_bwd.backward(q, k, v, out, dout, lse, 0.125, False)
    assert recording.calls and not list(tmp_path.rglob("*.o"))


def _recording_compile():
    """The stand-in compile patched in before (the `kernels` fixture's), counting its calls."""
    inner = sm90_bwd.compile_bwd

    def compile_bwd(*key):
        compile_bwd.calls += 1
        return inner(*key)

    compile_bwd.calls = 0
    return compile_bwd
