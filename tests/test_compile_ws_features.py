"""Compile tier, ws variant's score features: sliding window, softcap and a learnable sink compile
for sm_90a at the table's tiles, each head dim, without spills; their defaults leave the keys
(and so the kernels and disk-cache names) of before unchanged.

Compiled, not run here: tests/test_gpu_ws_features.py checks the numbers on a Hopper GPU.
"""

import functools
import re
import tempfile
import time

import pytest

from hopper_fmha.config import SUPPORTED_HEAD_DIMS, launch_config, select_config
from hopper_fmha.kernels import feature_key, score_features
from hopper_fmha.kernels.cache import KernelKey, compile_kernel
from hopper_fmha.kernels.inspect import kernel_resources, sass, sass_summary

pytestmark = pytest.mark.compile

# (name, causal, window, softcap, learnable sink): each feature alone, a window with and without
# causal, and all three together. A sink stands in as a string (only its presence matters here).
FEATURES = [
    ("left", False, (32, -1), 0.0, None),
    ("right", False, (-1, 16), 0.0, None),
    ("both", False, (100, 7), 0.0, None),
    ("left_causal", True, (64, -1), 0.0, None),
    ("softcap", False, None, 30.0, None),
    ("sink", False, None, 0.0, "sink"),
    ("all", False, (100, 7), 30.0, "sink"),
    ("all_causal", True, (100, -1), 30.0, "sink"),
]


def feature_keys(head_dim: int, causal: bool, window, softcap, sink, dtype="bfloat16") -> KernelKey:
    cfg = launch_config(select_config(head_dim, "ws"), causal, 4096, exact_lse=True)
    features = score_features(causal, window, softcap, sink)
    return feature_key(KernelKey.from_config(dtype, causal, cfg), features)


@functools.cache
def inspected(key: KernelKey) -> dict:
    with tempfile.TemporaryDirectory() as dump_dir:
        t0 = time.perf_counter()
        compiled = compile_kernel(key, options=f"--keep-cubin --dump-dir={dump_dir}")
        seconds = time.perf_counter() - t0
    row = {"config": key.slug(), "compile_s": seconds, **kernel_resources(compiled.artifacts.CUBIN)}
    try:
        text = sass(compiled.artifacts.CUBIN)
    except RuntimeError as e:
        row["sass_missing"] = str(e)
        return row
    row.update(sass_summary(text))
    row["tanh"] = len(re.findall(r"MUFU\.TANH", text))
    return row


def inspected_without_spills(key: KernelKey, record_property) -> dict:
    """`inspected(key)`, recorded for the tier's register table, after asserting that ptxas put
    nothing on the stack and, where the SASS can be read (else the test skips), that no local
    memory is touched."""
    row = inspected(key)
    record_property("kernel_resources", row)
    assert row["stack_bytes"] == 0, f"{row['stack_bytes']} bytes of stack: registers spill"
    if "sass_missing" in row:
        pytest.skip(row["sass_missing"])
    assert row["ldl"] == 0 and row["stl"] == 0, f"local memory traffic: {row['ldl']} LDL, {row['stl']} STL"
    return row


# d = 96 (192 x 112 since session 24): its 192 x 112 spills 72-136 bytes with a left limit and 8
# with softcap, 192 x 96 still 8-24 with a left limit; both take 192 x 80 (`FEATURE_TILE_N`).
NARROW_TILE_N = {64: (128, 96), 96: (112, 80)}


@pytest.mark.parametrize("head_dim", [*SUPPORTED_HEAD_DIMS, 96])
@pytest.mark.parametrize("name,causal,window,softcap,sink", FEATURES, ids=[f[0] for f in FEATURES])
def test_feature_compiles_without_spills(head_dim, name, causal, window, softcap, sink, record_property):
    key = feature_keys(head_dim, causal, window, softcap, sink)
    assert key.softcap == bool(softcap) and key.sink == (sink is not None)
    if window is not None:
        assert key.window and key.cluster_m == 1
    if head_dim in NARROW_TILE_N:
        narrow = key.window in ("left", "both") or key.softcap
        assert key.tile_n == NARROW_TILE_N[head_dim][narrow]
    row = inspected_without_spills(key, record_property)
    assert row["hgmma_ss"] > 0 and row["hgmma_rs"] > 0
    assert (row["tanh"] > 0) == bool(softcap), "softcap's tanh.approx (MUFU.TANH) where softcap is on only"


def test_defaults_leave_keys_unchanged():
    """No feature: score_features says so, the key and its slug are those of before."""
    assert score_features(False) is None
    assert score_features(True, (-1, -1), 0.0, None) is None
    assert score_features(True, (-1, 5)) is None  # causal's right limit wins: no window side left
    for head_dim in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            cfg = launch_config(select_config(head_dim, "ws"), causal, 4096)
            key = KernelKey.from_config("float16", causal, cfg)
            assert (key.window, key.softcap, key.sink, key.features) == ("", False, False, False)
            assert not re.search(r"win|softcap|sink", key.slug())
    key = KernelKey("float16", 64, 192, 128, False, "ws")
    assert key.slug() == "ws_float16_d64_192x128_full_s2_ov_pp"


def test_feature_keys():
    base = KernelKey("bfloat16", 256, 128, 80, True, "ws", causal_trim=True)
    left = feature_key(base, score_features(True, (10, -1)))
    assert left == base._replace(window="left", causal_trim=False)
    full = KernelKey("bfloat16", 128, 128, 128, False, "ws", cluster_m=2)
    assert feature_key(full, score_features(False, (-1, 0))) == full._replace(window="right", cluster_m=1)
    assert feature_key(full, score_features(False, None, 5.0)) == full._replace(softcap=True)
    key = feature_key(full, score_features(False, (3, 4), 5.0, "sink"))
    assert key.slug().endswith("_winboth_softcap_sink")
    d64 = KernelKey("bfloat16", 64, 192, 128, False, "ws", cluster_m=2)
    assert feature_key(d64, score_features(False, (-1, 3))).tile_n == 128
    assert feature_key(d64, score_features(False, None, 0.0, "sink")).tile_n == 128
    assert feature_key(d64, score_features(False, (3, -1))).tile_n == 96
    assert feature_key(d64, score_features(True, None, 2.0)).tile_n == 96
