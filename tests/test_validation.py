"""flash_attn_func's argument rules, one test per rule, all on CPU tensors.

Every rule except the device ones is checked before the device, so CPU tensors reach each rule.
The plumbing tests replace the device check and the kernel launch with CPU stand-ins to run the
custom op, the stride conformance and the empty-input paths without a GPU.
"""

import dataclasses
import math

import pytest
import torch

from hopper_fmha import config, flash_attn_func, interface
from hopper_fmha.config import auto_tile, auto_variant, select_config
from hopper_fmha.reference import reference

pytestmark = pytest.mark.cpu


def qkv(batch=2, seqlen_q=5, seqlen_k=7, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


@pytest.fixture
def cpu_kernel(monkeypatch):
    """Run on CPU: skip the device check and launch a reference-based stand-in for the kernel.

    The stand-in asserts the kernel's input contract and records every launch.
    """
    launches = []

    def fake_launch(q, k, v, out, lse, softmax_scale, causal, cfg, exact_lse, features=None):
        for t in (q, k, v):
            assert t.stride(-1) == 1
            assert all(s > 0 and s % 8 == 0 for s in t.stride()[:-1])
            assert t.data_ptr() % 16 == 0
        assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == q.dtype
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        extra = {}
        if features is not None:
            assert cfg.variant == "ws"  # the only variant with score features
            assert not (causal and features.right >= 0)  # causal is the right limit 0
            if features.sink is not None:
                assert features.sink.dtype == torch.float32 and features.sink.is_contiguous()
            extra = dict(
                window_size=(features.left, features.right),
                softcap=features.softcap,
                learnable_sink=features.sink,
            )
        o, l = reference(q, k, v, softmax_scale, causal, **extra)
        out.copy_(o)
        lse.copy_(l)
        launches.append(
            dict(
                q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal, cfg=cfg, exact_lse=exact_lse,
                features=features,
            )
        )  # fmt: skip

    monkeypatch.setattr(interface, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(interface, "_launch", fake_launch)
    return launches


# ---- argument rules, in the order they are checked ----


def test_arguments_must_be_tensors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got ndarray"):
        flash_attn_func(q, k.numpy(), v)


def test_rank_4():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have rank 4.*got shape \(5, 4, 64\)"):
        flash_attn_func(q[0], k, v)


def test_dtype_fp16_or_bf16():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match=r"float16 or bfloat16, got torch.float32"):
        flash_attn_func(q, k, v)


def test_dtypes_equal():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"same dtype, got torch.float16, torch.bfloat16, torch.float16"):
        flash_attn_func(q, k.bfloat16(), v)


def test_batch_equal():
    q, k, v = qkv(batch=2)
    with pytest.raises(ValueError, match=r"same batch size, got 2, 1, 1"):
        flash_attn_func(q, k[:1], v[:1])


def test_k_v_shapes_equal():
    q, k, v = qkv(seqlen_k=7)
    with pytest.raises(
        ValueError,
        match=r"k and v must have the same \(batch, seqlen_k, kv_heads\).*\(2, 7, 2, 64\) and \(2, 6, 2, 6",
    ):
        flash_attn_func(q, k, v[:, :6])


def test_head_dim_equal():
    q, _, _ = qkv(head_dim=64)
    _, k, v = qkv(head_dim=128)
    with pytest.raises(ValueError, match=r"q and k must have the same head_dim, got 64 and 128"):
        flash_attn_func(q, k, v)


def test_heads_multiple_of_kv_heads():
    q, k, v = qkv(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match=r"multiple of the kv heads.*heads=4, kv_heads=3"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize(
    "head_dim,head_dim_v,match",
    [
        (100, 100, r"head_dim must be a multiple of 8 in \[8, 256\], got 100"),
        (264, 264, r"head_dim must be a multiple of 8 in \[8, 256\], got 264"),
        (64, 12, r"head_dim_v must be a multiple of 8 in \[8, 256\], got 12"),
        (128, 192, r"head_dim_v \(v's\) must be <= head_dim \(q's and k's\), got 192 > 128"),
    ],
)
def test_head_dims_supported(head_dim, head_dim_v, match):
    q, k, _ = qkv(head_dim=head_dim)
    v = qkv(head_dim=head_dim_v)[2]
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, k, v)


def test_paper_variant_head_dims():
    for d, dv in ((96, 96), (128, 64)):
        q, k, _ = qkv(head_dim=d)
        v = qkv(head_dim=dv)[2]
        with pytest.raises(ValueError, match=r"the paper variant's head dims are \(64, 128, 256\)"):
            flash_attn_func(q, k, v, variant="paper")


