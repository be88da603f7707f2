"""Kernel configurations: the one place that knows the tile table and what fits on the chip.

Pure Python (no torch, no CuTe DSL import) so that it is tested on any machine.

The paper variant runs one warpgroup (128 threads) per CTA. Every thread holds, in fp32
registers, its share of the GEMM-I accumulator S (tile_m x tile_n) and of the output
accumulator O (tile_m x head_dim), and the fp16/bf16 copy of P (tile_m x tile_n) that feeds
the register-A GEMM-II. Shared memory holds one stage each of Q, K and V.

The ws variant (FlashAttention-3's design) adds a producer warpgroup and runs tile_m/64 consumer
warpgroups of 64 rows each; registers are split by setmaxnreg, and K and V have `num_stages`
buffers each. Its tiles are checked by `check_fits_ws`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

# The paper kernel's head dims (q, k and v alike).
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# The ws kernel's head dims: q/k's head_dim any multiple of 8 up to 256, v's head_dim_v a multiple
# of 8 up to head_dim. Each runs the kernel of the smallest pair of `WS_KERNEL_HEAD_DIMS` that
# holds it (`kernel_head_dims`); the columns in between are padding that TMA fills with zeros
# on loading and clips on storing, so nothing is copied (their cost is the MMAs on them).
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
WS_KERNEL_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))
# Every (head_dim, head_dim_v) that `check_head_dims` accepts: flash_attn_func's per-call test.
HEAD_DIM_PAIRS = frozenset(
    (d, dv)
    for d in range(HEAD_DIM_MULTIPLE, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE)
    for dv in range(HEAD_DIM_MULTIPLE, d + 1, HEAD_DIM_MULTIPLE)
)
VARIANTS = ("paper", "ws")
DEFAULT_VARIANT = "ws"  # with an explicit tile; without one, `auto_variant` picks per problem
# Key lengths up to which the paper kernel (one warpgroup per CTA, several CTAs per SM) beats the
# ws kernel (one persistent CTA per SM): measured on the sweep preset, fp16 and bf16, H200
# (NOTES.md, "variant by problem", "ws v3", "ws v4", "ws v7"): at d = 64 up to 1024 keys,
# non-causal (fp16 +11-21%; bf16 too since P is converted in pairs: 0.187 vs 0.205 ms at N = 512)
# and causal (its 128x128 tile, 0.145 vs 0.155 ms at 512 keys, 0.226 vs 0.233 at 1024, sustained
# at the power cap; since v11 its 64x64 there, `PAPER_SHORT_TILE`); at d = 128 causal up to 256
# keys (0.084 vs 0.089 ms bf16; at 512 the ws kernel is faster, 0.1160 vs 0.1177 bf16, 0.1206 vs
# 0.1221 fp16); never at d = 256 or d = 128 non-causal.
PAPER_MAX_SEQLEN_K = {64: 1024, 128: 0, 256: 0}
PAPER_MAX_SEQLEN_K_CAUSAL = {64: 1024, 128: 256, 256: 0}

# Hopper (sm_90): per-thread register ceiling and opt-in shared memory per CTA.
MAX_REGS_PER_THREAD = 255
SMEM_CAPACITY_BYTES = 232448  # cutlass.memory.get_smem_capacity_in_bytes("sm_90")


# Registers a thread needs besides the fp32 S and O accumulators (addresses, loop state, softmax
# row statistics, the GEMM-I K-loop, P's 16-bit words: `convert` writes them two values per
# instruction while S's registers die, so P adds little): 48 + head_dim/32. Calibrated against
# ptxas (nvidia-cutlass-dsl 4.8.1, CUDA 13) on all 12 paper tiles: the model accepts exactly the
# tiles that compile without spills (NOTES.md, "register budget"); a compile-tier test keeps the
# two in agreement. d = 64 at 128x128 takes 254 registers, d = 256 at 64x128 252, no spills; the
# smallest that spills is d = 128 at 128x128 (S + O = 256).
def reg_overhead(head_dim: int) -> int:
    return 48 + head_dim // 32


PAPER_TILES = ((64, 64), (64, 128), (128, 64), (128, 128))

# The paper's Table 1 shape: the tile (tile_m, tile_n) used per head dim when none is given.
# Each entry is the fastest fitting tile measured by `hopper-fmha bench --preset tiles`
# (NOTES.md, "tile table"); until measured here they follow the paper's own best tiles that fit.
PAPER_TILE_TABLE = {
    # 128x128 fits since P is converted in pairs (254 registers): sustained at the power cap it
    # beats 64x128 by 2-6% (N = 512 bf16 0.187 vs 0.190 ms, N = 1024 0.328 vs 0.341, N = 4096
    # fp16 1.211 vs 1.287; NOTES "ws v4").
    64: (128, 128),
    128: (64, 64),
    256: (64, 64),
}


def check_head_dims(head_dim: int, head_dim_v: int) -> None:
    """Raise ValueError naming the head-dim rule that (head_dim, head_dim_v) breaks."""
    for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if d % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= d <= MAX_HEAD_DIM:
            raise ValueError(
                f"{name} must be a multiple of {HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}], "
                f"got {d}"
            )
    if head_dim_v > head_dim:
        raise ValueError(f"head_dim_v (v's) must be <= head_dim (q's and k's), got {head_dim_v} > {head_dim}")


def kernel_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The ws kernel's (head_dim, head_dim_v) for data of these head dims: the smallest pair of
    WS_KERNEL_HEAD_DIMS at least as large in both (`check_head_dims` holds)."""
    # min of a list, not of a generator: traced by torch.compile (`select_config`), where Dynamo
    # cannot take min() of a generator.
    return min([(kd, kdv) for kd, kdv in WS_KERNEL_HEAD_DIMS if kd >= head_dim and kdv >= head_dim_v])


