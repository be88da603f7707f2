"""Compiling kernels and caching them in memory and on disk.

The disk cache holds TVM-FFI object files, one per `KernelKey` (the forward kernels) or per
`build_name` (the backward's, the combine's and the small kernels'), under a folder whose name is
a fingerprint of everything that changes generated code: this package's kernel sources and the
versions of nvidia-cutlass-dsl and apache-tvm-ffi. Writes are atomic (temp file + rename), so
concurrent processes at worst compile the same kernel twice.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
import time
import warnings
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

from hopper_fmha.config import WS_SWITCHES, kernel_head_dims

# The switch values of a KernelConfig, in KernelKey's field order (one C call on the per-call path).
_ws_switches = attrgetter(*WS_SWITCHES)


class KernelKey(NamedTuple):
    dtype: str  # "float16" | "bfloat16"
    head_dim: int
    tile_m: int
    tile_n: int
    causal: bool
    variant: str
    # The "ws" variant's compile-time switches (ignored, and left at these defaults, for "paper").
    num_stages: int = 2
    intra_wg_overlap: bool = True
    pingpong: bool = True
    rescale_o_early: bool = False
    pin_pv_wait: int = 0
    cluster_m: int = 1
    split_o: bool = False
    mma_rowsum: bool = False
    causal_trim: bool = False
    release_q_at_qk: bool = False
    # Score features of the "ws" variant (switches too), off by default (the kernels and slugs of
    # before them).
    # window: which sides of a sliding window have a limit ("", "left", "right", "both"; causal is
    # the right limit 0, so causal keys take "" or "left"); the sizes are launch arguments.
    window: str = ""
    softcap: bool = False  # s = cap * tanh(softmax_scale * q.k / cap), the cap a launch argument
    sink: bool = False  # a learnable per-head sink logit, an (h,) float32 launch argument
    # Packed variable-length sequences (`kernels/seqlen.py`): q, k, v, out (total, h, d), lse
    # (h, total_q), cu_seqlens_q/k and max_seqlen_q launch arguments; seqused_k adds (batch,) int32.
    varlen: bool = False
    seqused_k: bool = False
    # Split-KV: launch arguments mOPartial, mLSEPartial (float32 workspaces) and num_splits.
    split_kv: bool = False
    # Pack-GQA: the q heads per kv head whose rows share a tile (1: none).
    pack_gqa: int = 1
    # Paged K/V: k, v (num_pages, page_size, h_kv, d) and a page_table launch argument. 0: not
    # paged; n >= 1: n pages per key block (1: tile_n divides page_size; n > 1: page_size = tile_n / n).
    paged: int = 0
    # Non-causal tiles from the global tile counter (causal ones always are).
    tile_counter: bool = False
    # v's head dim where it differs from q's (0: the same). head_dim and head_dim_v are the data's;
    # the ws kernel computes with `config.kernel_head_dims` of them.
    head_dim_v: int = 0

    @property
    def features(self) -> bool:
        """Whether the key has a score feature: its kernel takes the features' launch arguments."""
        return bool(self.window) or self.softcap or self.sink

    @property
    def sequence_arguments(self) -> bool:
        """Whether its kernel takes the sequences' launch arguments (cu_seqlens_q/k, seqused_k,
        max_seqlen_q; those it does not use None), which split_kv's follow."""
        return self.varlen or self.seqused_k or self.split_kv or self.paged

    @classmethod
    def from_config(cls, dtype: str, causal: bool, cfg) -> KernelKey:
        """The key of `cfg` (a `hopper_fmha.config.KernelConfig`) for a dtype name and mask."""
        return cls(
            dtype,
            cfg.head_dim,
            cfg.tile_m,
            cfg.tile_n,
            causal,
            cfg.variant,
            *_ws_switches(cfg),
            cfg.head_dim_v,
        )

    def slug(self) -> str:
        c = "causal" if self.causal else "full"
        dv = f"v{self.head_dim_v}" if self.head_dim_v and self.head_dim_v != self.head_dim else ""
        slug = f"{self.variant}_{self.dtype}_d{self.head_dim}{dv}_{self.tile_m}x{self.tile_n}_{c}"
        if self.variant == "ws":
            overlap = "ov" if self.intra_wg_overlap else "noov"
            pingpong = "pp" if self.pingpong else "nopp"
            slug += f"_s{self.num_stages}_{overlap}_{pingpong}" + ("_early" if self.rescale_o_early else "")
            slug += f"_pin{self.pin_pv_wait}" if self.pin_pv_wait else ""
            slug += f"_cl{self.cluster_m}" if self.cluster_m > 1 else ""
            slug += "_splitO" if self.split_o else ""
            slug += "_msum" if self.mma_rowsum else ""
            slug += "_trim" if self.causal and self.causal_trim else ""
            slug += "_relq" if self.release_q_at_qk else ""
            slug += f"_win{self.window}" if self.window else ""
            slug += "_softcap" if self.softcap else ""
            slug += "_sink" if self.sink else ""
            slug += "_varlen" if self.varlen else ""
            slug += "_used" if self.seqused_k else ""
            slug += "_splitkv" if self.split_kv else ""
            slug += f"_pack{self.pack_gqa}" if self.pack_gqa > 1 else ""
            slug += ("_paged" if self.paged == 1 else f"_paged{self.paged}") if self.paged else ""
            slug += "_ctr" if self.tile_counter and not self.causal else ""
        return slug


