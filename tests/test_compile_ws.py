"""Compile tier, ws variant: the shipped configs compile for sm_90a into the FlashAttention-3 design.

SASS facts checked per shipped config: GEMM-I as SS-WGMMA and GEMM-II as RS-WGMMA (HGMMA with a
descriptor / register A operand), TMA loads and the TMA store, setmaxnreg honoured (USETMAXREG
TRY_ALLOC for consumers, DEALLOC for the producer), no local memory (LDL/STL) and no stack; the
intra-warpgroup overlap (a `wait_group(1)`: WARPGROUP.DEPBAR.LE gsb0, 0x1) and the pingpong
barriers (BAR.ARV) where the config switches them on. Each config is compiled once per session.
"""

import functools
import re
import tempfile
import time
from dataclasses import replace

import pytest

from hopper_fmha.config import (
    SUPPORTED_HEAD_DIMS,
    WS_CAUSAL_SWITCHES,
    WS_DERIVED_SWITCHES,
    WS_SHORT_TILE,
    WS_SWITCHES,
    WS_TILE_TABLE,
    check_fits_ws,
    launch_config,
    select_config,
)
from hopper_fmha.kernels.cache import KernelKey, compile_kernel
from hopper_fmha.kernels.inspect import kernel_resources, sass, sass_summary

pytestmark = pytest.mark.compile


def key_for(cfg, dtype: str, causal: bool) -> KernelKey:
    return KernelKey.from_config(dtype, causal, cfg)


# dtype and causal change the generated code; the head dim changes tile, budget and switches.
# Without and with an exact LSE (return_lse): d = 64 non-causal then sums rows in fp32.
SHIPPED = list(
    dict.fromkeys(
        [
            key_for(launch_config(select_config(head_dim, "ws"), causal, 4096, exact_lse=e), dtype, causal)
            for head_dim in SUPPORTED_HEAD_DIMS
            for dtype in ("float16", "bfloat16")
            for causal in (False, True)
            for e in (False, True)
        ]
        + [  # the short-problem tiles (d = 256's with O through per-warpgroup buffers)
            key_for(launch_config(select_config(head_dim, "ws", tile), causal, 1024), dtype, causal)
            for (head_dim, causal), (_, tile) in sorted(WS_SHORT_TILE.items())
            for dtype in ("float16", "bfloat16")
        ]
    )
)
# Tiles at the edges of both register budgets (causal: the larger code path), for the model
# check: per head dim and tile_m, the largest tile_n the model accepts and the next one, which spills.
EDGE_TILES = [(64, (192, 128)), (64, (192, 144)), (128, (128, 192)), (128, (128, 208)), (128, (192, 96))]


@functools.cache
def inspected(key: KernelKey) -> dict:
    with tempfile.TemporaryDirectory() as dump_dir:
        t0 = time.perf_counter()
        compiled = compile_kernel(key, options=f"--keep-cubin --dump-dir={dump_dir}")
        seconds = time.perf_counter() - t0
    # "registers" is the entry allocation (65536 / threads); setmaxnreg then moves them between roles.
    row = {"config": key.slug(), "compile_s": seconds, **kernel_resources(compiled.artifacts.CUBIN)}
    try:
        text = sass(compiled.artifacts.CUBIN)
    except RuntimeError as e:
        row["sass_missing"] = str(e)
        return row
    row.update(sass_summary(text))
    row["setmaxreg_alloc"] = len(re.findall(r"USETMAXREG\.TRY_ALLOC", text))
    row["setmaxreg_dealloc"] = len(re.findall(r"USETMAXREG\.DEALLOC", text))
    row["wait_group_1"] = len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b", text))
    # Pingpong arrives; named barriers 5 and 6 (the tile-index hand-off) do not count.
    row["bar_arrive"] = len(re.findall(r"\bBAR\.ARV\b(?! 0x[56]\b)", text))
    row["tma_multicast"] = len(re.findall(r"UTMALDG\.\S*MULTICAST", text))
    # ptxas serializes WGMMAs it cannot keep asynchronous (a wait after every HGMMA).
    row["wait_group_0"] = len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", text))
    return row


@pytest.mark.parametrize("key", SHIPPED, ids=KernelKey.slug)
def test_shipped_ws_config(key, record_property):
    row = inspected(key)
    record_property("kernel_resources", row)
    assert row["stack_bytes"] == 0, f"{row['stack_bytes']} bytes of stack: registers spill"
    if "sass_missing" in row:
        pytest.skip(row["sass_missing"])
    assert row["ldl"] == 0 and row["stl"] == 0, f"local memory traffic: {row['ldl']} LDL, {row['stl']} STL"
    assert row["hgmma_ss"] > 0, "no SS-WGMMA (GEMM-I, Q and K from shared memory)"
    assert row["hgmma_rs"] > 0, "no RS-WGMMA (GEMM-II, P from registers)"
    assert row["utmaldg"] > 0 and row["utmastg"] > 0, "no TMA load or no TMA store"
    assert row["setmaxreg_alloc"] > 0 and row["setmaxreg_dealloc"] > 0, (
        "setmaxnreg ignored: launch needs min_blocks_per_mp=1"
    )
    assert (row["wait_group_1"] > 0) == key.intra_wg_overlap, "intra-warpgroup overlap switch not in the SASS"
    assert (row["bar_arrive"] > 0) == key.pingpong, "pingpong switch not in the SASS"
    # CTA pairs: K/V loads multicast (non-causal); causal keys launch unpaired.
    assert key.cluster_m == (1 if key.causal else WS_TILE_TABLE[key.head_dim].cluster_m)
    assert (row["tma_multicast"] > 0) == (key.cluster_m > 1), "K/V multicast switch not in the SASS"
    hgmma = row["hgmma_ss"] + row["hgmma_rs"]
    assert row["wait_group_0"] < hgmma / 2, f"{row['wait_group_0']} waits for {hgmma} HGMMAs: serialized"
    # causal_trim at tile_n a multiple of 32: the first block of a tile may run GEMM-I at tile_n / 2.
    if key.causal and key.causal_trim and key.tile_n % 32 == 0:
        assert f"64x{key.tile_n // 2}x16" in row["hgmma_shapes"], "no GEMM-I over half a key block"


@pytest.mark.parametrize(
    "head_dim,tile", EDGE_TILES, ids=lambda x: x if isinstance(x, int) else f"{x[0]}x{x[1]}"
)
def test_ws_register_model_agrees_with_ptxas(head_dim, tile, record_property):
    choice = WS_TILE_TABLE[head_dim]
    choice = replace(choice, cluster_m=1, **WS_CAUSAL_SWITCHES.get(head_dim, {}))  # as launched causal
    switches = {name: getattr(choice, name) for name in WS_SWITCHES if name not in WS_DERIVED_SWITCHES}
    row = inspected(KernelKey("float16", head_dim, *tile, True, "ws", **switches))
    record_property("kernel_resources", row)
    try:
        check_fits_ws(head_dim, *tile)
        accepted = True
    except ValueError:
        accepted = False
    no_spill = row["stack_bytes"] == 0
    assert accepted == no_spill, (
        f"check_fits_ws {'accepts' if accepted else 'rejects'} d={head_dim} {tile[0]}x{tile[1]}, but ptxas "
        f"used {row['stack_bytes']} bytes of stack"
    )