@pytest.mark.parametrize(
    "head_dim,head_dim_v,kernel_dims",
    [(96, 96, (96, 96)), (192, 128, (192, 128)), (192, 192, (192, 192)), (80, 80, (96, 96)),
     (48, 32, (64, 64)), (256, 128, (256, 256)), (8, 8, (64, 64)), (160, 96, (192, 128))],
)  # fmt: skip
def test_other_head_dims_run_the_ws_kernel_of_their_padded_dims(
    cpu_kernel, head_dim, head_dim_v, kernel_dims
):
    q, k, _ = qkv(head_dim=head_dim)
    v = qkv(head_dim=head_dim_v)[2]
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 5, 4, head_dim_v) and out.is_contiguous()
    ref_out, ref_lse = reference(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    cfg = cpu_kernel[0]["cfg"]
    assert cfg.variant == "ws" and cfg.head_dim == head_dim and cfg.value_dim == head_dim_v
    assert cfg.kernel_dims == kernel_dims
    assert config.kernel_head_dims(head_dim, head_dim_v) == kernel_dims


@pytest.mark.parametrize("scale", [True, "0.1"])
def test_softmax_scale_type(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"softmax_scale must be None or a float"):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", [math.nan, math.inf, 0.0, -0.125])
def test_softmax_scale_finite_positive(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"softmax_scale must be finite and > 0, got {scale!r}"):
        flash_attn_func(q, k, v, softmax_scale=scale)


def test_causal_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"causal must be a bool, got int 1"):
        flash_attn_func(q, k, v, causal=1)


def test_tile_rejected_by_config():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"tile 32x32 is not a paper-variant tile"):
        flash_attn_func(q, k, v, tile=(32, 32), variant="paper")
    with pytest.raises(ValueError, match=r"ws tile_m must be one of \(128, 192\).*got 32"):
        flash_attn_func(q, k, v, tile=(32, 32), variant="ws")


def test_tile_not_a_pair():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"tile must be a pair of ints.*got 128"):
        flash_attn_func(q, k, v, tile=128)


def test_variant_rejected_by_config():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"variant must be one of .*got 'fa3'"):
        flash_attn_func(q, k, v, variant="fa3")


def test_auto_tile_paper_for_short_problems():
    # 64x64 for d = 64 causal up to 1024 keys (five CTAs per SM) and 64x128 non-causal up to 512
    # (each measured faster there), the table's tile else; 1025 keys take the ws kernel anyway.
    assert auto_tile("paper", 64, True, 512) == (64, 64) and auto_tile("paper", 64, True, 1024) == (64, 64)
    assert auto_tile("paper", 64, True, 1025) is None and auto_tile("paper", 64, False, 1024) is None
    assert auto_tile("paper", 64, False, 512) == (64, 128) and auto_tile("paper", 64, False, 513) is None
    assert auto_tile("paper", 128, True, 256) is None and auto_tile("paper", 256, True, 512) is None
    assert auto_variant(64, True, 1024) == "paper" and auto_variant(64, True, 1025) == "ws"
    # An unknown variant gets no tile (select_config names the rule).
    assert auto_tile("fa3", 64, True, 512) is None


def test_auto_tile_ws_for_short_problems():
    # 128x128 for d = 64 causal up to 1024 keys, 128x64 for d = 256 up to 1024 keys (causal:
    # 2048) (measured faster there), the table's tile else.
    assert auto_tile("ws", 64, True, 512) == (128, 128) and auto_tile("ws", 64, True, 1024) == (128, 128)
    assert auto_tile("ws", 64, True, 1025) is None and auto_tile("ws", 64, False, 512) is None
    assert auto_tile("ws", 128, True, 512) is None and auto_tile("ws", 128, False, 512) is None
    assert auto_tile("ws", 256, False, 1024) == (128, 64) and auto_tile("ws", 256, False, 1025) is None
    assert auto_tile("ws", 256, True, 2048) == (128, 64) and auto_tile("ws", 256, True, 2049) is None


