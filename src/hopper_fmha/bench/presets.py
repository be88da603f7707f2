"""Named problem grids.

paper: the seed paper's shape, B=4, N=4096, hidden 2048, fp16, d = 64/128/256, causal off and on.
sweep: FlashAttention-3's grid, 16k tokens and hidden 2048 at every length: N = 512..16384 with
       B = 16384/N and H = 2048/d, d = 64/128/256, causal off and on, fp16 and bf16.
host: tiny problems (B=1, N=128, hidden 2048, d = 64/128, causal off and on, bf16) whose
       kernels take a few µs, so that eager calls time the host path (use with --profile).
tiles: the seed paper's Table 1: the paper variant at every tile of PAPER_TILES and every head
       dim, paper shape, non-causal fp16, this package only (tiles that do not fit are reported
       as rejected). `tiles("ws")` (`--preset tiles --variant ws`) sweeps the ws variant's
       candidate tiles instead (preset name "tiles-ws").
varlen: packed batches of mixed lengths: 24 sequences, lengths drawn uniformly from the integers
       256..4096 (`random.Random(0).randint`, the same on every machine: `varlen_lengths`), queries
       and keys alike, bf16, 32 q heads / 8 kv heads, d = 64 and 128, causal off and on; each
       followed by its dense twin (`dense_twin`). Backends: ours (`hopper-fmha:auto`, which runs
       `flash_attn_varlen_func` on them), FA4's varlen, and `hopper-fmha:padded` (our dense kernel
       on the batch zero-padded to the longest sequence: the number before varlen). FLOPs are
       counted per sequence (sum of 4·H·L²·d, halved for causal), for the padded call too.
       The dense twin of a varlen problem: batch = its number of sequences, N = the root mean
       square of its lengths rounded to a multiple of 128 (so about the same FLOPs, N² ≈ mean
       L², and tokens), the same heads, d, dtype and causal. The report gives, per varlen
       problem, ours ÷ FA4 (target ≥ 1.0) and ours on it ÷ the same backend on its twin
       (target ≥ 0.95: varlen costs at most 5% over a dense batch of the same work).
decode: one decode step against a KV cache, bf16, 32 q heads / 8 kv heads, d = 128, no tokens
       appended in the timed call: (a) batch 64 at 8192 cached tokens, one query token, full
       cache; (b) the same with ragged lengths, drawn uniformly from the integers 1..8192
       (`random.Random(0).randint`: `decode_lengths`, 270,570 tokens in all, 52% of the
       capacity); (c) the same as (a) paged, at page sizes 16, 64 and 256 (the pages shuffled:
       `runner.page_table`); (d) batch 1 and 4 at 131072 cached tokens (split-KV); (e)
       speculative decoding: (a) with 4 query tokens, causal. Backends: ours
       (`flash_attn_with_kvcache`), cuDNN (SDPA, dense caches), FA4 (dense and paged) and the
       `copy` yardstick (`registry` docstring). Bytes = K and V of the tokens attended
       (`Problem.kv_bytes`): 2 GiB in every cell but (b) (1.03 GiB) and batch 1 (0.5 GiB); one
       input set holds the whole cache (2 GiB; batch 1: 0.5 GiB), so 2 sets rotate (> 2×L2), and
       the copy adds two buffers of the bytes read per set: at most about 12 GiB per cell. The
       report's decode table gives per cell TB/s, ours ÷ the best peer (target ≥ 1.0), % of the
       copy, and ours ÷ ours on the twin (`decode_twin`: paged ÷ dense, target ≥ 0.9; ragged ÷
       full, the cost in proportion to the tokens read).
backward: the paper's shape (B=4, N=4096, hidden 2048: d64/H32, d128/H16, d256/H8, kv heads =
       heads, causal off and on, fp16; `--dtype` for bf16 too), each problem twice: "bwd", the
       backward alone (the forward run once, untimed, then `torch.autograd.grad(out, (q, k, v),
       dout, retain_graph=True)` timed, dout random), and "fwd+bwd", the forward then that grad
       (`registry.autograd_call`). FLOPs 2.5 and 3.5 times the forward's (FlashAttention's
       convention, causal halved as the forward's). Backends, all through autograd: ours
       (`hopper-fmha:auto`, flash_attn_func), FA4, cuDNN (SDPA) and FA2 (`sdpa-flash`, PyTorch's
       FlashAttention-2, the registry's "fa2"). Timed eagerly only (`runner.TRAINING_NOT_CAPTURED`);
       dq, dk, dv checked against the fp32 reference's (`runner.GradChecker`).
features: the forward's score features and head dims, bf16, kv heads = heads, each feature
       problem after its twin without the feature (`feature_twin`): (a) sliding window: B=1,
       N=32768, d128 H16 (hidden 2048), causal, then causal with window_size (4096, 0) (left
       4096, right 0); FLOPs count the visible (query, key) pairs exactly (`flops.visible_pairs`),
       the causal twin the simple half (a fraction 1/N apart); (b) softcap: B=4 N=4096 d128 H16,
       causal off and on, without and with softcap 30; (c) head dims: B=4 N=4096 H16, causal off
       and on, d96 and d192 with v's head dim 128 (DeepSeek's shape; FLOPs 2·B·H·N²·(d + dv),
       halved for causal); (d) learnable sink: B=4 N=4096 d64 H32 causal, without and with a
       sink (`registry.sink_logits`). Backends: ours (`hopper-fmha:auto`), FA4 (the same
       keywords, `registry.fa4_feature_kwargs`), cuDNN (SDPA: it has no window, softcap or sink,
       so those cells are skipped, not emulated with a mask; the head dims it may take or refuse).
       The report's features table gives per problem ours ÷ FA4 (target ≥ 1.0) and ours ÷ ours on
       the twin (window ÷ causal, softcap ÷ plain, sink ÷ plain: target ≥ 0.9).
backward-features: the backward's newer problems, bf16, each as "bwd" then "fwd+bwd" (as the
       backward preset: through autograd, eager time only, FLOPs 2.5 and 3.5 times the forward's,
       dq, dk, dv checked against the fp32 reference's): (a) varlen: the varlen preset's packed
       batch (24 sequences of `varlen_lengths()`, 32 q heads / 8 kv heads, d128), causal off and
       on (FLOPs per sequence); (b) sliding window: B=1 N=16384 d128 H16 causal, then causal with
       window_size (4096, 0) (FLOPs on the visible pairs; N half the features preset's, for the
       backward's time and the fp32 reference's memory); (c) softcap: B=4 N=4096 d128 H16, causal
       off and on, each without then with softcap 30; (d) learnable sink: B=4 N=4096 d64 H32
       causal, without then with a sink (`registry.sink_logits`, requiring grad: the backends
       compute its gradient; the check covers dq, dk, dv, not the sink's); (e) head dims: B=4
       N=4096 H16, d192 with v's head dim 128 (DeepSeek's shape; FLOPs 2·B·H·N²·(d + dv) for the
       forward), causal off and on (ours: the wide kernel, `backward.WIDE_BACKWARD`, skipped with
       NotImplementedError while that is off). Backends: ours
       (`hopper-fmha:auto`: flash_attn_func, or flash_attn_varlen_func on the packed batch), ours
       deterministic (`hopper-fmha:auto+det`) and FA4 (the same keywords and calls as in the
       features and varlen presets). 24 problems. The report's features table gives ours ÷ FA4
       and ÷ ours on the twin for each pass, the varlen table ours ÷ FA4.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from hopper_fmha.bench.flops import BWD, FWD, FWD_BWD
from hopper_fmha.bench.registry import COPY, Problem

HIDDEN = 2048
TOKENS = 16384
HEAD_DIMS = (64, 128, 256)
SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
# The ws variant's candidate tiles: tile_m 128 (2 consumer warpgroups) with tile_n 64..176, and
# tile_m 192 (3 consumer warpgroups); hopper_fmha.config rejects those that do not fit a head dim.
WS_TILES = (
    (128, 64), (128, 80), (128, 96), (128, 112), (128, 128), (128, 144), (128, 160), (128, 176),
    (192, 64), (192, 96), (192, 128),
)  # fmt: skip


@dataclass(frozen=True)
class Preset:
    name: str
    problems: tuple[Problem, ...]
    backends: tuple[str, ...] | None = None  # None: the default set (or --backends)


def _problem(batch: int, seqlen: int, head_dim: int, causal: bool, dtype: str, passes: str = FWD) -> Problem:
    heads = HIDDEN // head_dim
    return Problem(batch, seqlen, seqlen, heads, heads, head_dim, causal, dtype, passes=passes)


def paper() -> Preset:
    problems = [_problem(4, 4096, d, c, "float16") for d in HEAD_DIMS for c in (False, True)]
    return Preset("paper", tuple(problems))


def sweep() -> Preset:
    problems = [
        _problem(TOKENS // n, n, d, c, dtype)
        for dtype in ("float16", "bfloat16")
        for d in HEAD_DIMS
        for c in (False, True)
        for n in SWEEP_SEQLENS
    ]
    return Preset("sweep", tuple(problems))


def tile_candidates(variant: str) -> tuple[tuple[int, int], ...]:
    from hopper_fmha.config import PAPER_TILES

    candidates = {"paper": PAPER_TILES, "ws": WS_TILES}
    if variant not in candidates:
        raise ValueError(f"--preset tiles sweeps the variants {tuple(candidates)}, not {variant!r}")
    return tuple(candidates[variant])


def tiles(variant: str = "paper") -> Preset:
    problems = [_problem(4, 4096, d, False, "float16") for d in HEAD_DIMS]
    backends = tuple(f"hopper-fmha:{variant}@{m}x{n}" for m, n in tile_candidates(variant))
    return Preset("tiles" if variant == "paper" else f"tiles-{variant}", tuple(problems), backends)


def host() -> Preset:
    problems = [_problem(1, 128, d, c, "bfloat16") for d in (64, 128) for c in (False, True)]
    return Preset("host", tuple(problems))


VARLEN_SEQUENCES = 24
VARLEN_LENGTHS = (256, 4096)
VARLEN_SEED = 0


def varlen_lengths(
    count: int = VARLEN_SEQUENCES, lengths: tuple[int, int] = VARLEN_LENGTHS, seed: int = VARLEN_SEED
) -> tuple[int, ...]:
    """`count` lengths drawn uniformly from the integers lengths[0]..lengths[1], from Python's own
    generator (not torch's), so that every machine draws the same."""
    rng = random.Random(seed)
    return tuple(rng.randint(*lengths) for _ in range(count))


def dense_twin(p: Problem) -> Problem:
    """The dense problem a varlen one is compared with (module docstring), in the same pass."""
    rms = math.sqrt(sum(n * n for n in p.seqlens) / len(p.seqlens))
    n = max(128, round(rms / 128) * 128)
    return Problem(p.batch, n, n, p.heads, p.kv_heads, p.head_dim, p.causal, p.dtype, passes=p.passes)


def varlen() -> Preset:
    lens = varlen_lengths()
    problems = []
    for d in (128, 64):
        for causal in (False, True):
            p = Problem.varlen(lens, 32, 8, d, causal, "bfloat16")
            problems += [p, dense_twin(p)]
    return Preset("varlen", tuple(problems), ("hopper-fmha:auto", "fa4", "hopper-fmha:padded"))


DECODE_SEED = 0
DECODE_PAGE_SIZES = (16, 64, 256)


def decode_lengths(batch: int, capacity: int, seed: int = DECODE_SEED) -> tuple[int, ...]:
    """`batch` cache lengths drawn uniformly from the integers 1..capacity by Python's own
    generator (the same on every machine)."""
    rng = random.Random(seed)
    return tuple(rng.randint(1, capacity) for _ in range(batch))


def decode_twin(p: Problem) -> Problem | None:
    """The cell a decode problem is compared with: a paged one's dense cache, else a ragged one's
    full cache; None for a dense full cache."""
    if p.page_size:
        return dataclasses.replace(p, page_size=None)
    if p.cache_seqlens:
        return dataclasses.replace(p, cache_seqlens=None)
    return None


def decode() -> Preset:
    shape = {"heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
    dense = Problem.decode(64, 8192, **shape)
    problems = [dense, Problem.decode(64, 8192, **shape, cache_seqlens=decode_lengths(64, 8192))]
    problems += [dataclasses.replace(dense, page_size=n) for n in DECODE_PAGE_SIZES]
    problems += [Problem.decode(b, 131072, **shape) for b in (1, 4)]
    problems.append(Problem.decode(64, 8192, **shape, seqlen_q=4, causal=True))
    return Preset("decode", tuple(problems), ("hopper-fmha:auto", "sdpa-cudnn", "fa4", COPY))


TRAINING_PASSES = (BWD, FWD_BWD)
# "+det": ours with deterministic=True (target: >= 85% of the plain backward's rate, same run).
BACKWARD_BACKENDS = ("hopper-fmha:auto", "hopper-fmha:auto+det", "fa4", "sdpa-cudnn", "sdpa-flash")


def backward() -> Preset:
    """The paper's problems (fp16; `with_dtypes` for others), each as the backward alone and as
    the forward then the backward, in that order, head dim then causal (module docstring)."""
    problems = [
        _problem(4, 4096, d, c, "float16", passes)
        for d in HEAD_DIMS
        for c in (False, True)
        for passes in TRAINING_PASSES
    ]
    return Preset("backward", tuple(problems), BACKWARD_BACKENDS)


FEATURE_WINDOW = (4096, 0)  # (left, right): each query sees itself and the 4096 keys before it
FEATURE_WINDOW_SEQLEN = 32768
FEATURE_SOFTCAP = 30.0
FEATURE_BACKENDS = ("hopper-fmha:auto", "fa4", "sdpa-cudnn")


def feature_twin(p: Problem) -> Problem | None:
    """The problem a feature problem is compared with: the same without its window, softcap and
    sink (v's head dim kept); None for a problem without any."""
    if not p.has_features:
        return None
    return dataclasses.replace(p, window_size=(-1, -1), softcap=0.0, sink=False)


def features() -> Preset:
    """The sliding window, softcap, head-dim and sink problems, each feature problem right after
    its twin (module docstring)."""
    bf16 = "bfloat16"
    causal_32k = _problem(1, FEATURE_WINDOW_SEQLEN, 128, True, bf16)
    problems = [causal_32k, dataclasses.replace(causal_32k, window_size=FEATURE_WINDOW)]
    for c in (False, True):
        plain = _problem(4, 4096, 128, c, bf16)
        problems += [plain, dataclasses.replace(plain, softcap=FEATURE_SOFTCAP)]
    for d, dv in ((96, None), (192, 128)):
        problems += [Problem(4, 4096, 4096, 16, 16, d, c, bf16, head_dim_v=dv) for c in (False, True)]
    plain = _problem(4, 4096, 64, True, bf16)
    problems += [plain, dataclasses.replace(plain, sink=True)]
    return Preset("features", tuple(problems), FEATURE_BACKENDS)


BACKWARD_FEATURE_WINDOW_SEQLEN = 16384
BACKWARD_FEATURE_BACKENDS = ("hopper-fmha:auto", "hopper-fmha:auto+det", "fa4")


def backward_features() -> Preset:
    """The varlen, sliding-window, softcap and sink problems, each timed as the backward alone
    then as the forward and the backward, each feature problem's passes after its twin's (module
    docstring)."""
    bf16 = "bfloat16"
    varlens = [Problem.varlen(varlen_lengths(), 32, 8, 128, c, bf16) for c in (False, True)]
    causal = _problem(1, BACKWARD_FEATURE_WINDOW_SEQLEN, 128, True, bf16)
    dense = [causal, dataclasses.replace(causal, window_size=FEATURE_WINDOW)]
    for c in (False, True):
        plain = _problem(4, 4096, 128, c, bf16)
        dense += [plain, dataclasses.replace(plain, softcap=FEATURE_SOFTCAP)]
    plain = _problem(4, 4096, 64, True, bf16)
    dense += [plain, dataclasses.replace(plain, sink=True)]
    dense += [Problem(4, 4096, 4096, 16, 16, 192, c, bf16, head_dim_v=128) for c in (False, True)]
    problems = [dataclasses.replace(p, passes=x) for p in varlens + dense for x in TRAINING_PASSES]
    return Preset("backward-features", tuple(problems), BACKWARD_FEATURE_BACKENDS)


PRESETS = {
    "paper": paper, "sweep": sweep, "tiles": tiles, "host": host, "varlen": varlen, "decode": decode,
    "backward": backward, "features": features, "backward-features": backward_features,
}  # fmt: skip


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


def with_dtypes(problems: tuple[Problem, ...], dtypes: list[str]) -> tuple[Problem, ...]:
    """A preset's problems in the given dtypes (`--dtype` beside `--preset`), dtype-major, in order."""
    shapes = list(dict.fromkeys(dataclasses.replace(p, dtype="float16") for p in problems))
    return tuple(dataclasses.replace(p, dtype=dt) for dt in dtypes for p in shapes)


def custom_problems(
    batch: int | None,
    seqlens: list[int],
    seqlens_k: list[int] | None,
    heads: int | None,
    kv_heads: int | None,
    head_dims: list[int],
    causal: bool,
    dtypes: list[str],
) -> tuple[Problem, ...]:
    """The grid given by free flags. Unset heads give hidden 2048 (H = 2048/d); an unset batch
    gives 16k tokens (B = 16384/N, at least 1), as in the presets."""
    if seqlens_k and len(seqlens_k) not in (1, len(seqlens)):
        raise ValueError("--seqlen-k takes one value or as many as --seqlen")
    out = []
    for dtype in dtypes:
        for d in head_dims:
            for i, n in enumerate(seqlens):
                nk = (seqlens_k[i] if len(seqlens_k) > 1 else seqlens_k[0]) if seqlens_k else n
                h = heads if heads is not None else max(1, HIDDEN // d)
                b = batch if batch is not None else max(1, TOKENS // n)
                out.append(Problem(b, n, nk, h, kv_heads if kv_heads is not None else h, d, causal, dtype))
    return tuple(out)
