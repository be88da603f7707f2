"""Compile tier, split-KV combine (`kernels/combine.py`): the kernel compiles for sm_90a at both
dtypes, head dims whose rows fill the lanes (64, 128, 256) and one whose last round does not (72),
and the smallest and largest split bounds, without spills; each lane's loads of a group of splits
all issue before the first add (the launch bound that lets ptxas keep them in flight), and the
partials and outputs move as 128-bit vectors.

Compiled, not run here: tests/test_gpu_combine.py checks the numbers on a Hopper GPU.
"""

import re
import tempfile
import time

import pytest

from hopper_fmha.kernels.combine import (
    MAX_SPLITS,
    MIN_MAX_SPLITS,
    UNIT,
    CombineSm90,
    compile_combine,
    max_splits_for,
)
from hopper_fmha.kernels.inspect import kernel_resources, sass

pytestmark = pytest.mark.compile

_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[\w.]*)?)", re.M)


def inspected(dtype: str, head_dim_v: int, max_splits: int) -> dict:
    with tempfile.TemporaryDirectory() as dump_dir:
        t0 = time.perf_counter()
        compiled = compile_combine(
            dtype, head_dim_v, max_splits, options=f"--keep-cubin --dump-dir={dump_dir}"
        )
        seconds = time.perf_counter() - t0
    row = {
        "config": f"combine_{dtype}_v{head_dim_v}_s{max_splits}",
        "compile_s": seconds,
        **kernel_resources(compiled.artifacts.CUBIN),
    }
    try:
        opcodes = _OPCODE.findall(sass(compiled.artifacts.CUBIN))
    except RuntimeError as e:
        row["sass_missing"] = str(e)
        return row
    first_load = opcodes.index("LDG.E.128")
    first_add = next(i for i in range(first_load, len(opcodes)) if opcodes[i].startswith("FFMA"))
    row["ldg128"] = opcodes.count("LDG.E.128")
    row["ldg128_before_add"] = opcodes[first_load:first_add].count("LDG.E.128")
    row["stg128"] = opcodes.count("STG.E.128")
    row["local"] = sum(op.split(".")[0] in ("LDL", "STL") for op in opcodes)
    return row


@pytest.mark.parametrize("max_splits", [16, 128])
@pytest.mark.parametrize("head_dim_v", [64, 128, 256, 72])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_combine_compiles_without_spills(dtype, head_dim_v, max_splits, record_property):
    row = inspected(dtype, head_dim_v, max_splits)
    record_property("kernel_resources", row)
    assert row["stack_bytes"] == 0, f"{row['stack_bytes']} bytes of stack: registers spill"
    if "sass_missing" in row:
        pytest.skip(row["sass_missing"])
    assert row["local"] == 0, "local memory traffic (LDL/STL)"
    kernel = CombineSm90(None, head_dim_v, max_splits)
    loads = 2 * kernel.units_per_thread * kernel.splits_in_flight  # a unit is two 128-bit loads
    assert row["ldg128"] == loads and row["ldg128_before_add"] == loads, row
    assert row["stg128"] == kernel.units_per_thread, row


@pytest.mark.parametrize("head_dim_v", range(UNIT, 257, UNIT))
def test_tile_rule_covers_each_column_once(head_dim_v):
    """Every unit of 8 columns of a row belongs to exactly one (lane, round) inside the row; the
    weights fit the shared memory a launch gets without opting in (48 KB)."""
    k = CombineSm90(None, head_dim_v, MAX_SPLITS)
    units = [
        lane + u * k.threads_per_row for lane in range(k.threads_per_row) for u in range(k.units_per_thread)
    ]
    assert sorted(x for x in units if x < k.units) == list(range(head_dim_v // UNIT))
    assert k.num_threads == k.tile_m * k.threads_per_row in (64, 128)  # whole warps
    assert 32 % k.threads_per_row == 0  # a row's lanes share a warp: shuffles and __syncwarp suffice
    assert k.units_per_thread <= 2 and k.splits_in_flight * k.units_per_thread == 8
    assert k.tile_m * (MAX_SPLITS + 1) * 4 <= 48 * 1024


def test_max_splits_for():
    assert [max_splits_for(n) for n in (1, 2, 3, 16, 17, 32, 33, 100, 128)] == [
        16,
        16,
        16,
        16,
        32,
        32,
        64,
        128,
        128,
    ]
    assert max_splits_for(1) == MIN_MAX_SPLITS
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError):
            max_splits_for(bad)
    with pytest.raises(ValueError):
        CombineSm90(None, 12, 16)  # dv not a multiple of 8
