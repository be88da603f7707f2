"""One small attention call per (variant, head dim), for compute-sanitizer on the GPU machine.

    compute-sanitizer --tool memcheck python scripts/sanitize.py
    compute-sanitizer --tool racecheck python scripts/sanitize.py

Shapes have tails on both sides, GQA and causal with seqlen_q != seqlen_k, so every code path
(masked and unmasked key tiles, clipped TMA loads and stores) runs; 250 queries make two query
tiles at every head dim, so the non-causal ws calls run as CTA pairs (K/V multicast); at d = 256
the ws calls run both the short-problem tile (O through per-warpgroup buffers) and the table's. Prints
the max error against the fp32 reference; the sanitizer's own summary decides clean or not.
"""

import sys

import torch

import hopper_fmha
from hopper_fmha import config, kernels
from hopper_fmha.reference import reference

variants = sys.argv[1:] or ["paper", "ws"]
# ws also with 3 persistent CTAs, so that each runs several tiles (Q's barrier phases, the O
# buffer and, causal, the global tile counter reused across tiles).
runs = [(v, None) for v in variants] + ([("ws", 3)] if "ws" in variants else [])
for variant, ctas in runs:
    kernels.PERSISTENT_CTAS = ctas
    for d in (64, 128, 256):
        for causal in (False, True):
            torch.manual_seed(d)
            q = torch.randn(1, 250, 4, d, device="cuda", dtype=torch.float16)
            k = torch.randn(1, 517, 2, d, device="cuda", dtype=torch.float16)
            v = torch.randn(1, 517, 2, d, device="cuda", dtype=torch.float16)
            # The tile picked for these 517 keys, and the table's and a short problem's where they
            # differ from it (ws d = 256: O through per-warpgroup buffers at 128x64; paper d = 64:
            # 64x64 causal, 64x128 non-causal below 513 keys; ws d = 64 causal: 128x128).
            table = config.select_config(d, variant).tile
            picked = config.auto_tile(variant, d, causal, k.shape[1]) or table
            shortest = config.auto_tile(variant, d, causal, 1) or table
            tiles = [None] + sorted({table, shortest} - {picked})
            for tile in tiles:
                out = hopper_fmha.flash_attn_func(q, k, v, causal=causal, variant=variant, tile=tile)
                ref, _ = reference(q, k, v, causal=causal)
                err = (out.float() - ref).abs().max().item()
                print(
                    f"{variant} ctas={ctas} d={d} tile={tile} causal={causal}: max error {err:.2e}",
                    flush=True,
                )
