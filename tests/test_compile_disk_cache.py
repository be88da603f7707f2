"""Compile tier: a ws kernel loaded back from the disk cache takes the arguments the launch
functions pass.

An object file from `cache._store_to_disk`, loaded by `cache._load_from_disk`, checks the argument
count against its compiled parameter list, while the kernel `cute.compile` returns in-process fills
missing trailing parameters with their defaults. So every launch must pass all of them: a shorter
list worked in the process that compiled the kernel and failed in every later one (the GPU tier of
2026-11-24, "Expects 23 parameters"). The count is checked before any argument is converted, so this
runs without a GPU.
"""

import pytest

from hopper_fmha.config import select_config
from hopper_fmha.kernels import extra_arguments, feature_key, score_features
from hopper_fmha.kernels.cache import KernelKey, get_kernel

pytestmark = pytest.mark.compile

# The ws launches: dense (`launch_arguments`), a score feature, varlen, and the decode kernels.
CASES = {
    "dense": {},
    "softcap": {"softcap": True},
    "varlen": {"varlen": True},
    "split-paged": {"seqused_k": True, "split_kv": True, "paged": True, "cluster_m": 1},
}


def _count_error(fn, count: int) -> str:
    """The TypeError's text when `fn` is called with `count` Nones."""
    with pytest.raises(TypeError) as info:
        fn(*([None] * count))
    return str(info.value)


@pytest.mark.parametrize("changes", list(CASES.values()), ids=list(CASES))
def test_kernel_from_disk_takes_the_launch_argument_count(changes, tmp_path, monkeypatch):
    from hopper_fmha.kernels import cache

    monkeypatch.setenv("HOPPER_FMHA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_memory", {})
    key = KernelKey.from_config("bfloat16", False, select_config(64, "ws"))._replace(**changes)
    get_kernel(key)  # compiles and stores
    assert cache.timings[key][0] == "compile"
    cache._memory.clear()
    fn = get_kernel(key)  # loads the object file
    assert cache.timings[key][0] == "disk"

    features = score_features(False, None, 2.0, None) if key.softcap else None
    passed = 11 + len(extra_arguments(key, features, (None,) * 4, (None, None), 2, None))
    # With the launch's count, the call gets past the count check to the first argument's type.
    assert "argument #0" in _count_error(fn, passed)
    assert "parameters" not in _count_error(fn, passed)
    # One fewer is refused by count: the check this test relies on is there.
    assert "parameters" in _count_error(fn, passed - 1)


def test_dense_launch_passes_every_parameter():
    """`launch_arguments` (the dense ws call, and the features' call) ends with the twelve."""
    from hopper_fmha.kernels import NO_EXTRAS

    assert len(NO_EXTRAS) == 12
    key = feature_key(
        KernelKey.from_config("bfloat16", False, select_config(64, "ws")),
        score_features(False, (3, 4), 0.0, None),
    )
    assert len(extra_arguments(key, score_features(False, (3, 4), 0.0, None), (None,) * 4)) == 12
