"""PNG charts from a results dict: grouped bars of TFLOP/s per backend (like the seed paper's
figures, one panel per head dim and causal setting, one chart per dtype) and the Table-1 tile
grid. Like the ratios, the charts show CUDA-graph time (kernel time), eager time (dotted bars,
"(e)") only for a backend that could not be captured. matplotlib is imported here only, and
without it the plots are skipped."""

from __future__ import annotations

import math
from pathlib import Path

from hopper_fmha.bench.flops import PASS_FLOPS
from hopper_fmha.bench.report import (
    PRIMARY,
    backends_in,
    by_problem,
    fell_back,
    has_graph,
    matmul_rate,
    mode_text,
    rate,
    tile_grids,
)

DPI = 100


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _x_label(p, panel) -> str:
    """Name a problem by what varies inside its panel: N, and B or heads when those vary too; a
    varlen problem by its range of lengths; a training problem's pass ("bwd", "fwd+bwd") after, and
    a problem's score features ("window4096/0", "softcap30", "sink") and v's head dim ("dv128")."""
    label = f"{p.seqlen_q}" if p.seqlen_q == p.seqlen_k else f"{p.seqlen_q}/{p.seqlen_k}"
    if p.seqlens is not None:
        label = f"varlen {min(p.seqlens)}-{p.seqlen_q}"
    if len({q.batch for q in panel}) > 1 and len({q.seqlen_q for q in panel}) == 1:
        label = f"B{p.batch} " + label
    if len({(q.heads, q.kv_heads) for q in panel}) > 1:
        label += f" H{p.heads}/{p.kv_heads}"
    if p.training:
        label += f" {p.passes}"
    if p.head_dim_v is not None:
        label += f" dv{p.head_dim_v}"
    return "\n".join([label, *(w.replace(" ", "") for w in p.feature_words())])


def _panel_order(p) -> tuple:
    """Where a problem stands in its panel: by N, batch, pass, then v's head dim and features (a
    feature problem after its twin without it)."""
    return (p.seqlen_q, p.seqlen_k, p.batch, list(PASS_FLOPS).index(p.passes), p.dv, p.feature_words())


def plot_bars(results: dict, path: Path, dtype: str, mode: str = PRIMARY) -> Path | None:
    """One chart for one dtype: panels (causal x head dim), x = seqlen, bars = backends. Decode
    problems are left out (their figure is TB/s: the report's decode table)."""
    groups = [(p, recs) for p, recs in by_problem(results) if p.dtype == dtype and not p.kvcache]
    backends = [b for b in backends_in(results) if "@" not in b[0]]
    if not groups or not backends:
        return None
    causals = sorted({p.causal for p, _ in groups})
    dims = sorted({p.head_dim for p, _ in groups})
    fig = _figure(3.6 * len(dims) + 1.6, 2.6 * len(causals) + 0.4)
    axes = fig.subplots(len(causals), len(dims), squeeze=False, sharey=True)
    colors = [f"C{i}" for i in range(10)]
    mm = matmul_rate(results)
    width = 0.8 / len(backends)
    for r, causal in enumerate(causals):
        for c, d in enumerate(dims):
            ax = axes[r][c]
            panel = sorted(
                [(p, recs) for p, recs in groups if p.causal == causal and p.head_dim == d],
                key=lambda x: _panel_order(x[0]),
            )
            probs = [p for p, _ in panel]
            for i, (name, label, _) in enumerate(backends):
                xs, ys, hatches = [], [], []
                for j, (_, recs) in enumerate(panel):
                    v = rate(recs[name], mode) if name in recs else None
                    if v is not None:
                        xs.append(j + (i - (len(backends) - 1) / 2) * width)
                        ys.append(v)
                        wrong = recs[name]["status"] == "wrong"
                        hatches.append("//" if wrong else ".." if fell_back(recs[name], mode) else "")
                bars = ax.bar(xs, ys, width, label=label, color=colors[i % 10])
                for bar, h in zip(bars, hatches, strict=True):
                    bar.set_hatch(h)
            if mm:
                ax.axhline(mm, color="gray", ls="--", lw=0.8, label="cuBLAS fp16 matmul")
            ax.set_xticks(range(len(panel)), [_x_label(p, probs) for p in probs], fontsize=7)
            ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(axis="y", alpha=0.3)
            if c == 0:
                ax.set_ylabel("TFLOP/s", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    env = results["env"]
    what = "CUDA graph; dotted: eager, not captured" if mode == PRIMARY else mode_text(mode)
    fig.suptitle(f"{results['preset']}, {dtype}, TFLOP/s ({what}): {env.get('device', '?')}", fontsize=10)
    fig.savefig(path, dpi=DPI)
    return Path(path)


def plot_tiles(results: dict, path: Path, mode: str = PRIMARY) -> Path | None:
    """The Table-1 grid: TFLOP/s per problem (rows) and tile (columns), one panel per variant."""
    import numpy as np

    grids = tile_grids(results, mode)
    if not grids:
        return None
    nrows = max(len(rows) for _, _, rows, _ in grids)
    fig = _figure(1.3 * max(len(t) for _, t, _, _ in grids) * len(grids) + 1.5, 0.55 * nrows + 1.2)
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    for ax, (variant, tiles, _, cells) in zip(axes, grids, strict=True):
        probs = list(dict.fromkeys(p for p, *_ in cells))
        grid = np.full((len(probs), len(tiles)), np.nan)
        text = [["" for _ in tiles] for _ in probs]
        for p, t, v, status, fallback in cells:
            i, j = probs.index(p), tiles.index(t)
            if v is not None:
                grid[i, j] = v
                text[i][j] = f"{v:.0f}" + (" ✗" if status == "wrong" else "") + (" (e)" if fallback else "")
            else:
                text[i][j] = status or ""
        finite = grid[np.isfinite(grid)]
        vmax = finite.max() if finite.size else 1.0
        ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        ax.set_facecolor("#dddddd")
        for i in range(len(probs)):
            for j in range(len(tiles)):
                v = grid[i, j]
                dark = math.isfinite(v) and v < 0.6 * vmax
                ax.text(
                    j, i, text[i][j], ha="center", va="center", fontsize=8, color="white" if dark else "black"
                )
        ax.set_xticks(range(len(tiles)), tiles, fontsize=8)
        same_shape = len({(p.batch, p.seqlen_q, p.heads * p.head_dim, p.causal, p.dtype) for p in probs}) == 1
        ax.set_yticks(
            range(len(probs)), [f"d={p.head_dim}" if same_shape else p.label() for p in probs], fontsize=8
        )
        ax.set_xlabel("tile (QBLK x KBLK)", fontsize=8)
        ax.set_title(f"hopper-fmha:{variant}, TFLOP/s ({mode_text(mode)})", fontsize=9)
    fig.savefig(path, dpi=DPI)
    return Path(path)


def write_plots(results: dict, out_dir: Path, stem: str) -> tuple[list[Path], str | None]:
    """All charts for a run: ([paths], None), or ([], why) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [], "matplotlib not installed: no PNG charts (re-render later with --from-json)"
    out_dir = Path(out_dir)
    mode = PRIMARY if has_graph(results) else "eager"
    paths = []
    for dtype in dict.fromkeys(p.dtype for p, _ in by_problem(results)):
        path = plot_bars(results, out_dir / f"{stem}-{dtype}.png", dtype, mode)
        if path:
            paths.append(path)
    path = plot_tiles(results, out_dir / f"{stem}-tiles.png", mode)
    if path:
        paths.append(path)
    return paths, None
