"""A hash of each backward kernel's SASS, for the claim "this change leaves those kernels' code as it
was" (no GPU needed: the CuTe DSL compiles for sm_90a here). Run it before and after a change, or
on two checkouts, and compare the lines:

    CUTE_DSL_ARCH=sm_90a python scripts/sass_hashes.py > before.txt   # (in the other checkout:
    PYTHONPATH=/path/to/other/src CUTE_DSL_ARCH=sm_90a python scripts/sass_hashes.py > after.txt)

Addresses are dropped from the listing before hashing; registers and stack bytes are printed too.
The configurations: the default dense kernels (v1 and v2 at their tiles, deterministic, GQA with
atomic sums and softcap, varlen with a window), `DQ_FRAGMENTS` at each tile, the wide kernel's two
shapes, the writer warp and `DQ_CHAINS` (`--set all`, slower), or a list of names.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# name: compile_bwd keyword arguments (dtype bfloat16, version 2 unless given)
DENSE = {
    "d128-tile80-mha": dict(head_dim=128, causal=False, tile_m=80, mha=True),
    "d128-causal-tile64-mha": dict(head_dim=128, causal=True, tile_m=64, mha=True),
    "d64-tile128-mha": dict(head_dim=64, causal=False, tile_m=128, mha=True),
    "d128-causal-deterministic": dict(head_dim=128, causal=True, deterministic=True, tile_m=64),
    "d128-gqa-atomic-softcap": dict(head_dim=128, causal=False, dkv_atomic=True, softcap=True, tile_m=64),
    "d64-varlen-left": dict(head_dim=64, causal=False, varlen=True, window_left=True, tile_m=128),
    "v1-d128-causal": dict(head_dim=128, causal=True, version=1),
}
MORE = {
    "fragments-d128-tile80-deterministic": dict(
        head_dim=128, causal=False, tile_m=80, mha=True, deterministic=True, dq_fragments=True
    ),
    "fragments-d128-causal-tile64": dict(head_dim=128, causal=True, tile_m=64, mha=True, dq_fragments=True),
    "fragments-d64-tile128": dict(head_dim=64, causal=False, tile_m=128, mha=True, dq_fragments=True),
    "writer-plain-d128-tile80": dict(
        head_dim=128, causal=False, tile_m=80, mha=True, dq_writer=True, dq_unscaled=True
    ),
    "wide-256": dict(head_dim=256, causal=False),
    "wide-256-causal-deterministic": dict(head_dim=256, causal=True, deterministic=True),
    "wide-256-deterministic-rotated": dict(
        head_dim=256, causal=False, deterministic=True, rotate=True, dq_writer=True
    ),
    "wide-192-128": dict(head_dim=192, head_dim_v=128, causal=False),
    "wide-192-128-varlen-softcap": dict(head_dim=192, head_dim_v=128, causal=True, varlen=True, softcap=True),
    "writer-d128-causal": dict(head_dim=128, causal=True, deterministic=True, tile_m=64, dq_writer=True),
    "writer-d128-tile80-rotated": dict(
        head_dim=128, causal=False, deterministic=True, tile_m=80, rotate=True, dq_writer=True
    ),
    "chains2-d128-tile80-rotated": dict(
        head_dim=128, causal=False, deterministic=True, tile_m=80, rotate=True, dq_writer=True, dq_chains=2
    ),
    "chains2-wide-256-rotated": dict(
        head_dim=256, causal=False, deterministic=True, rotate=True, dq_writer=True, dq_chains=2
    ),
    "writer-warps2-d128-causal": dict(
        head_dim=128, causal=True, deterministic=True, tile_m=64, dq_writer=True, dq_writer_warps=2
    ),
}


def sass_hash(kwargs: dict) -> tuple[str, int, int]:
    """(hash of the address-free SASS, registers, stack bytes) of one compiled kernel."""
    from hopper_fmha.kernels.inspect import kernel_resources, sass
    from hopper_fmha.kernels.sm90_bwd import compile_bwd

    with tempfile.TemporaryDirectory() as dump:
        cubin = compile_bwd("bfloat16", **kwargs, options=f"--keep-cubin --dump-dir={dump}").artifacts.CUBIN
    lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in sass(cubin).splitlines()]
    text = "\n".join(line for line in lines if line and not line.startswith("//"))
    res = kernel_resources(cubin)
    return hashlib.sha1(text.encode()).hexdigest()[:12], res["registers"], res["stack_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="configurations (default: the dense ones)")
    parser.add_argument("--set", choices=("dense", "all"), default="dense")
    args = parser.parse_args()
    configs = {**DENSE, **MORE}
    names = args.names or list(DENSE if args.set == "dense" else configs)
    for name in names:
        digest, registers, stack = sass_hash(configs[name])
        print(f"{name:40s} {digest}  {registers} registers, {stack} B stack", flush=True)


if __name__ == "__main__":
    main()
