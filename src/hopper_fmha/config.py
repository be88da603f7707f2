"""Kernel configurations: the one place that knows the tile table and what fits on the chip.

Pure Python (no torch, no CuTe DSL import) so that it is tested on any machine.

The paper variant runs one warpgroup (128 threads) per CTA. Every thread holds, in fp32
registers, its share of the GEMM-I accumulator S (tile_m x tile_n) and of the output
accumulator O (tile_m x head_dim), and the fp16/bf16 copy of P (tile_m x tile_n) that feeds
the register-A GEMM-II. Shared memory holds one stage each of Q, K and V.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

SUPPORTED_HEAD_DIMS = (64, 128, 256)
VARIANTS = ("paper",)
DEFAULT_VARIANT = "paper"

# Hopper (sm_90): per-thread register ceiling and opt-in shared memory per CTA.
MAX_REGS_PER_THREAD = 255
SMEM_CAPACITY_BYTES = 232448  # cutlass.memory.get_smem_capacity_in_bytes("sm_90")
# Registers a thread needs besides the accumulators and P (addresses, loop state, softmax row
# statistics, the GEMM-I K-loop): 24 + head_dim/32. Calibrated against ptxas (nvidia-cutlass-dsl
# 4.8.1) on all 12 paper tiles: the model accepts exactly the tiles that compile without spills
# (NOTES.md, "register budget"); a compile-tier test keeps the two in agreement.
def reg_overhead(head_dim: int) -> int:
    return 24 + head_dim // 32


PAPER_TILES = ((64, 64), (64, 128), (128, 64), (128, 128))

# The paper's Table 1 shape: the tile (tile_m, tile_n) used per head dim when none is given.
# Each entry is the fastest fitting tile measured by `hopper-fmha bench --preset tiles`
# (NOTES.md, "tile table"); until measured here they follow the paper's own best tiles that fit.
PAPER_TILE_TABLE = {
    64: (64, 128),
    128: (128, 64),
    256: (64, 64),
}


def default_softmax_scale(head_dim: int) -> float:
    """1/sqrt(head_dim): the scale used whenever softmax_scale is None (the only place it is computed)."""
    return head_dim**-0.5


@dataclass(frozen=True)
class KernelConfig:
    variant: str
    head_dim: int
    tile_m: int
    tile_n: int
    num_threads: int = 128

    @property
    def tile(self) -> tuple[int, int]:
        return (self.tile_m, self.tile_n)


def register_estimate(head_dim: int, tile_m: int, tile_n: int, num_threads: int = 128) -> int:
    """32-bit registers per thread: fp32 S and O accumulators, 16-bit P, fixed overhead."""
    acc_s = tile_m * tile_n // num_threads
    acc_o = tile_m * head_dim // num_threads
    frag_p = tile_m * tile_n // (2 * num_threads)
    return acc_s + acc_o + frag_p + reg_overhead(head_dim)


def smem_bytes(head_dim: int, tile_m: int, tile_n: int, elem_bytes: int = 2) -> int:
    """Shared memory: one stage of Q, K and V, plus the mbarriers (and 1 KiB alignment slack)."""
    return (tile_m + 2 * tile_n) * head_dim * elem_bytes + 1024


def check_fits(head_dim: int, tile_m: int, tile_n: int) -> None:
    """Raise ValueError naming the limit a paper-variant config breaks."""
    if (tile_m, tile_n) not in PAPER_TILES:
        raise ValueError(
            f"tile {tile_m}x{tile_n} is not a paper-variant tile; choose one of "
            + ", ".join(f"{m}x{n}" for m, n in PAPER_TILES)
        )
    regs = register_estimate(head_dim, tile_m, tile_n)
    if regs > MAX_REGS_PER_THREAD:
        raise ValueError(
            f"tile {tile_m}x{tile_n} at head_dim={head_dim} needs about {regs} registers per thread "
            f"(S {tile_m * tile_n // 128} + O {tile_m * head_dim // 128} + P {tile_m * tile_n // 256} "
            f"+ {reg_overhead(head_dim)} overhead) but a thread has at most {MAX_REGS_PER_THREAD}: it would spill. "
            f"Use a smaller tile_m or tile_n."
        )
    smem = smem_bytes(head_dim, tile_m, tile_n)
    if smem > SMEM_CAPACITY_BYTES:
        raise ValueError(
            f"tile {tile_m}x{tile_n} at head_dim={head_dim} needs {smem} bytes of shared memory "
            f"but a CTA has at most {SMEM_CAPACITY_BYTES}"
        )


def fitting_tiles(head_dim: int) -> list[tuple[int, int]]:
    out = []
    for tile in PAPER_TILES:
        try:
            check_fits(head_dim, *tile)
        except ValueError:
            continue
        out.append(tile)
    return out


@lru_cache(maxsize=256)
def select_config(head_dim: int, variant: str = DEFAULT_VARIANT, tile: tuple[int, int] | None = None) -> KernelConfig:
    """The kernel configuration for a head dim, from the table or an explicit `tile` override."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if tile is None:
        tile = PAPER_TILE_TABLE[head_dim]
    else:
        if len(tile) != 2 or not all(isinstance(t, int) for t in tile):
            raise ValueError(f"tile must be a pair of ints (tile_m, tile_n), got {tile!r}")
    check_fits(head_dim, *tile)
    return KernelConfig(variant=variant, head_dim=head_dim, tile_m=tile[0], tile_n=tile[1])
