"""Compile tier: the kernels compile for sm_90a, without a GPU, into the kernel the paper describes.

Each config is compiled once per session (`inspected`) and shared by the tests that read it; the
registers per thread of every kernel compiled here are printed in pytest's terminal summary.
"""

import functools

import pytest

from hopper_fmha import cli
from hopper_fmha.config import PAPER_TILES, SUPPORTED_HEAD_DIMS, check_fits, fitting_tiles
from hopper_fmha.kernels.cache import KernelKey
from hopper_fmha.kernels.inspect import inspect_kernel
from hopper_fmha.kernels.layouts import PAPER_LISTING, layout_values, paper_layouts, parse_layout
from hopper_fmha.kernels.sm90_paper import CTAS_PER_SM

pytestmark = pytest.mark.compile

# Every config the package can launch: dtype and causal change the generated code, the tile and
# head dim change the register budget.
SHIPPED = [
    KernelKey(dtype, head_dim, tile_m, tile_n, causal, "paper")
    for head_dim in SUPPORTED_HEAD_DIMS
    for tile_m, tile_n in fitting_tiles(head_dim)
    for dtype in ("float16", "bfloat16")
    for causal in (False, True)
]


@functools.cache
def inspected(key: KernelKey) -> dict:
    return inspect_kernel(key)


@pytest.mark.parametrize("key", SHIPPED, ids=KernelKey.slug)
def test_shipped_config_is_the_paper_kernel(key, record_property):
    row = inspected(key)
    record_property("kernel_resources", row)
    assert row["stack_bytes"] == 0, f"{row['stack_bytes']} bytes of stack: registers spill"
    if row["ok"] is None:
        pytest.skip(row["note"])
    assert row["hgmma_ss"] > 0, "no SS-WGMMA (GEMM-I, Q and K from shared memory)"
    assert row["hgmma_rs"] > 0, "no RS-WGMMA (GEMM-II, P from registers)"
    assert row["utmaldg"] > 0, "no TMA load"
    assert row["ldl"] == 0 and row["stl"] == 0, f"local memory traffic: {row['ldl']} LDL, {row['stl']} STL"
    assert row["ok"]


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("tile", PAPER_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_register_model_agrees_with_ptxas(head_dim, tile, record_property):
    # Causal: the larger of the two code paths (it adds the diagonal mask).
    row = inspected(KernelKey("float16", head_dim, *tile, True, "paper"))
    record_property("kernel_resources", row)
    try:
        check_fits(head_dim, *tile)
        accepted = True
    except ValueError:
        accepted = False
    no_spill = row["stack_bytes"] == 0
    assert accepted == no_spill, (
        f"check_fits {'accepts' if accepted else 'rejects'} d={head_dim} {tile[0]}x{tile[1]}, but ptxas "
        f"used {row['registers']} registers and {row['stack_bytes']} bytes of stack"
    )


@pytest.mark.parametrize("tiles", list(PAPER_LISTING), ids=lambda t: "x".join(map(str, t)))
def test_layouts_match_the_paper(tiles):
    ours = paper_layouts(*tiles)
    for name, text in PAPER_LISTING[tiles].items():
        paper = parse_layout(text)
        assert ours[name][0] == paper[0], f"{name}: shape {ours[name][0]}, the paper's {paper[0]}"
        # The same function on the same domain: a size-1 mode's stride may print differently.
        assert layout_values(*ours[name]) == layout_values(*paper), (
            f"{name}: {ours[name]} vs the paper's {text}"
        )


def test_layouts_command(capsys):
    assert cli.main(["layouts"]) == 0
    out = capsys.readouterr().out
    for name in ("tSrS", "tOrS", "tOrPLayout"):
        assert out.count(name) == len(PAPER_LISTING), out
    assert "DIFFERENT" not in out


@pytest.mark.parametrize(
    "shape", sorted(CTAS_PER_SM), ids=lambda s: f"d{s[0]}_{s[1]}x{s[2]}_{'causal' if s[3] else 'full'}"
)
def test_ctas_per_sm_target_fits(shape, record_property):
    """A kernel compiled for k CTAs per SM allocates at most 65536 / (128 k) registers per thread
    (in steps of 8), without spilling: the launch bound reached ptxas."""
    head_dim, tile_m, tile_n, causal = shape
    ctas = CTAS_PER_SM[shape]
    row = inspected(KernelKey("bfloat16", head_dim, tile_m, tile_n, causal, "paper"))
    record_property("kernel_resources", row)
    allocated = -(-row["registers"] // 8) * 8
    assert allocated * 128 * ctas <= 65536, (
        f"{row['registers']} registers: {ctas} CTAs of 128 threads do not fit"
    )
    assert row["stack_bytes"] == 0 and row["ldl"] == 0 and row["stl"] == 0, "registers spill"
