"""hopper-fmha: fused multi-head attention forward for NVIDIA Hopper, in CUTLASS CuTe DSL."""

from importlib.metadata import PackageNotFoundError, version

from hopper_fmha.interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

try:
    __version__ = version("hopper-fmha")
except PackageNotFoundError:  # running from a source tree that was not pip-installed
    __version__ = "unknown"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "__version__"]