def test_split_o_where_a_whole_o_buffer_does_not_fit():
    # O through per-warpgroup buffers exactly where Q + K/V stages leave room for those but not
    # for a whole O tile: d = 256 at 128x64 (192 KiB + 32 KiB), not at 128x80 (224 KiB: neither
    # fits) nor at d = 64 / 128 (a whole O buffer fits).
    assert select_config(256, "ws", (128, 64)).split_o
    assert not select_config(256, "ws").split_o  # 128x80
    assert not select_config(128, "ws").split_o and not select_config(64, "ws").split_o
    assert not select_config(256, "paper").split_o
    # The kernel takes its own buffer choice from the same rule.
    from hopper_fmha.config import ws_o_buffer

    assert ws_o_buffer(256, 128, 80, 2) == "q" and ws_o_buffer(256, 128, 64, 2) == "split"
    assert ws_o_buffer(128, 128, 128, 2) == "own" and ws_o_buffer(64, 192, 128, 2) == "own"
    # Shared storage as the kernel lays it out (it asserts the same count when it compiles): 1 KiB
    # of mbarriers, then 1 KiB-aligned Q, O, ones, K and V, where an unused O or ones slot still
    # takes 1 KiB. d = 256 at 128x80 fills the 227 KiB exactly: 1 + 64 + 1 + 1 + 2 x 80 KiB.
    from hopper_fmha.config import SMEM_CAPACITY_BYTES, check_fits_ws, ws_smem_bytes

    assert ws_smem_bytes(256, 128, 80, 2) == SMEM_CAPACITY_BYTES == 227 * 1024
    assert ws_smem_bytes(256, 128, 64, 2, o_buffer="split") == (1 + 64 + 32 + 1 + 2 * 64) * 1024
    assert ws_smem_bytes(64, 192, 128, 2, o_buffer="own") == (1 + 24 + 24 + 1 + 2 * 32) * 1024
    # The row-sum block of ones (mma_rowsum, d = 64): 8 x tile_n, in whole KiB, in place of the
    # empty slot. Beside 128x80 at d = 256 it needs a KiB more than there is.
    assert ws_smem_bytes(64, 192, 128, 2, mma_rowsum=True) == ws_smem_bytes(64, 192, 128, 2) + 1024
    assert ws_smem_bytes(256, 128, 80, 2, mma_rowsum=True) == SMEM_CAPACITY_BYTES + 1024
    assert ws_o_buffer(64, 192, 128, 2, mma_rowsum=True) == "own"
    # The table's release of Q after the last GEMM-I holds where O has a buffer of its own or per
    # warpgroup, and is off (in the config and the kernel key) where O goes out through Q's.
    assert select_config(256, "ws").release_q_at_qk is False and select_config(256, "ws").tile == (128, 80)
    assert all(
        select_config(d, "ws", t).release_q_at_qk for d, t in ((64, None), (128, None), (256, (128, 64)))
    )
    for tile_n in (80, 96):
        with pytest.raises(ValueError, match="row-sum block of ones"):
            check_fits_ws(256, 128, tile_n, mma_rowsum=True)
    # What flash_attn_func resolves: no variant, no tile -> the paper kernel there (its short
    # causal tile, 64x64; non-causal 64x128 up to 512 keys, the table's 128x128 above); ws asked
    # for without a tile -> ws at 128x128; a tile asked for is kept.
    q = torch.zeros(1, 512, 2, 64, dtype=torch.float16)
    cfg = interface._validate(q, q, q, None, True, None, None)[1]
    assert (cfg.variant, cfg.tile) == ("paper", (64, 64))
    cfg = interface._validate(q, q, q, None, False, None, None)[1]
    assert (cfg.variant, cfg.tile) == ("paper", (64, 128))
    q1k = torch.zeros(1, 1024, 2, 64, dtype=torch.float16)
    cfg = interface._validate(q1k, q1k, q1k, None, False, None, None)[1]
    assert (cfg.variant, cfg.tile) == ("paper", (128, 128))
    assert interface._validate(q, q, q, None, True, "paper", (128, 128))[1].tile == (128, 128)
    cfg = interface._validate(q, q, q, None, True, "ws", None)[1]
    assert (cfg.variant, cfg.tile) == ("ws", (128, 128))
    assert interface._validate(q, q, q, None, True, "ws", (192, 128))[1].tile == (192, 128)
    long_q = torch.zeros(1, 2048, 2, 64, dtype=torch.float16)
    assert interface._validate(long_q, long_q, long_q, None, True, None, None)[1].tile == (192, 128)


