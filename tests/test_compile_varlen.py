"""Compile tier, packed variable-length sequences: the ws kernel with `varlen` (and seqused_k,
and with score features) compiles for sm_90a at the table's configs, each head dim, causal or
not, without spills, and still issues its loads by TMA and stores O by TMA (the ragged view).

Compiled, not run here: tests/test_gpu_varlen.py checks the numbers on a Hopper GPU.
"""

import pytest
from test_compile_ws_features import inspected_without_spills  # noqa: E402  (tests/ is on sys.path)

from hopper_fmha.config import SUPPORTED_HEAD_DIMS, launch_config, select_config
from hopper_fmha.kernels import feature_key, score_features, varlen_key
from hopper_fmha.kernels.cache import KernelKey

pytestmark = pytest.mark.compile


def varlen_keys(head_dim, causal, seqused_k=False, features=None) -> KernelKey:
    cfg = launch_config(select_config(head_dim, "ws"), causal, 4096, exact_lse=True)
    key = KernelKey.from_config("bfloat16", causal, cfg)
    if features is not None:
        key = feature_key(key, score_features(causal, *features))
    return varlen_key(key, seqused_k)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_varlen_compiles_without_spills(head_dim, causal, record_property):
    key = varlen_keys(head_dim, causal, seqused_k=causal)
    assert (
        key.varlen
        and key.seqused_k == causal
        and key.slug().endswith("_varlen" + ("_used" if causal else ""))
    )
    row = inspected_without_spills(key, record_property)
    assert row["hgmma_ss"] > 0 and row["hgmma_rs"] > 0
    assert row["utmaldg"] > 0 and row["utmastg"] > 0, "loads and O's store by TMA"


def test_varlen_with_score_features_compiles(record_property):
    key = varlen_keys(128, True, features=((256, -1), 30.0, "sink"))
    assert (key.window, key.softcap, key.sink, key.varlen) == ("left", True, True, True)
    inspected_without_spills(key, record_property)


def test_varlen_key_leaves_the_dense_keys_alone():
    cfg = launch_config(select_config(128, "ws"), False, 4096)
    key = KernelKey.from_config("float16", False, cfg)
    assert not key.varlen and not key.seqused_k and "varlen" not in key.slug()
    assert varlen_key(key, False) == key._replace(varlen=True)


def test_varlen_tile_counter_compiles(record_property):
    # `tile_counter` (`kernels.VARLEN_TILE_COUNTER`, on since session 25): non-causal packed
    # sequences take their tiles from the global counter as causal ones do, so the kernel gains the
    # counter's atomics (the fetch, and the last CTA's reset) and nothing else.
    import tempfile

    from hopper_fmha.kernels.cache import compile_kernel
    from hopper_fmha.kernels.inspect import sass

    plain = varlen_keys(128, False)._replace(cluster_m=1)  # the counter deals tiles to single CTAs
    counted = plain._replace(tile_counter=True)
    assert counted.slug() == plain.slug() + "_ctr"
    texts = []
    for key in (plain, counted):
        inspected_without_spills(key, record_property)
        with tempfile.TemporaryDirectory() as dump:
            texts.append(sass(compile_kernel(key, options=f"--keep-cubin --dump-dir={dump}").artifacts.CUBIN))
    assert "ATOMG" not in texts[0] and "ATOMG" in texts[1]
