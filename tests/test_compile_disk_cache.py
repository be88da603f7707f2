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


# The backward's kernels and the small ones (`cache.load_or_compile`, named by `cache.build_name`,
# with `cache.DISK_CACHE_ALL`): the same round trip, with the argument count their launches pass
# (TVM-FFI's environment stream is not passed: one fewer than `fake_arguments`, as
# `binding_checked` in the host tests checks their launches).
BWD_CASES = {
    # compile_bwd's arguments after the dtype (bfloat16)
    "v1-d64-causal": dict(head_dim=64, head_dim_v=64, causal=True, version=1, mha=True),
    "v2-d128-tile80-writer": dict(
        head_dim=128, head_dim_v=128, causal=False, mha=True, tile_m=80, dq_unscaled=True, dq_writer=True
    ),
    "v2-d64-varlen-gqa": dict(
        head_dim=64, head_dim_v=64, causal=False, dkv_atomic=True, varlen=True, tile_m=128
    ),
}


def bwd_key(kwargs) -> tuple:
    """`sm90_bwd._kernel`'s key: compile_bwd's positional arguments, defaults filled in."""
    import inspect

    from hopper_fmha.kernels import sm90_bwd

    bound = inspect.signature(sm90_bwd.compile_bwd).bind("bfloat16", **kwargs)
    bound.apply_defaults()
    return tuple(v for name, v in bound.arguments.items() if name != "options")


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_backward_kernel_from_disk_takes_the_launch_argument_count(case, tmp_path, monkeypatch):
    from hopper_fmha.kernels import cache, sm90_bwd

    monkeypatch.setenv("HOPPER_FMHA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "DISK_CACHE_ALL", True)
    monkeypatch.setattr(sm90_bwd, "_compiled", {})
    key = bwd_key(BWD_CASES[case])
    assert len(key) == 20  # (compile_bwd's arguments but options)
    sm90_bwd._kernel(key)
    names = [p.name for p in cache.cache_dir().glob("bwd_*.o")]
    assert len(names) == 1
    assert cache.timings[names[0][:-2]][0] == "compile"
    sm90_bwd._compiled.clear()
    fn = sm90_bwd._kernel(key)
    assert cache.timings[names[0][:-2]][0] == "disk" and sm90_bwd._compiled[key] is fn
    fake = sm90_bwd.fake_arguments(sm90_bwd._DTYPES[key[0]], key[1], key[3], key[5], key[6], key[10], key[15])
    assert "argument #0" in _count_error(fn, len(fake) - 1)
    assert "parameters" in _count_error(fn, len(fake) - 2)


def test_small_kernel_from_disk_and_the_switch(tmp_path, monkeypatch):
    import torch

    from hopper_fmha.kernels import cache, dq_gather

    monkeypatch.setenv("HOPPER_FMHA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HOPPER_FMHA_DISK_CACHE_ALL", raising=False)
    acc, rows = torch.zeros(4, 2, 64), torch.zeros(3, dtype=torch.int64)
    refused = (TypeError, ValueError, RuntimeError)  # CPU tensors: the kernel refuses them, once fetched
    monkeypatch.setattr(dq_gather, "_compiled", {})
    monkeypatch.setattr(cache, "DISK_CACHE_ALL", False)
    with pytest.raises(refused):
        dq_gather.gather_dq(acc, rows, torch.bfloat16, 0.5)
    assert not list(tmp_path.rglob("*.o"))  # the switch off: compiled, not saved
    monkeypatch.setattr(cache, "DISK_CACHE_ALL", True)
    for source in ("compile", "disk"):
        dq_gather._compiled.clear()
        with pytest.raises(refused):
            dq_gather.gather_dq(acc, rows, torch.bfloat16, 0.5)
        (name,) = [p.name[:-2] for p in cache.cache_dir().glob("dq_gather_*.o")]
        assert cache.timings[name][0] == source
    monkeypatch.setenv("HOPPER_FMHA_DISK_CACHE_ALL", "0")  # the environment turns the default off
    before = cache.timings[name]
    dq_gather._compiled.clear()
    with pytest.raises(refused):
        dq_gather.gather_dq(acc, rows, torch.bfloat16, 0.5)
    assert cache.timings[name] is before  # compiled without the cache: no disk load recorded