def test_cta_pairs_only_where_they_apply():
    # The table's ws configs run as CTA pairs (K/V multicast) on non-causal problems whose query
    # tiles pair up; causal problems and odd tile counts launch the same config unpaired.
    from hopper_fmha.config import launch_config

    for d in (64, 128, 256):
        cfg = select_config(d, "ws")
        assert cfg.cluster_m == 2
        even = 2 * cfg.tile_m * 3  # six query tiles
        assert launch_config(cfg, False, even, exact_lse=False) is cfg
        assert launch_config(cfg, False, even - 1, exact_lse=False) is cfg  # the last tile short, still six
        assert launch_config(cfg, False, even + 1, exact_lse=False).cluster_m == 1  # seven tiles
        assert launch_config(cfg, True, even, exact_lse=False).cluster_m == 1
        # Nothing else changes, but for the switches a causal launch sets differently.
        assert launch_config(cfg, False, even + 1, exact_lse=False) == dataclasses.replace(cfg, cluster_m=1)
        causal_switches = config.WS_CAUSAL_SWITCHES.get(d, {})
        assert launch_config(cfg, True, even, exact_lse=False) == dataclasses.replace(
            cfg, cluster_m=1, **causal_switches
        )
    # d = 192 with dv = 128 runs pingpong causal only; d = 192 with dv = 192 never.
    d192 = select_config(192, "ws", None, 128)
    assert not launch_config(d192, False, 4096, exact_lse=False).pingpong
    assert launch_config(d192, True, 4096, exact_lse=False).pingpong
    assert not launch_config(select_config(192, "ws"), True, 4096, exact_lse=False).pingpong
    # d = 64 pins GEMM-II's wait and sums rows on the tensor cores non-causal only.
    d64 = select_config(64, "ws")
    assert launch_config(d64, False, 4096, exact_lse=False).pin_pv_wait == 8
    assert launch_config(d64, True, 4096, exact_lse=False).pin_pv_wait == 0
    assert launch_config(d64, False, 2048, exact_lse=False).mma_rowsum
    assert not launch_config(d64, True, 4096, exact_lse=False).mma_rowsum
    # d = 64 tiles are 192 rows: 2048 queries make 11 of them, 4096 make 22.
    assert launch_config(d64, False, 2048, exact_lse=False).cluster_m == 1
    assert launch_config(d64, False, 4096, exact_lse=False).cluster_m == 2


def test_exact_lse_takes_fp32_row_sums():
    # Row sums from the tensor cores sum P after its rounding to 16 bits: fine for out, off by up
    # to a few 1e-3 in the LSE. Where the LSE is returned (the default of launch_config), the
    # kernel sums in fp32; nothing else about the launch changes.
    from hopper_fmha.config import launch_config

    d64 = select_config(64, "ws")
    for causal, seqlen_q in ((False, 4096), (False, 2048), (True, 4096)):
        fast = launch_config(d64, causal, seqlen_q, exact_lse=False)
        exact = launch_config(d64, causal, seqlen_q)
        assert not exact.mma_rowsum
        assert exact == dataclasses.replace(fast, mma_rowsum=False)
    for d in (128, 256):
        cfg = select_config(d, "ws")
        assert launch_config(cfg, False, 4096) is launch_config(cfg, False, 4096, exact_lse=False)
    assert select_config(128, "paper").cluster_m == 1


def test_auto_variant_follows_the_measured_limits():
    # The paper kernel for short key sequences where it measured faster (d = 64 up to 1024 keys;
    # d = 128 causal up to 256), the ws kernel everywhere else.
    assert auto_variant(64, False, 1024) == "paper" and auto_variant(64, False, 1025) == "ws"
    assert auto_variant(64, True, 1024) == "paper" and auto_variant(64, True, 1025) == "ws"
    assert auto_variant(128, True, 256) == "paper" and auto_variant(128, True, 257) == "ws"
    assert auto_variant(128, False, 512) == "ws"
    assert auto_variant(256, False, 512) == "ws" and auto_variant(256, True, 512) == "ws"


# ---- device rules, checked last ----


def test_same_device():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"same device, got cpu, meta, cpu"):
        flash_attn_func(q, k.to("meta"), v)


def test_cuda_tensors():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"must be CUDA tensors, got device cpu"):
        flash_attn_func(q, k, v)