_memory: dict[KernelKey, Any] = {}
# The per-call lookup of `kernels.prepared_launch`: (id(config), torch dtype, causal) -> (config,
# compiled kernel). Cleared with `_memory`.
by_config: dict[tuple, tuple] = {}
_lock = threading.RLock()
# Seconds spent on the last compile or disk load of each key (for `info` and `bench --profile`).
timings: dict[KernelKey, tuple[str, float]] = {}


def dsl_flavor() -> str:
    """The CUDA toolkit flavor of the loaded CuTe DSL ("cu12"/"cu13"): its compiler makes the SASS.

    With both installed the DSL takes the newest the driver supports (the newest without one).
    The two ptxas versions schedule the same kernel differently (NOTES.md, "ws v3"); our H200
    measurements use cu13.
    """
    import re

    from cutlass._mlir import _mlir_libs

    module = getattr(_mlir_libs, "_cutlass_ir", None)
    found = re.search(r"\.(cu\d+)\.", getattr(module, "__file__", "") or "")
    return found.group(1) if found else "unknown"


def _fingerprint() -> str:
    import cutlass
    import tvm_ffi

    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(str(getattr(cutlass, "__version__", "")).encode())
    h.update(str(getattr(tvm_ffi, "__version__", "")).encode())
    h.update(dsl_flavor().encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where compiled kernels live: $HOPPER_FMHA_CACHE_DIR or ~/.cache/hopper_fmha, per fingerprint."""
    root = os.environ.get("HOPPER_FMHA_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hopper_fmha"
    )
    return Path(root) / _fingerprint()


def _kernel_object(key: KernelKey):
    import cutlass

    from .sm90_paper import PaperFwdSm90
    from .sm90_ws import WsFwdSm90

    dtype = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[key.dtype]
    if key.variant == "paper":
        return PaperFwdSm90(dtype, key.head_dim, key.tile_m, key.tile_n, key.causal), dtype
    if key.variant == "ws":
        switches = {name: getattr(key, name) for name in WS_SWITCHES}
        kd, kdv = kernel_head_dims(key.head_dim, key.head_dim_v or key.head_dim)
        kernel = WsFwdSm90(dtype, kd, key.tile_m, key.tile_n, key.causal, **switches, head_dim_v=kdv)
        return kernel, dtype
    raise ValueError(f"unknown kernel variant {key.variant!r}")


def fake_arguments(key: KernelKey, *, tvm_ffi: bool = True):
    """Compile-time stand-ins for (q, k, v, out, lse, scale, qhead_per_kvhead, [ws: max_ctas,
    lpt_group, tile_counters, counter_slot,] stream[, ws: window_left, window_right, softcap,
    learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, out_partial,
    lse_partial, num_splits, page_table]).

    A ws kernel takes all twelve after the stream, None where its key does not use one
    (`kernels.extra_arguments` passes the same): an object file loaded from the disk cache checks
    the count. Varlen: q, k, v, out (total, h, d) and lse (h, total_q).

    Batch, sequence lengths and head counts are symbolic, so one compiled kernel serves them all;
    strides are symbolic 64-bit values divisible by 8 elements (16 bytes, as TMA requires).
    """
    import cutlass
    import cutlass.cute as cute

    _, dtype = _kernel_object(key)
    b, sq, sk, h, hkv = (cute.sym_int() for _ in range(5))
    d = key.head_dim
    dv = key.head_dim_v or d

    def bshd(seqlen, heads, d=d):
        stride = (
            cute.sym_int64(divisibility=8),
            cute.sym_int64(divisibility=8),
            cute.sym_int64(divisibility=8),
            1,
        )
        return cute.runtime.make_fake_tensor(dtype, (b, seqlen, heads, d), stride=stride, assumed_align=16)

    def packed(total, heads, d=d):
        stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
        return cute.runtime.make_fake_tensor(dtype, (total, heads, d), stride=stride, assumed_align=16)

    if key.paged:
        pages, page_size = cute.sym_int(), cute.sym_int()
        q, o = bshd(sq, h), bshd(sq, h, dv)
        k = cute.runtime.make_fake_tensor(
            dtype,
            (pages, page_size, hkv, d),
            stride=(*(cute.sym_int64(divisibility=8) for _ in range(3)), 1),
            assumed_align=16,
        )
        v = cute.runtime.make_fake_tensor(
            dtype,
            (pages, page_size, hkv, dv),
            stride=(*(cute.sym_int64(divisibility=8) for _ in range(3)), 1),
            assumed_align=16,
        )
        lse = cute.runtime.make_fake_tensor(
            cutlass.Float32, (b, h, sq), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
        )
    elif key.varlen:
        q, k, v, o = packed(sq, h), packed(sk, hkv), packed(sk, hkv, dv), packed(sq, h, dv)
        lse = cute.runtime.make_fake_tensor(
            cutlass.Float32, (h, sq), stride=(cute.sym_int64(), 1), assumed_align=4
        )
    else:
        q, k, v, o = bshd(sq, h), bshd(sk, hkv), bshd(sk, hkv, dv), bshd(sq, h, dv)
        lse = cute.runtime.make_fake_tensor(
            cutlass.Float32, (b, h, sq), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
        )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    scalars = (cutlass.Float32(1.0), cutlass.Int32(1))
    if key.variant == "ws":  # max_ctas, lpt_group (hopper_fmha.kernels.schedule), tile counters, slot
        counters = cute.runtime.make_fake_tensor(
            cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4
        )
        scalars += (cutlass.Int32(0), cutlass.Int32(0), counters, cutlass.Int32(0))
    features = ()
    if key.variant == "ws":  # the twelve after the stream, None where the key does not take them

        def int32_vector():
            return cute.runtime.make_fake_tensor(
                cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4
            )

        sink = None
        if key.sink:
            sink = cute.runtime.make_fake_tensor(cutlass.Float32, (h,), stride=(1,), assumed_align=4)
        features = (
            cutlass.Int32(0) if key.window in ("left", "both") else None,
            cutlass.Int32(0) if key.window in ("right", "both") else None,
            cutlass.Float32(1.0) if key.softcap else None,
            sink,
        )
        used = int32_vector() if key.seqused_k else None
        if key.varlen:
            features += (int32_vector(), int32_vector(), used, cutlass.Int32(1))
        else:
            features += (None, None, used, None)
        if key.split_kv:
            splits = cute.sym_int()
            o_partial = cute.runtime.make_fake_tensor(
                cutlass.Float32,
                (splits, b, sq, h, dv),
                stride=tuple(cute.sym_int64(divisibility=4) for _ in range(4)) + (1,),
                assumed_align=16,
            )
            lse_strides = (*(cute.sym_int64() for _ in range(3)), 1)
            lse_partial = cute.runtime.make_fake_tensor(
                cutlass.Float32, (splits, b, h, sq), stride=lse_strides, assumed_align=4
            )
            features += (o_partial, lse_partial, cutlass.Int32(1))
        else:
            features += (None, None, None)
        page_table = None
        if key.paged:
            page_table = cute.runtime.make_fake_tensor(
                cutlass.Int32, (b, cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4
            )
        features += (page_table,)
    return (q, k, v, o, lse, *scalars, stream, *features)


def compile_kernel(key: KernelKey, *, tvm_ffi: bool = True, options: str = ""):
    """Compile the kernel for `key` (no caching). Works without a GPU."""
    import cutlass.cute as cute

    kernel, _ = _kernel_object(key)
    opts = " ".join(o for o in ("--enable-tvm-ffi" if tvm_ffi else "", options) if o)
    return cute.compile(kernel, *fake_arguments(key, tvm_ffi=tvm_ffi), options=opts)


_runtime_loaded = False


def _load_runtime_libraries() -> None:
    # Object files loaded from disk resolve CUDA-runtime symbols from the DSL's runtime libraries;
    # those must be loaded with RTLD_GLOBAL first or dlopen reports undefined symbols.
    global _runtime_loaded
    if _runtime_loaded:
        return
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    _runtime_loaded = True


def _load_from_disk(name: str, path: Path):
    import cutlass.cute as cute

    _load_runtime_libraries()
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, name)


def _store_to_disk(name: str, fn, path: Path) -> None:
    export = getattr(fn, "export_to_c", None)
    if export is None:  # a stand-in for a kernel (host tests): memory only
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".o", dir=path.parent)
    os.close(fd)
    try:
        export(tmp, function_name=name)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _disk_or_compile(name: str, compile_fn, timing_key):
    """The kernel exported as `name`: loaded from this fingerprint's folder, else compiled by
    `compile_fn()` and saved there; `timings[timing_key]` says which and how long."""
    path = cache_dir() / f"{name}.o"
    t0 = time.perf_counter()
    if path.exists():
        try:
            fn = _load_from_disk(name, path)
            timings[timing_key] = ("disk", time.perf_counter() - t0)
            return fn
        except Exception:  # a stale or truncated file: recompile and overwrite it
            pass
    fn = compile_fn()
    timings[timing_key] = ("compile", time.perf_counter() - t0)
    try:
        _store_to_disk(name, fn, path)
    except Exception as e:  # (a read-only folder, or an export the DSL refuses): memory only
        warnings.warn(f"hopper_fmha: kernel {name} not saved to {path.parent}: {e}", stacklevel=2)
    return fn


def _hash_value(h, where: str, value) -> None:
    """A function (a property's getter, a static or class method's function) by where it was
    defined, its module and qualified name: a method replaced in-process by a function defined
    elsewhere (a measurement's probe) changes it; the fingerprint covers the files' own code. (Not
    by its bytecode: the CuTe DSL rewrites a `cute.jit` function's code when it first compiles.)
    A plain value by its repr, or its type where the repr carries an address."""
    value = getattr(value, "fget", None) or getattr(value, "__func__", value)
    if callable(value):
        qualname = getattr(value, "__qualname__", type(value).__name__)
        h.update(f"{where}->{getattr(value, '__module__', None)}.{qualname};".encode())
    else:
        text = repr(value)
        h.update(f"{where}={type(value).__name__ if ' at 0x' in text else text};".encode())


def build_name(prefix: str, key, *modules) -> str:
    """A C identifier for a kernel outside `KernelKey` (the backward's, the combine's, the small
    kernels'): `prefix` and a hash of its compile key and of what `modules` (those its build
    reads) hold now: their upper-case module-level values (tile sizes, stages, register split,
    `DKV_TMA_TILES`...), where their functions and their classes' methods come from, and their
    classes' other attributes. So a kernel built after any of these was changed in-process (a
    measurement patching a constant or a method, a test) is never loaded for another; the
    fingerprint folder covers the files."""
    h = hashlib.sha256(repr(key).encode())
    for module in modules:
        home = module.__name__
        for name, value in sorted(vars(module).items()):
            if isinstance(value, type):
                if value.__module__ == home:
                    for attr, member in sorted(vars(value).items()):
                        if attr not in ("__dict__", "__weakref__", "__doc__", "__module__"):
                            _hash_value(h, f"{home}.{name}.{attr}", member)
            elif callable(value):
                if getattr(value, "__module__", None) == home:
                    _hash_value(h, f"{home}.{name}", value)
            elif name.lstrip("_").isupper():
                _hash_value(h, f"{home}.{name}", value)
    return f"{prefix}_{h.hexdigest()[:24]}"


# Kernels outside `KernelKey` on disk too (`load_or_compile`): on since its GPU run (session 30,
# H200: the backward tiers passed twice, the second run loading every kernel from disk). Off
# (False here, or HOPPER_FMHA_DISK_CACHE_ALL=0), they are compiled once per process.
DISK_CACHE_ALL = True


def load_or_compile(prefix: str, key, modules: tuple, compile_fn):
    """A kernel outside `KernelKey`: with `DISK_CACHE_ALL` (the environment's
    HOPPER_FMHA_DISK_CACHE_ALL=1 / 0 overrides it), from
    this fingerprint's disk folder under its `build_name(prefix, key, *modules)`, else compiled
    by `compile_fn()` (and saved); without, compiled, and nothing hashed. The caller keeps it in
    memory."""
    flag = os.environ.get("HOPPER_FMHA_DISK_CACHE_ALL")
    if not (flag == "1" or (DISK_CACHE_ALL and flag != "0")):
        return compile_fn()
    name = build_name(prefix, key, *modules)
    with _lock:
        return _disk_or_compile(name, compile_fn, name)


def get_kernel(key: KernelKey):
    """The launchable kernel for `key`: from memory, else from disk, else compiled (and saved)."""
    fn = _memory.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        fn = _memory[key] = _disk_or_compile(key.slug(), lambda: compile_kernel(key), key)
        return fn


def clear_cache(memory: bool = True, disk: bool = False) -> None:
    """Forget compiled kernels (memory) and/or delete this fingerprint's object files (disk)."""
    with _lock:
        if memory:
            _memory.clear()
            by_config.clear()
        if disk:
            d = cache_dir()
            if d.exists():
                for f in d.glob("*.o"):
                    f.unlink()
