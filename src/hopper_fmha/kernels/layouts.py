"""`hopper-fmha layouts`: the paper's register layouts, rebuilt from the kernel's own tiled MMAs.

The paper lists, for one thread, the GEMM-I accumulator `tSrS`, the A-operand fragment `tOrS` that
an RS-WGMMA for GEMM-II expects, and `tOrPLayout`, the accumulator re-viewed by ReshapeTStoTP
(`acc_to_operand_a_layout`) so that P feeds GEMM-II from the same registers. Layouts are static,
so they are read while `cute.compile` traces a tiny host function: no kernel, no GPU.
"""

from __future__ import annotations

import ast
import itertools

# (tile_m, tile_n, head_dim) = the paper's (bM, bN, bK) -> its listing "Tensors and Layouts for
# tile sizes", printed by CuTe C++ (`_n` marks a static integer).
PAPER_LISTING = {
    (128, 128, 128): {
        "tSrS": "((_2,_2,_16),_2,_1):((_1,_2,_4),_64,_0)",
        "tOrS": "((_2,_2,_2),_2,_8):((_1,_2,_4),_8,_16)",
        "tOrPLayout": "((_2,_2,_2),_2,_8):((_1,_2,_4),_64,_8)",
    },
    (64, 128, 128): {
        "tSrS": "((_2,_2,_16),_1,_1):((_1,_2,_4),_0,_0)",
        "tOrS": "((_2,_2,_2),_1,_8):((_1,_2,_4),_0,_8)",
        "tOrPLayout": "((_2,_2,_2),_1,_8):((_1,_2,_4),_0,_8)",
    },
}


def parse_layout(text: str) -> tuple[tuple, tuple]:
    """A printed layout, CuTe C++ `((_2,_2),_4):((_1,_2),_4)` or DSL style, as (shape, stride) tuples."""
    shape, stride = text.replace("_", "").split(":")
    return ast.literal_eval(shape), ast.literal_eval(stride)


def format_layout(shape, stride) -> str:
    """(shape, stride) -> "shape:stride" the way CuTe DSL prints a static layout."""
    return f"{shape}:{stride}".replace(" ", "")


def _flatten(t) -> list[int]:
    return [x for e in t for x in _flatten(e)] if isinstance(t, tuple) else [t]


def layout_values(shape, stride) -> list[int]:
    """The layout as a function: its value at every linear index, coordinates colexicographic."""
    sizes, strides = _flatten(shape), _flatten(stride)
    if len(sizes) != len(strides):
        raise ValueError(f"shape {shape} and stride {stride} are not congruent")
    # itertools.product varies the last factor fastest; reversed modes make the first the fastest.
    ranges = [range(n) for n in reversed(sizes)]
    return [
        sum(c * d for c, d in zip(reversed(coord), strides, strict=True))
        for coord in itertools.product(*ranges)
    ]


def compare(ours: tuple, paper: tuple) -> str:
    """`identical`, `equivalent` (same shape and same function, printed differently) or `DIFFERENT`."""
    if ours == paper:
        return "identical"
    if ours[0] == paper[0] and layout_values(*ours) == layout_values(*paper):
        return "equivalent"
    return "DIFFERENT"


def paper_layouts(tile_m: int, tile_n: int, head_dim: int, dtype: str = "float16") -> dict[str, tuple]:
    """Thread 0's tSrS, tOrS and tOrPLayout of `PaperFwdSm90`, as (shape, stride) int tuples."""
    import cutlass
    import cutlass.cute as cute

    from .sm90_common import acc_to_operand_a_layout
    from .sm90_paper import PaperFwdSm90

    element = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[dtype]
    kernel = PaperFwdSm90(element, head_dim, tile_m, tile_n, causal=False)
    found = {}

    @cute.jit
    def trace():
        tiled_mma_qk, tiled_mma_pv, _ = kernel._tiled_mmas()
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        tSrS = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((tile_m, tile_n)))
        tOrS = thr_mma_pv.make_fragment_A(thr_mma_pv.partition_shape_A((tile_m, tile_n)))
        for name, layout in (
            ("tSrS", tSrS.layout),
            ("tOrS", tOrS.layout),
            ("tOrPLayout", acc_to_operand_a_layout(tSrS.layout)),
        ):
            found[name] = (layout.shape, layout.stride)

    cute.compile(trace)
    return found


def cmd_layouts(args) -> int:
    print('The paper\'s listing "Tensors and Layouts for tile sizes" (thread 0), rebuilt from')
    print("PaperFwdSm90._tiled_mmas() and acc_to_operand_a_layout (ReshapeTStoTP), fp16:")
    ok = True
    for (tile_m, tile_n, head_dim), listing in PAPER_LISTING.items():
        ours = paper_layouts(tile_m, tile_n, head_dim)
        print(f"\n(bM, bN, bK) = ({tile_m}, {tile_n}, {head_dim})")
        for name, text in listing.items():
            verdict = compare(ours[name], parse_layout(text))
            ok &= verdict != "DIFFERENT"
            print(f"  {name:<10}  ours   {format_layout(*ours[name])}")
            print(f"  {'':<10}  paper  {text}  {verdict}")
    print("\nall layouts match the paper" if ok else "\nsome layouts DIFFER from the paper")
    return 0 if ok else 1


def register(subparsers) -> None:
    sub = subparsers.add_parser(
        "layouts", help="print the paper's register layouts as this kernel builds them"
    )
    sub.set_defaults(func=cmd_layouts)