def default_softmax_scale(head_dim: int) -> float:
    """1/sqrt(head_dim): the scale used whenever softmax_scale is None (the only place it is computed)."""
    return head_dim**-0.5


@dataclass(frozen=True)
class KernelConfig:
    variant: str
    head_dim: int  # q's and k's (the data's; the ws kernel may pad it: `kernel_dims`)
    tile_m: int
    tile_n: int
    num_threads: int = 128
    # The ws variant's compile-time switches (the paper variant ignores them).
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
    # Score features (WS_SWITCHES): off unless a launch asks for them (`kernels.feature_key`).
    window: str = ""
    softcap: bool = False
    sink: bool = False
    # Packed variable-length sequences (WS_SWITCHES): set per launch (`kernels.varlen_key`).
    varlen: bool = False
    seqused_k: bool = False
    split_kv: bool = False  # per launch too (`kernels.kvcache_forward`)
    pack_gqa: int = 1  # likewise: q heads per kv head packed into a tile's rows (1: none)
    paged: int = 0  # likewise: K/V in pages through a page table, pages per key block (0: none)
    # Non-causal tiles taken from the global tile counter too (WS_SWITCHES; per launch,
    # `kernels.VARLEN_TILE_COUNTER`, `kernels.KVCACHE_TILE_COUNTER`).
    tile_counter: bool = False
    # v's head dim where it differs from head_dim (0: the same).
    head_dim_v: int = 0

    @property
    def tile(self) -> tuple[int, int]:
        return (self.tile_m, self.tile_n)

    @property
    def value_dim(self) -> int:
        """v's head dim."""
        return self.head_dim_v or self.head_dim

    @property
    def kernel_dims(self) -> tuple[int, int]:
        """The (head_dim, head_dim_v) the kernel computes with (ws: padded, `kernel_head_dims`)."""
        if self.variant != "ws":
            return (self.head_dim, self.head_dim)
        return kernel_head_dims(self.head_dim, self.value_dim)

    def __hash__(self) -> int:
        # Configs are keys of the per-call caches (launch_config's lru_caches): hashed once, on
        # first use, then cached; not field by field on every call. Not at construction: a config
        # is built inside torch.compile'd code (select_config under Dynamo), where torch 2.11's
        # Dynamo cannot trace hash() of a tuple.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h


def register_estimate(head_dim: int, tile_m: int, tile_n: int, num_threads: int = 128) -> int:
    """32-bit registers per thread: fp32 S and O accumulators plus the overhead (P included)."""
    acc_s = tile_m * tile_n // num_threads
    acc_o = tile_m * head_dim // num_threads
    return acc_s + acc_o + reg_overhead(head_dim)


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
            f"(S {tile_m * tile_n // 128} + O {tile_m * head_dim // 128} + {reg_overhead(head_dim)} "
            f"overhead, P included) but a thread has at most {MAX_REGS_PER_THREAD}: "
            f"it would spill. Use a smaller tile_m or tile_n."
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


# ---- ws variant ----
# Consumer registers per thread after setmaxnreg, by tile_m (2 or 3 consumer warpgroups; the
# producer warpgroup keeps 24 or 32): the 64K-register file split as FlashAttention-3 splits it.
WS_CONSUMER_REGS = {128: 240, 192: 160}
WS_TILE_M = tuple(WS_CONSUMER_REGS)
WS_MAX_TILE_N = 256  # WGMMA N of GEMM-I


def ws_reg_overhead(head_dim: int) -> int:
    # Registers a consumer thread needs besides O, S and P (addresses, pipeline states, row
    # statistics, the mask's coordinates, the persistent tile loop): 28. Calibrated against
    # ptxas (nvidia-cutlass-dsl 4.8.1, causal, fp16 and bf16) on the ws tiles at the edges of
    # both budgets: accepts exactly those that compile without spills (NOTES.md, "ws register
    # budget"); a compile-tier test keeps the two in agreement.
    return 28


def ws_register_estimate(head_dim: int, tile_n: int, head_dim_v: int | None = None) -> int:
    """32-bit registers per consumer thread (64 rows per warpgroup): O, S and P live together."""
    acc_o = 64 * (head_dim_v or head_dim) // 128
    acc_s = 64 * tile_n // 128
    frag_p = 64 * tile_n // 256
    return acc_o + acc_s + frag_p + ws_reg_overhead(head_dim)