def test_hopper_arch(monkeypatch):
    monkeypatch.setattr(interface, "_HOPPER_DEVICES", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"sm_90.*NVIDIA A100-SXM4-80GB with compute capability 8.0"):
        interface._check_arch(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    interface._check_arch(torch.device("cuda", 0))
    assert interface._HOPPER_DEVICES == {0}


# ---- what reaches the kernel, and what comes back ----


@pytest.mark.parametrize("causal", [False, True])
def test_outputs_and_launch_arguments(cpu_kernel, causal):
    q, k, v = qkv()
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    (launch,) = cpu_kernel
    assert launch["softmax_scale"] == 64**-0.5 and launch["causal"] is causal
    # No variant asked for: the one auto_variant picks for this (short) problem, at its tile.
    variant = auto_variant(64, causal, k.shape[1])
    tile = auto_tile(variant, 64, causal, k.shape[1])
    assert launch["cfg"] == select_config(64, variant, tile)
    assert launch["q"] is q  # conforming inputs are passed through, not copied
    assert launch["exact_lse"] is True  # the LSE is returned: it must be exact
    assert torch.equal(flash_attn_func(q, k, v, causal=causal), out)
    assert cpu_kernel[-1]["exact_lse"] is False  # not returned: the kernel may take its fast path


@pytest.mark.parametrize(
    "head_dim, kwargs, match",
    [
        (64, None, None),
        (128, None, None),
        (96, None, None),
        (256, {}, "head dims up to 128"),
        (64, dict(softcap=5.0), None),
        (128, dict(window_size=(16, 0)), None),
    ],
    ids=["d64", "d128", "d96", "d256", "softcap", "window"],
)
def test_inputs_requiring_grad(cpu_kernel, monkeypatch, head_dim, kwargs, match):
    monkeypatch.setattr(interface.backward, "WIDE_BACKWARD", False)  # d256: refused with it off
    # An output without a grad_fn would silently cut the graph: the layers before the attention
    # would never learn. A call the backward serves gets a grad_fn (its gradients:
    # tests/test_autograd.py); one it does not serve raises NotImplementedError naming the rule,
    # before the forward runs. Under no_grad / inference_mode every call runs, without a grad_fn.
    q, k, v = qkv(head_dim=head_dim)
    kwargs = kwargs if kwargs is not None else {}
    for name in ("q", "k", "v"):
        args = {"q": q, "k": k, "v": v}
        args[name] = args[name].clone().requires_grad_()
        launched = len(cpu_kernel)
        if match is None:
            out = flash_attn_func(**args, **kwargs)
            assert out.grad_fn is not None and len(cpu_kernel) == launched + 1
            assert cpu_kernel[-1]["exact_lse"] is True  # the backward's input
        else:
            with pytest.raises(NotImplementedError, match=match + r".*torch\.no_grad\(\)"):
                flash_attn_func(**args, **kwargs)
            assert len(cpu_kernel) == launched  # refused before the forward
        with torch.no_grad():
            out = flash_attn_func(**args, **kwargs)
        assert not out.requires_grad
        with torch.inference_mode():
            flash_attn_func(**args, **kwargs)
    assert len(cpu_kernel) == (9 if match is None else 6)


def test_tile_and_scale_reach_kernel(cpu_kernel):
    q, k, v = qkv()
    flash_attn_func(q, k, v, softmax_scale=0.5, tile=[64, 64], variant="paper")
    assert cpu_kernel[0]["softmax_scale"] == 0.5 and cpu_kernel[0]["cfg"].tile == (64, 64)
    assert cpu_kernel[0]["cfg"].variant == "paper"


def _misaligned(t):
    """t's values in a buffer whose data starts 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


@pytest.mark.parametrize("arg", [0, 1, 2], ids=["q", "k", "v"])
@pytest.mark.parametrize(
    "make,conforming",
    [
        # A view at a 1-row offset: strides and alignment conform, so no copy is made.
        pytest.param(lambda t: torch.cat([t[:, :1], t], dim=1).narrow(1, 1, t.shape[1]), True, id="view"),
        pytest.param(lambda t: t.transpose(1, 3).contiguous().transpose(1, 3), False, id="last-dim-strided"),
        pytest.param(
            lambda t: torch.nn.functional.pad(t, (0, 4)).narrow(3, 0, 64), False, id="head-stride-68"
        ),
        pytest.param(_misaligned, False, id="misaligned-data"),
    ],
)
def test_non_conforming_strides_are_copied(cpu_kernel, arg, make, conforming):
    inputs = list(qkv())
    expected = reference(*inputs)[0].to(torch.float16)
    inputs[arg] = make(inputs[arg])
    out = flash_attn_func(*inputs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    passed = cpu_kernel[0]["qkv"[arg]]
    assert torch.equal(passed, inputs[arg])
    assert (passed is inputs[arg]) == conforming


@pytest.mark.parametrize(
    "batch,seqlen_q,heads,kv_heads",
    [(0, 5, 4, 2), (2, 0, 4, 2), (2, 5, 0, 2)],
    ids=["batch-0", "seqlen_q-0", "heads-0"],
)
def test_empty_inputs_give_empty_outputs(cpu_kernel, batch, seqlen_q, heads, kv_heads):
    q, k, v = qkv(batch=batch, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    assert cpu_kernel == []


@pytest.mark.parametrize("causal", [False, True])
def test_no_keys_give_zero_out_and_minus_inf_lse(cpu_kernel, causal):
    q, k, v = qkv(seqlen_k=0)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, torch.full((2, 4, 5), -math.inf))
    assert cpu_kernel == []


# ---- score features: window_size, softcap, learnable_sink ----


@pytest.mark.parametrize("window", [(-2, -1), (3, -5)])
def test_window_sides_at_least_minus_one(window):
    with pytest.raises(ValueError, match=r"window_size (left|right) must be >= -1"):
        flash_attn_func(*qkv(), window_size=window)


@pytest.mark.parametrize("window", [5, (1, 2, 3), "ab"])
def test_window_is_a_pair(window):
    with pytest.raises((ValueError, TypeError), match="window_size"):
        flash_attn_func(*qkv(), window_size=window)


def test_window_sides_are_ints():
    with pytest.raises(TypeError, match="window_size left must be an int"):
        flash_attn_func(*qkv(), window_size=(1.5, 2))


@pytest.mark.parametrize("cap", [-1.0, math.inf, math.nan])
def test_softcap_finite_non_negative(cap):
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        flash_attn_func(*qkv(), softcap=cap)


@pytest.mark.parametrize(
    "sink,error,match",
    [
        ([0.1] * 4, TypeError, "learnable_sink must be None or a torch.Tensor"),
        (torch.zeros(4, dtype=torch.int32), TypeError, "learnable_sink must be a float tensor"),
        (torch.zeros(2), ValueError, r"learnable_sink must have shape \(heads,\) = \(4,\)"),
        (torch.zeros(1, 4), ValueError, "learnable_sink must have shape"),
    ],
    ids=["list", "int32", "kv-heads", "rank-2"],
)
def test_sink_is_a_float_tensor_per_q_head(sink, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*qkv(), learnable_sink=sink)


def test_paper_variant_refuses_score_features():
    for kwargs in (dict(window_size=(2, 1)), dict(softcap=5.0), dict(learnable_sink=torch.zeros(4))):
        with pytest.raises(
            ValueError, match="the paper variant has no sliding window, softcap or learnable_sink"
        ):
            flash_attn_func(*qkv(), variant="paper", **kwargs)


def test_sink_requiring_grad_makes_the_call_differentiable(cpu_kernel):
    # A sink that requires grad (q, k, v not) makes the call differentiable: the output has a
    # grad_fn and the forward ran with the exact LSE (the sink's gradient: tests/test_autograd.py).
    sink = torch.zeros(4, requires_grad=True)
    out = flash_attn_func(*qkv(), learnable_sink=sink)
    assert out.grad_fn is not None and cpu_kernel[-1]["exact_lse"] is True
    with torch.no_grad():
        assert flash_attn_func(*qkv(), learnable_sink=sink).grad_fn is None
    assert len(cpu_kernel) == 2


@pytest.mark.parametrize(
    "causal,window,softcap,sink,launched",
    [
        # (causal, right, left, softcap, sink) the kernel is launched with; -1: no limit.
        (False, (2, 1), 0.0, False, (False, 2, 1, 0.0, False)),
        (False, (-1, 0), 0.0, False, (True, -1, -1, 0.0, False)),  # (-1, 0) is causal
        (False, (3, 0), 0.0, False, (True, 3, -1, 0.0, False)),  # a right limit 0 is causal's mask
        (True, (3, 4), 0.0, False, (True, 3, -1, 0.0, False)),  # causal sets right = 0
        (False, (6, 4), 0.0, False, None),  # no row reaches past either side (7 keys, 5 rows)
        (False, (6, -1), 7.5, False, (False, -1, -1, 7.5, False)),
        (True, (-1, -1), 0.0, True, (True, -1, -1, 0.0, True)),
        (False, [-1, -1], 30.0, True, (False, -1, -1, 30.0, True)),
    ],
)
def test_score_features_reach_the_kernel(cpu_kernel, causal, window, softcap, sink, launched):
    q, k, v = qkv()  # 5 query rows, 7 keys
    sink_t = torch.linspace(-1.0, 2.0, 4, dtype=torch.bfloat16) if sink else None
    out, lse = flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink_t, return_lse=True
    )
    ref_out, ref_lse = reference(
        q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink_t
    )
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    (launch,) = cpu_kernel
    f = launch["features"]
    if launched is None:
        assert f is None and launch["causal"] is causal
        return
    kernel_causal, left, right, cap, has_sink = launched
    assert launch["causal"] is kernel_causal
    if (left, right, cap, has_sink) == (-1, -1, 0.0, False):
        assert f is None
    else:
        assert (f.left, f.right, f.softcap, f.sink is not None) == (left, right, cap, has_sink)
        assert launch["cfg"].variant == "ws"


def test_window_zero_zero_sees_the_diagonal_only(cpu_kernel):
    q, k, v = qkv(seqlen_q=7, seqlen_k=7)
    out = flash_attn_func(q, k, v, window_size=(0, 0))
    # Row i sees key i alone: out is v of that key (per GQA group).
    expected = v.repeat_interleave(2, dim=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-3)


def test_no_keys_with_a_sink_give_the_sink_as_lse(cpu_kernel):
    q, k, v = qkv(seqlen_k=0)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, sink[None, :, None].expand(2, 4, 5))
    ref_lse = reference(q, k, v, learnable_sink=sink)[1]
    torch.testing.assert_close(lse, ref_lse)


def test_torch_compile_traces_the_op_with_score_features(cpu_kernel):
    q, k, v = qkv()
    sink = torch.linspace(-1.0, 1.0, 4)
    compiled = torch.compile(
        lambda q, k, v, s: flash_attn_func(
            q, k, v, window_size=(3, 1), softcap=4.0, learnable_sink=s, return_lse=True
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    out, lse = compiled(q, k, v, sink)
    ref_out, ref_lse = reference(q, k, v, window_size=(3, 1), softcap=4.0, learnable_sink=sink)
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    assert cpu_kernel[-1]["features"].left == 3


def test_torch_compile_traces_the_op(cpu_kernel):
    # aot_eager traces through the fake implementation without needing a C++ compiler.
    q, k, v = qkv()
    compiled = torch.compile(
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True),
        fullgraph=True,
        backend="aot_eager",
    )
    out, lse = compiled(q, k, v)
    ref_out, ref_lse = reference(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


@pytest.mark.parametrize(
    "head_dim,head_dim_v,seqlen_k,kwargs",
    [
        (64, 64, 7, dict(causal=True)),
        (128, 128, 2048, dict()),
        (64, 64, 7, dict(variant="ws", causal=True)),
        (64, 64, 7, dict(variant="ws", tile=(128, 128))),
        (96, 96, 7, dict()),
        (64, 32, 7, dict()),
    ],
    ids=["paper", "ws-auto", "ws", "ws-tile", "ws-padded", "ws-head-dim-v"],
)
def test_torch_compile_fullgraph_selects_every_config(cpu_kernel, head_dim, head_dim_v, seqlen_k, kwargs):
    # Under torch.compile the config is selected inside the traced code (select_config unwrapped),
    # so every path through it must trace without a graph break (torch 2.11's Dynamo cannot trace
    # hash() of a tuple nor min() of a generator).
    q = torch.randn(1, 5, 2, head_dim).to(torch.float16)
    k = torch.randn(1, seqlen_k, 2, head_dim).to(torch.float16)
    v = torch.randn(1, seqlen_k, 2, head_dim_v).to(torch.float16)
    compiled = torch.compile(
        lambda q, k, v: flash_attn_func(q, k, v, **kwargs), fullgraph=True, backend="aot_eager"
    )
    out = compiled(q, k, v)
    causal = kwargs.get("causal", False)
    torch.testing.assert_close(out, reference(q, k, v, causal=causal)[0].to(q.dtype))
    _, eager_cfg = interface._validate(q, k, v, None, causal, kwargs.get("variant"), kwargs.get("tile"))
    assert cpu_kernel[-1]["cfg"] == eager_cfg


def test_fake_matches_real_metadata():
    q, k, v = qkv()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, lse = torch.ops.hopper_fmha.fwd(fq, fk, fv, 0.125, False, "paper", 128, 64, True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == q.stride()
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_ws_switches_are_declared_everywhere():
    # Every switch in config.WS_SWITCHES is a field of KernelConfig and KernelKey and a keyword of
    # WsFwdSm90, with one default, and a field of WsChoice unless derived from the tile.
    import dataclasses
    import inspect

    from hopper_fmha import config
    from hopper_fmha.kernels.cache import KernelKey

    choice_fields = {f.name for f in dataclasses.fields(config.WsChoice)}
    cfg_defaults = {f.name: f.default for f in dataclasses.fields(config.KernelConfig)}
    from hopper_fmha.kernels.sm90_ws import WsFwdSm90

    kernel_params = inspect.signature(WsFwdSm90.__init__).parameters
    for name in config.WS_SWITCHES:
        assert (name in choice_fields) == (name not in config.WS_DERIVED_SWITCHES)
        assert KernelKey._field_defaults[name] == cfg_defaults[name] == kernel_params[name].default
    # from_config passes them in this order, then v's head dim
    assert KernelKey._fields[6:] == (*config.WS_SWITCHES, "head_dim_v")
    key = KernelKey.from_config("float16", False, config.select_config(128, "ws"))
    assert key.pin_pv_wait == config.WS_TILE_TABLE[128].pin_pv_wait > 0


def test_auto_config_is_the_choice_of_auto_variant_and_auto_tile():
    # flash_attn_func caches the automatic choice on seqlen_k capped at AUTO_SEQLEN_K_CAP: the
    # cap must lie above every limit the choice depends on.
    from hopper_fmha.config import AUTO_SEQLEN_K_CAP, auto_config

    lengths = sorted({1, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 2050, 4096, 10**6})
    for d in config.SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            for n in lengths:
                variant = auto_variant(d, causal, n)
                expected = select_config(d, variant, auto_tile(variant, d, causal, n))
                assert auto_config(d, causal, min(n, AUTO_SEQLEN_K_CAP)) == expected, (d, causal, n)


def test_kernel_config_hash_follows_its_fields():
    a = select_config(128, "ws")
    b = dataclasses.replace(a)
    assert a == b and hash(a) == hash(b)
    c = dataclasses.replace(a, pin_pv_wait=a.pin_pv_wait + 1)
    assert c != a and len({a, b, c}) == 2


def test_kernel_config_hash_is_computed_once_on_first_use():
    # Not at construction (torch.compile traces the construction), then cached: a config that keys
    # the per-call caches is not hashed field by field on every call.
    cfg = config.KernelConfig("ws", 128, 128, 128)
    assert "_hash" not in vars(cfg)
    h = hash(cfg)
    assert vars(cfg)["_hash"] == h == hash(tuple(getattr(cfg, f.name) for f in dataclasses.fields(cfg)))
    object.__setattr__(cfg, "_hash", 12345)  # the cached value is what later calls return
    assert hash(cfg) == 12345
    assert "_hash" not in vars(dataclasses.replace(cfg))


@pytest.mark.parametrize(
    "batch,heads,kv_heads",
    [(7, 4, 2), (3, 9, 3), (2, 9, 1), (2, 8, 2), (1, 14, 2)],
    ids=["batch", "heads-gqa", "heads-mqa-group-past-limit", "groups-past-limit", "heads-two-groups"],
)
def test_grid_parts_cover_every_batch_and_head_once(batch, heads, kv_heads):
    # The paper kernel launches batches and head counts past the grid's 65535 in parts; here with
    # a limit of 3, each part run by a stand-in that computes the reference on its views, mapping
    # q head h of the part to kv head h // (its q heads // its kv heads) as the kernel does.
    from hopper_fmha.kernels import grid_parts

    q, k, v = qkv(batch=batch, seqlen_q=3, seqlen_k=5, heads=heads, kv_heads=kv_heads)
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, heads, 3), math.nan)
    for pq, pk, pv, po, pl in grid_parts(q, k, v, out, lse, limit=3):
        assert pq.shape[0] <= 3 and pq.shape[2] <= 3 and pq.shape[2] % pk.shape[2] == 0
        o, l = reference(pq, pk, pv, 0.5, False)
        po.copy_(o)
        pl.copy_(l)
    # Each (batch, head) in exactly one part: count the parts that write it.
    out_count, lse_count = torch.zeros(batch, 1, heads, 1), torch.zeros(batch, heads, 1)
    for *_, po, pl in grid_parts(q, k, v, out_count, lse_count, limit=3):
        po += 1
        pl += 1
    assert torch.equal(out_count, torch.ones_like(out_count))
    assert torch.equal(lse_count, torch.ones_like(lse_count))
    # Within round-off, not bitwise: the reference's batched float32 matmuls over a part and over
    # the whole may sum in different orders (MKL picks kernels by shape and threads; seen failing
    # bitwise on a loaded 2-core machine). A wrong head or batch mapping is off by O(1).
    ref_out, ref_lse = reference(q, k, v, 0.5, False)
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
