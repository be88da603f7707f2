"""Compile tier, head dims: every kernel pair of `config.WS_KERNEL_HEAD_DIMS` (q/k, v) at its
table tile, causal or not, and data dims that run a padded kernel (80 -> 96, 48/32 -> 64,
256/128 -> 256), compile for sm_90a without spills, loads and O's store by TMA.

Compiled, not run here: tests/test_gpu_head_dims.py checks the numbers on a Hopper GPU.
"""

import pytest
from test_compile_ws_features import inspected_without_spills  # noqa: E402  (tests/ is on sys.path)

from hopper_fmha import config
from hopper_fmha.kernels.cache import KernelKey

pytestmark = pytest.mark.compile

DIMS = [*config.WS_KERNEL_HEAD_DIMS, (80, 80), (48, 32), (256, 128)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", DIMS, ids=[f"{d}v{dv}" for d, dv in DIMS])
def test_head_dims_compile_without_spills(dims, causal, record_property):
    d, dv = dims
    cfg = config.launch_config(config.select_config(d, "ws", None, dv), causal, 4096)
    key = KernelKey.from_config("bfloat16", causal, cfg)
    assert (key.head_dim, key.head_dim_v or key.head_dim) == (d, dv)
    row = inspected_without_spills(key, record_property)
    assert row["utmaldg"] > 0 and row["utmastg"] > 0
    # GEMM-II's N is the kernel's v head dim.
    kd, kdv = cfg.kernel_dims
    assert any(shape.startswith(f"64x{kdv}x") for shape in row["hgmma_shapes"]), row["hgmma_shapes"]


def test_kernel_head_dims_cover_every_valid_pair():
    for d in range(8, 257, 8):
        for dv in range(8, d + 1, 8):
            kd, kdv = config.kernel_head_dims(d, dv)
            assert (kd, kdv) in config.WS_KERNEL_HEAD_DIMS and kd >= d and kdv >= dv
            # the smallest such pair: no kernel with fewer columns holds the data
            assert all(
                not (pd >= d and pdv >= dv) or (pd, pdv) >= (kd, kdv)
                for pd, pdv in config.WS_KERNEL_HEAD_DIMS
            )
            config.select_config(d, "ws", None, dv)  # every pair has a config that fits