# mma_rowsum: the B operand of the GEMM that sums P's rows, 8 (WGMMA's smallest N) x tile_n ones.
ROWSUM_COLS = 8


def ws_smem_bytes(
    head_dim: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    elem_bytes: int = 2,
    mma_rowsum: bool = False,
    o_buffer: str = "q",
    head_dim_v: int | None = None,
) -> int:
    """Bytes of the ws kernel's shared storage, as laid out (`kernels.sm90_ws`, which asserts the
    two agree at compile time): the mbarriers and the tile slot, then Q, O's buffer, the block of
    ones and num_stages K and V buffers, each 1 KiB-aligned. O's buffer by `o_buffer`: "own" (the
    whole tile), "split" (64 rows x min(d, 128) columns per consumer warpgroup), "q" (none: O goes
    out through Q's; its empty slot still takes 1 KiB). Without mma_rowsum the ones' slot is empty
    and takes 1 KiB too. head_dim_v (None: head_dim) sizes V and O."""

    def slot(n: int) -> int:  # 1 KiB-aligned; an empty slot holds a 16-byte placeholder
        return -(-max(n, 16) // 1024) * 1024

    dv = head_dim_v or head_dim
    o_rows_cols = {"own": tile_m * dv, "split": tile_m * min(dv, 128), "q": 0}[o_buffer]
    ones = ROWSUM_COLS * tile_n * elem_bytes if mma_rowsum else 0
    return (
        1024
        + slot(tile_m * head_dim * elem_bytes)
        + slot(o_rows_cols * elem_bytes)
        + slot(ones)
        + slot(num_stages * tile_n * head_dim * elem_bytes)
        + slot(num_stages * tile_n * dv * elem_bytes)
    )


def ws_o_buffer(
    head_dim: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    elem_bytes: int = 2,
    mma_rowsum: bool = False,
    head_dim_v: int | None = None,
) -> str:
    """Where the ws kernel's O goes out through shared memory (`kernels.sm90_ws.WsFwdSm90` decides
    by this too): "own", a whole O buffer beside Q, K and V, so Q's buffer is free after the tile's
    last GEMM-I; "split", where that does not fit but one of 64 rows x min(d, 128) columns per
    consumer warpgroup does (the same for Q); "q", Q's buffer, and the next tile's Q waits for O's
    TMA store to read it.
    """
    for o_buffer in ("own", "split"):
        smem = ws_smem_bytes(
            head_dim, tile_m, tile_n, num_stages, elem_bytes, mma_rowsum, o_buffer, head_dim_v
        )
        if smem <= SMEM_CAPACITY_BYTES:
            return o_buffer
    return "q"


def ws_split_o(
    head_dim: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    mma_rowsum: bool = False,
    head_dim_v: int | None = None,
) -> bool:
    """The `split_o` switch `select_config` sets: O through per-warpgroup buffers exactly where a
    whole O buffer does not fit and those do (`ws_o_buffer`).

    d = 256 at 128x64 (sustained at the 700 W cap, ms per call, 128x64 through Q's buffer ->
    per-warpgroup buffers; NOTES "ws v6"): N = 512 non-causal 0.150 -> 0.143, causal 0.114 ->
    0.108; N = 1024 causal 0.166 -> 0.160; N = 2048 causal 0.275 -> 0.269.
    """
    return (
        ws_o_buffer(head_dim, tile_m, tile_n, num_stages, mma_rowsum=mma_rowsum, head_dim_v=head_dim_v)
        == "split"
    )


def check_fits_ws(
    head_dim: int,
    tile_m: int,
    tile_n: int,
    num_stages: int = 2,
    mma_rowsum: bool = False,
    head_dim_v: int | None = None,
) -> None:
    """Raise ValueError naming the rule a ws-variant config breaks."""
    if tile_m not in WS_TILE_M:
        raise ValueError(
            f"ws tile_m must be one of {WS_TILE_M} (2 or 3 consumer warpgroups of 64 rows), got {tile_m}"
        )
    if tile_n % 16 != 0 or not 16 <= tile_n <= WS_MAX_TILE_N:
        raise ValueError(
            f"ws tile_n must be a multiple of 16 (the K step of GEMM-II) in [16, {WS_MAX_TILE_N}], "
            f"got {tile_n}"
        )
    dv = head_dim_v or head_dim
    regs = ws_register_estimate(head_dim, tile_n, dv)
    budget = WS_CONSUMER_REGS[tile_m]
    if regs > budget:
        raise ValueError(
            f"ws tile {tile_m}x{tile_n} at head_dim={head_dim} needs about {regs} registers per consumer "
            f"thread (O {dv // 2} + S {tile_n // 2} + P {tile_n // 4} + {ws_reg_overhead(head_dim)} "
            f"overhead) but tile_m={tile_m} gives consumers {budget}: it would spill. Use a smaller tile_n"
            + (" or tile_m=128." if tile_m != 128 else ".")
        )
    # O's buffer: the smallest that fits (`ws_o_buffer`); Q's ("q") always exists.
    smem = ws_smem_bytes(head_dim, tile_m, tile_n, num_stages, mma_rowsum=mma_rowsum, head_dim_v=dv)
    if smem > SMEM_CAPACITY_BYTES:
        ones = " and the row-sum block of ones" if mma_rowsum else ""
        raise ValueError(
            f"ws tile {tile_m}x{tile_n} with {num_stages} K/V stages{ones} at head_dim={head_dim} needs "
            f"{smem} bytes of shared memory but a CTA has at most {SMEM_CAPACITY_BYTES}"
        )


# The ws kernel's compile-time switches, by name: fields of KernelConfig and kernels.KernelKey and
# keyword arguments of kernels.sm90_ws.WsFwdSm90, copied between them by this list (a test checks
# that all three have every name, with the same defaults). WsChoice (the table) sets all but those
# in WS_DERIVED_SWITCHES, which follow from the tile (`select_config`).
WS_SWITCHES = (
    "num_stages",
    "intra_wg_overlap",
    "pingpong",
    "rescale_o_early",
    "pin_pv_wait",
    "cluster_m",
    "split_o",
    "mma_rowsum",
    "causal_trim",
    "release_q_at_qk",
    # Score features (off by default; the table never sets them: `kernels.feature_key` does, per
    # launch): a sliding window's limited sides ("", "left", "right", "both"), softcap, a sink.
    "window",
    "softcap",
    "sink",
    # Where sequences are (`kernels/seqlen.py`): packed by cu_seqlens (varlen), and keys used per
    # sequence (seqused_k); set per launch by `kernels.varlen_key`.
    "varlen",
    "seqused_k",
    # Split-KV (`kernels/sm90_ws.py`): key ranges per tile, partials merged by `kernels/combine.py`.
    "split_kv",
    # Pack-GQA (`kernels/sm90_ws.py`): the q heads of a kv head share a tile (decode).
    "pack_gqa",
    # Paged K/V (`kernels/loader.py`): a page table per sequence, and pages per key block.
    "paged",
    # The tile order (`kernels/scheduler.py`): causal launches always take tiles from a global
    # counter; tile_counter makes non-causal ones do so too (packed sequences, whose tiles differ
    # in work: `kernels.VARLEN_TILE_COUNTER`).
    "tile_counter",
)
WS_DERIVED_SWITCHES = ("split_o",)


@dataclass(frozen=True)
class WsChoice:
    tile: tuple[int, int]
    num_stages: int
    intra_wg_overlap: bool
    pingpong: bool
    rescale_o_early: bool = False
    # n > 0: GEMM-II's wait follows the first n exponentials of the softmax (see WsFwdSm90).
    pin_pv_wait: int = 0
    # 2: CTA pairs share K/V blocks by TMA multicast (non-causal; see WsFwdSm90).
    cluster_m: int = 1
    # Row sums of P by the tensor cores (a 64x8 GEMM against ones beside GEMM-II; see WsFwdSm90).
    mma_rowsum: bool = False
    # Causal: a warpgroup skips the GEMM work of key blocks (or their second halves) that lie past
    # the causal limit of all its 64 rows (see WsFwdSm90).
    causal_trim: bool = False
    # Q's buffer is released as soon as a tile's last GEMM-I completes (in the block step that
    # runs it), not after the tile's last GEMM-II, so the next tile's Q loads earlier (see WsFwdSm90).
    release_q_at_qk: bool = False
    # Score features (WS_SWITCHES): never set by the table (`kernels.feature_key` sets them).
    window: str = ""
    softcap: bool = False
    sink: bool = False
    varlen: bool = False  # never set by the table either (`kernels.varlen_key`)
    seqused_k: bool = False
    split_kv: bool = False
    pack_gqa: int = 1
    paged: int = 0
    tile_counter: bool = False  # per launch too


# The ws variant's choice per head dim, started from FlashAttention-3/4's (tuned on H100 SXM) and
# kept or changed by H200 measurements (NOTES.md, "ws tile table", "ws v2", "ws v3", "ws v5").
# cluster_m=2 everywhere: CTA pairs multicast K/V (non-causal, even tile counts: `launch_config`).
# Sustained at the 700 W cap, fp16 B4 N4096 non-causal, ms per call paired vs single (FA4):
# d64 1.176 vs 1.187 (1.162), d128 0.912 vs 0.934 (0.924), d256 0.858 vs 0.879 (0.859). Same
# cycles per call, a higher clock: half the L2 reads of K and V cost less energy.
# release_q_at_qk everywhere (where O does not leave through Q's buffer, i.e. not d = 256 at
# 128x80): Q's buffer is released after a tile's last GEMM-I, not after its last GEMM-II, so the
# next tile's Q is in place sooner. Sustained, bf16, ms per call (M cycles), before -> after,
# cuDNN (NOTES "v13"): d128 N = 512 non-causal 0.1511 -> 0.1490 (0.244 -> 0.239; cuDNN 0.238),
# causal 0.1172 -> 0.1140 (0.188 -> 0.177); N = 1024 causal 0.1707 -> 0.1682; d256 128x64 N = 512
# causal 0.1041 -> 0.1023; d64 N = 4096 non-causal 1.107 -> 1.095; N = 8192 d128 unchanged.
WS_TILE_TABLE = {
    # 3 consumer warpgroups: each K/V tile serves 192 query rows (FA3/FA4's d64 choice); 128x128
    # measured 386 vs 534 TFLOP/s. Row sums by the tensor cores and GEMM-II's wait pinned after 8
    # exponentials: sustained, bf16 non-causal, ms per call against the v7 kernel with lazy
    # rescaling (pin 12, adds in the softmax): N = 2048 0.585 vs 0.592, 4096 1.093 vs 1.114,
    # 8192 2.046 vs 2.099, 16384 4.035 vs 4.119 (NOTES "ws v8"). Causal launches take neither
    # (WS_CAUSAL_SWITCHES): with the sums 2.5% more cycles at N = 4096, and pin 0 there.
    64: WsChoice(
        (192, 128),
        num_stages=2,
        intra_wg_overlap=True,
        pingpong=True,
        pin_pv_wait=8,
        cluster_m=2,
        mma_rowsum=True,
        release_q_at_qk=True,
    ),
    # FA4's tile (FA3's 128x176 non-causal measured 607 vs 676). GEMM-II's wait pinned after 24
    # exponentials: sustained at the 700 W cap (1 s of graph replays, B4 N4096 H16 non-causal),
    # 0.915 ms fp16 / 0.880 ms bf16 against 0.956 / 0.920 after 16 and 0.962 / 0.920 unpinned
    # (FA4 0.920 / 0.881). After 16, ptxas's schedule costs few cycles (ncu 1.33 vs 1.29 M) but
    # reads 2.4x the L2 sectors (126 vs 52 M: no request merging across CTAs), and at the power
    # cap the card clocks down (NOTES "ws v4").
    128: WsChoice(
        (128, 128),
        num_stages=2,
        intra_wg_overlap=True,
        pingpong=True,
        pin_pv_wait=24,
        cluster_m=2,
        release_q_at_qk=True,
    ),
    # The widest tile_n whose two K and two V stages fit shared memory. No pingpong above d128, as
    # FA3/FA4 (672 vs 703 with it); O rescaled while GEMM-I runs (+13%). Pinning the wait lost
    # 8-14% here.
    # causal_trim (causal): the first warpgroup skips the MMAs of the key block past all its rows,
    # at 128x64 also halves. Sustained, bf16, ms per call, trimmed vs not (cuDNN), short tile
    # 128x64: N = 512 0.1001 vs 0.1022 (0.107), fp16 0.1045 vs 0.1063 (0.112); N = 1024 0.1505 vs
    # 0.1522; N = 2048 0.2466 vs 0.2479. At d128 (128x128) it lost 2-3% (N = 512 0.1173 vs 0.1135),
    # at d64 (192x128, N = 2048) it changed nothing: off there (NOTES "v10").
    256: WsChoice(
        (128, 80),
        num_stages=2,
        intra_wg_overlap=True,
        pingpong=False,
        rescale_o_early=True,
        cluster_m=2,
        causal_trim=True,
        release_q_at_qk=True,
    ),
    # Not yet measured (no GPU run since it was added; NOTES "v18"): d = 192 at FlashAttention-4's
    # tile_n for dv = 192 (112: two K and two V stages of 192 columns fit beside Q, O through Q's
    # buffer), no pingpong and O rescaled early above d = 128, as at d = 256.
    192: WsChoice(
        (128, 112),
        num_stages=2,
        intra_wg_overlap=True,
        pingpong=False,
        rescale_o_early=True,
        cluster_m=2,
        release_q_at_qk=True,
    ),
}
# d = 96: 3 consumer warpgroups of 64 rows x 112 keys (FA3 takes 192 x 144 here), d = 128's
# switches otherwise. Sustained, bf16 B4 N4096 H16, ms per call (FA4 0.7521 / causal 0.4444;
# `scripts/sustained.py`, H200 2026-11-27, NOTES "v24"): 192x112 0.7073 / 0.4232, 192x96 0.7356 /
# 0.4283, 128x128 (d = 128's tile, the choice before) 0.7763 / 0.4377, 128x160-192 0.752-0.755 /
# 0.438-0.444. 192 x 128 spills (96 bytes): O 48 + S 64 + P 32 registers and the rest past 160.
WS_TILE_TABLE[96] = replace(WS_TILE_TABLE[128], tile=(192, 112))


# Kernels whose v head dim differs from q's, by (head_dim, head_dim_v). DeepSeek's 192/128 at
# 128x128 (FlashAttention-4's tile; O goes out through Q's buffer); O is as small as at d = 128:
# no early rescale. Sustained, bf16 B4 N4096 H16, ms per call, non-causal / causal (FA4 1.0829 /
# 0.5831; `scripts/sustained.py --headdim 192 --headdim-v 128`, H200 2026-11-27, NOTES "v24"):
# 128x128 1.0348 / 0.5855, 128x112 (the choice before, O in its own buffer) 1.0382 / 0.5985,
# 128x96 1.0515 / 0.5920; at 128x112 pingpong 1.0473 / 0.5844, causal_trim 1.0412 / 0.5911.
WS_TILE_TABLE_DV = {
    (192, 128): WsChoice(
        (128, 128),
        num_stages=2,
        intra_wg_overlap=True,
        pingpong=False,
        cluster_m=2,
        release_q_at_qk=True,
    ),
}


def ws_choice(head_dim: int, head_dim_v: int) -> WsChoice:
    """The table's choice for the ws kernel of these (kernel) head dims."""
    if head_dim_v != head_dim:
        return WS_TILE_TABLE_DV[(head_dim, head_dim_v)]
    return WS_TILE_TABLE[head_dim]


# ws tiles that beat the table's on short problems: (head dim, causal) -> (max seqlen_k, tile).
# d = 64 causal, N = 512 / 1024 (H200, `bench/results/2026-11-21-h200-v3/custom-…T0824.md` at 7468fb9):
# 128x128 224.6 / 296.8 TFLOP/s fp16 vs 199.1 / 267.8 for 192x128 (bf16 227.8 / 300.6 vs
# 203.7 / 273.4): two query tiles per 256 rows instead of one and a half keep more SMs busy
# (the paper kernel, the default there since v4, is faster still). d = 256, sustained at the
# power cap (`…-v4/power-d256-short.txt` at 7468fb9, fp16 ms per call, 128x64 vs 128x80): N = 512
# non-causal 0.157 vs 0.161, causal 0.118 vs 0.124; N = 1024 causal 0.170 vs 0.174, but
# non-causal 0.262 vs 0.259: 512 keys are 8 blocks of 64 but 7 of 80, the last one 40% empty (limits
# then: 512 keys non-causal, 1024 causal).
# d = 256 at 128x64 stores O through per-warpgroup buffers (`ws_split_o`) since v6, which moved
# the limits up: sustained, ms per call, 128x64 (split O) vs 128x80: N = 1024 non-causal bf16
# 0.243 vs 0.248, N = 2048 causal fp16 0.269 vs 0.278; not at N = 2048 non-causal (0.458 vs
# 0.460) or N = 4096 (0.870 vs 0.866, causal 0.478 vs 0.481): no gain worth a switch there.
WS_SHORT_TILE = {
    (64, True): (1024, (128, 128)),
    (256, False): (1024, (128, 64)),
    (256, True): (2048, (128, 64)),
}


# The paper kernel's tile by problem, where it differs from PAPER_TILE_TABLE: (head_dim, causal) ->
# (longest seqlen_k, tile). d = 64 causal up to 1024 keys: 64x64 (v11, sustained at the 700 W cap,
# ms per call and M cycles, 64x64 vs 128x128 (cuDNN), `bench/results/2026-11-21-h200-v11/
# power-d64-paper-tiles.txt` at 7468fb9): N = 512 bf16 0.1335 vs 0.1401 (0.1396), 0.224 vs 0.264 Mcyc;
# fp16 0.1381 vs 0.1440 (0.1438); N = 1024 bf16 0.2133-0.2156 vs 0.2162-0.2173 (0.2170), 0.360
# vs 0.401 Mcyc. S and O take 32 + 32 registers per thread instead of 128 + 64 (99 in all, not
# 255), so four CTAs share an SM instead of two (five since v14: `sm90_paper.CTAS_PER_SM`) and
# hide each other's per-tile latency (loads, first softmax, epilogue) at 1-16 key blocks per
# tile; 128x64 (0.151) and 64x128 (0.144) lose.
# d = 64 non-causal up to 512 keys: 64x128 (v12, same probe, `2026-11-21-h200-v12/
# power-d64nc-paper-tiles.txt` at 7468fb9, 64x128 vs 128x128 (cuDNN)): N = 512 bf16 0.1883-0.1889 vs 0.1914
# (0.1929-0.1931), 0.283 vs 0.339 Mcyc; fp16 0.1931-0.1939 vs 0.1971-0.1978 (0.1985-0.1995). At
# N = 1024 it still takes 12% fewer cycles but runs 0.7-1.3% slower in ms (0.3374-0.3380 vs
# 0.3331-0.3352 bf16) at the power cap, so 128x128 stays there; 64x64 loses at both (0.195, 0.351).
PAPER_SHORT_TILE = {(64, True): (1024, (64, 64)), (64, False): (512, (64, 128))}


def auto_tile(variant: str, head_dim: int, causal: bool, seqlen_k: int) -> tuple[int, int] | None:
    """The tile a problem runs on when none is asked for: the variant's short-problem tile
    (`PAPER_SHORT_TILE`, `WS_SHORT_TILE`) up to its key length, else None (the table's)."""
    table = PAPER_SHORT_TILE if variant == "paper" else WS_SHORT_TILE if variant == "ws" else {}
    found = table.get((head_dim, causal))
    return found[1] if found is not None and seqlen_k <= found[0] else None


def launch_config(cfg: KernelConfig, causal: bool, seqlen_q: int, *, exact_lse: bool = True) -> KernelConfig:
    """A ws `cfg` as launched on a problem: causal launches take `WS_CAUSAL_SWITCHES`, CTA pairs
    (`cluster_m`) run only where they apply, and the row sums come from the tensor cores
    (`mma_rowsum`) only where the caller does not need an exact LSE.

    mma_rowsum sums P after its rounding to 16 bits, the same P that multiplies V, so out is as
    accurate as with fp32 sums, but the LSE is off by up to a few 1e-3 where a few scores
    dominate a row (bf16, d = 64, softmax_scale = 1: 3.6e-3 at 2049 x 2049, against 3e-5 with
    fp32 sums). A returned LSE (and any LSE a later pass builds on) takes the fp32 sums.

    Pairs need tiles that visit the same key blocks (non-causal) and an even number of query
    tiles: with an odd one the last pair's second CTA would compute a tile past the end, a
    tile of waste per (batch, head): d = 64 at N = 2048 and 8192 (11 and 43 tiles of 192)
    measured 6% and 3% slower paired than single.
    """
    if causal or (cfg.cluster_m > 1 and -(-seqlen_q // cfg.tile_m) % cfg.cluster_m):
        cfg = _unpaired(cfg, causal)
    if exact_lse and cfg.mma_rowsum:
        cfg = _fp32_rowsum(cfg)
    return cfg


@lru_cache(maxsize=64)
def _fp32_rowsum(cfg: KernelConfig) -> KernelConfig:
    """cfg with P's row sums taken in fp32 by the softmax (no block of ones in shared memory)."""
    kd, kdv = cfg.kernel_dims
    split_o = ws_split_o(kd, cfg.tile_m, cfg.tile_n, cfg.num_stages, mma_rowsum=False, head_dim_v=kdv)
    return replace(cfg, mma_rowsum=False, split_o=split_o)


# Switches a causal launch sets differently from the table, by head dim.
# d = 64: the pinned GEMM-II wait and the tensor-core row sums pay non-causal only (sustained,
# N = 4096 bf16, v8: causal with both 1.156 vs 1.127 M cycles per call; v5: pin 12 causal 0.668 vs
# 0.661 ms unpinned).
# (192, 128) (DeepSeek's q.k 192, v 128): pingpong pays causal only (sustained, bf16 B4 N4096 H16,
# time / FA4's: H200 v25 causal 0.998 -> 0.975; H100 v27 causal 1.006 -> 0.977, non-causal 0.968
# -> 0.975). Keys: a head dim (q's kernel head dim) or a pair (q's, v's) of kernel head dims.
WS_CAUSAL_SWITCHES = {64: {"pin_pv_wait": 0, "mma_rowsum": False}, (192, 128): {"pingpong": True}}


@lru_cache(maxsize=64)
def _unpaired(cfg: KernelConfig, causal: bool) -> KernelConfig:
    """cfg without CTA pairs and, causal, with the causal switches of its head dims."""
    dims = cfg.kernel_dims
    extra = WS_CAUSAL_SWITCHES.get(dims, WS_CAUSAL_SWITCHES.get(dims[0], {})) if causal else {}
    return replace(cfg, cluster_m=1, **extra)


def auto_variant(head_dim: int, causal: bool, seqlen_k: int) -> str:
    """The variant used when none is asked for: the faster one measured for this problem."""
    limits = PAPER_MAX_SEQLEN_K_CAUSAL if causal else PAPER_MAX_SEQLEN_K
    return "paper" if seqlen_k <= limits.get(head_dim, 0) else "ws"


# Every limit above which auto_variant and auto_tile choose the same for any longer seqlen_k:
# `auto_config` is cached on seqlen_k capped here, so one entry serves all long problems.
AUTO_SEQLEN_K_CAP = 1 + max(
    [*PAPER_MAX_SEQLEN_K.values(), *PAPER_MAX_SEQLEN_K_CAUSAL.values()]
    + [limit for limit, _ in (*WS_SHORT_TILE.values(), *PAPER_SHORT_TILE.values())]
)


@lru_cache(maxsize=4096)
def auto_config(head_dim: int, causal: bool, seqlen_k: int, head_dim_v: int | None = None) -> KernelConfig:
    """The config `flash_attn_func` runs when neither variant nor tile is given (seqlen_k may be
    capped at AUTO_SEQLEN_K_CAP: the choice is the same above it). v's head dim other than q's
    (head_dim_v) runs the ws kernel."""
    if head_dim_v is not None and head_dim_v != head_dim:
        return select_config(head_dim, "ws", auto_tile("ws", head_dim, causal, seqlen_k), head_dim_v)
    variant = auto_variant(head_dim, causal, seqlen_k)
    return select_config(head_dim, variant, auto_tile(variant, head_dim, causal, seqlen_k))


@lru_cache(maxsize=256)
def select_config(
    head_dim: int,
    variant: str = DEFAULT_VARIANT,
    tile: tuple[int, int] | None = None,
    head_dim_v: int | None = None,
) -> KernelConfig:
    """The kernel configuration for data of these head dims (head_dim_v None: head_dim), from the
    table or an explicit `tile` override. The ws kernel runs the table's choice of its padded
    head dims (`kernel_head_dims`); the paper kernel only 64, 128, 256 for q, k and v alike."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dv = head_dim if head_dim_v is None else head_dim_v
    if variant == "paper" and (head_dim not in SUPPORTED_HEAD_DIMS or dv != head_dim):
        raise ValueError(
            f"the paper variant's head dims are {SUPPORTED_HEAD_DIMS}, the same for q, k and v; got "
            f"head_dim={head_dim}, head_dim_v={dv} (the ws variant runs any multiple of 8 up to 256)"
        )
    check_head_dims(head_dim, dv)
    if tile is not None and (len(tile) != 2 or not all(isinstance(t, int) for t in tile)):
        raise ValueError(f"tile must be a pair of ints (tile_m, tile_n), got {tile!r}")
    if variant == "ws":
        kd, kdv = kernel_head_dims(head_dim, dv)
        choice = ws_choice(kd, kdv)
        tile = choice.tile if tile is None else tile
        check_fits_ws(kd, *tile, num_stages=choice.num_stages, mma_rowsum=choice.mma_rowsum, head_dim_v=kdv)
        switches = {name: getattr(choice, name) for name in WS_SWITCHES if name not in WS_DERIVED_SWITCHES}
        # Q's buffer can be released after the last GEMM-I only where O does not leave through it
        # (the kernel ignores the switch there), so the config and its kernel key say so too.
        o_buffer = ws_o_buffer(
            kd, tile[0], tile[1], choice.num_stages, mma_rowsum=choice.mma_rowsum, head_dim_v=kdv
        )
        if o_buffer == "q":
            switches["release_q_at_qk"] = False
        return KernelConfig(
            variant=variant,
            head_dim=head_dim,
            tile_m=tile[0],
            tile_n=tile[1],
            num_threads=128 * (1 + tile[0] // 64),
            **switches,
            split_o=ws_split_o(kd, tile[0], tile[1], choice.num_stages, choice.mma_rowsum, kdv),
            head_dim_v=0 if dv == head_dim else dv,
        )
    if tile is None:
        tile = PAPER_TILE_TABLE[head_dim]
    check_fits(head_dim, *tile)
    return KernelConfig(variant=variant, head_dim=head_dim, tile_m=tile[0], tile_n=tile[1])


# Pages smaller than this make a key block of several pages (one TMA each) rather than a short
# block: 16-key blocks ran at 0.56x FA4 (v19), 64-key blocks from one page at 1.02x.
MULTI_PAGE_BELOW = 64


def paged_tile_n(page_size: int, tile_n: int) -> int:
    """The key block for a paged KV cache of page_size rows (page sizes are multiples of 16:
    `kvcache_args`). Pages under MULTI_PAGE_BELOW rows that divide the table's tile_n: the table's
    tile_n, a block of tile_n / page_size whole pages (`pages_per_block`). Otherwise the largest
    multiple of 16 up to tile_n that divides page_size, so that each block is one TMA from one page:
    pages of 64 take 64-key blocks, of 256 the table's tile where it divides them."""
    if page_size < MULTI_PAGE_BELOW and tile_n % page_size == 0:
        return tile_n
    return max(n for n in range(16, tile_n + 1, 16) if page_size % n == 0)


def pages_per_block(page_size: int, tile_n: int) -> int:
    """Pages one key block of tile_n keys spans: tile_n / page_size for blocks of several pages,
    else 1 (tile_n divides page_size). Raises for a tile that is neither."""
    if page_size < tile_n and tile_n % page_size == 0:
        return tile_n // page_size
    if page_size % tile_n == 0:
        return 1
    raise ValueError(f"a key block of {tile_n} keys must divide page_size {page_size} or be a multiple of it")


def short_block_stages(head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, num_stages: int) -> int:
    """K/V stages for short key blocks (paged caches with small pages): as many as keep about
    256 keys in flight (what two stages of 128 hold: a decode step is bound by memory, and the
    loads in flight set its bandwidth), at most 8, fewer where shared memory runs out; never
    fewer than num_stages. Not yet measured."""
    stages = max(num_stages, min(8, 256 // tile_n))
    while stages > num_stages:
        try:
            check_fits_ws(head_dim, tile_m, tile_n, stages, head_dim_v=head_dim_v)
            return stages
        except ValueError:
            stages -= 1
    return num_stages
