"""Kernel dispatch: compile (or load from cache) the CuTe DSL kernel for a config and launch it.

Contract used by `hopper_fmha.interface` (inputs are already validated there):

    forward(q, k, v, out, lse, softmax_scale, causal, cfg) -> None

q: (B, Sq, H, D), k and v: (B, Sk, Hkv, D), CUDA fp16/bf16, last dim contiguous, other strides
multiples of 8 elements, 16-byte aligned data. out: preallocated like q. lse: preallocated
(B, H, Sq) float32. cfg: `hopper_fmha.config.KernelConfig`. Writes out and lse in place.

One compiled kernel per key (dtype, head_dim, tile_m, tile_n, causal, variant, and the ws
variant's stages/overlap/pingpong switches); batch, sequence lengths, head counts and strides
are runtime values. Compiled kernels are kept in memory and,
as TVM-FFI object files, on disk (`cache_dir()`), so a second process loads instead of compiling.
"""

from __future__ import annotations

import os

# CuTe DSL reads the target arch once, at import. Our kernels only exist for sm_90a, which is
# also right on a CPU-only machine, where it lets the kernels compile for inspection.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from .cache import KernelKey, cache_dir, clear_cache, compile_kernel, get_kernel  # noqa: E402, F401
from .inspect import compile_report  # noqa: E402, F401


def forward(q, k, v, out, lse, softmax_scale: float, causal: bool, cfg) -> None:
    fn = get_kernel(KernelKey.from_config(_DTYPE_NAMES[q.dtype], causal, cfg))
    fn(q, k, v, out, lse, softmax_scale, q.shape[2] // k.shape[2])


class _DtypeNames(dict):
    """torch dtype -> "float16"/"bfloat16", filled on first use so that importing needs no torch."""

    def __missing__(self, dtype):
        name = str(dtype).removeprefix("torch.")
        self[dtype] = name
        return name


_DTYPE_NAMES = _DtypeNames()
