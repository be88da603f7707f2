"""The benchmark suite behind `hopper-fmha bench`: the only source of performance claims.

flops     the one FLOP formula
registry  backends by name (this package, SDPA flash/efficient/cuDNN, FA4, FA3, the copy
          yardstick) and `Problem`
presets   the paper / sweep / tiles / host / varlen / decode / backward grids
timing    CUDA-event timing of eager calls and CUDA-graph replays, interleaved rounds,
          input rotation, pre-heat and matmul rate
runner    inputs, correctness check against the reference, one record per (problem, backend)
report    JSON file, Markdown and terminal tables, the claims summary
plots     PNG charts (matplotlib, optional)
cli       the `bench` subcommand

Nothing here imports torch, CUDA or the kernels until a run needs them.
"""

from hopper_fmha.bench.flops import attention_flops
from hopper_fmha.bench.registry import Problem
from hopper_fmha.bench.report import load_results, render_markdown

__all__ = ["Problem", "attention_flops", "load_results", "render_markdown"]
