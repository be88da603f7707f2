"""Where an eager call's host time goes: `flash_attn_func` and each stage of its path, timed alone.

Each stage runs `calls` times back to back on one problem, then the GPU is synchronized; the
figure is wall time per call. On a tiny problem the GPU keeps up, so this is the host's time
(the whole call's figure is what a user sees when the launch queue never fills). Stages:

    flash_attn_func      the public call, as a user makes it (no return_lse)
    validate             argument rules and the kernel config (`interface._validate`)
    device check         one CUDA device, a Hopper (`interface._check_device`)
    allocate out, lse    `interface._empty_outputs`
    conform strides      `interface._conforming` of q, k and v
    kernels.forward      launch config, compiled-kernel lookup, schedule, the call into the kernel
    kernel call          the compiled kernel alone (TVM-FFI: arguments to DLPack, the launch)
    torch.empty          one 16-bit allocation of out's size, for scale
"""

from __future__ import annotations

import time


def host_stages(q, k, v, causal: bool, calls: int = 300) -> dict[str, float]:
    """Host µs per call of each stage (module docstring), for q, k, v on a Hopper GPU."""
    import torch

    from hopper_fmha import interface, kernels

    scale, cfg = interface._validate(q, k, v, None, causal, None, None)
    out, lse = interface._empty_outputs(q, v.shape[3])
    fn, args = kernels.prepared_launch(q, k, v, out, lse, scale, causal, cfg, exact_lse=False)
    stages = {
        "flash_attn_func": lambda: interface.flash_attn_func(q, k, v, causal=causal),
        "validate": lambda: interface._validate(q, k, v, None, causal, None, None),
        "device check": lambda: interface._check_device(q, k, v),
        "allocate out, lse": lambda: interface._empty_outputs(q, v.shape[3]),
        "conform strides": lambda: (
            interface._conforming(q),
            interface._conforming(k),
            interface._conforming(v),
        ),
        "kernels.forward": lambda: kernels.forward(q, k, v, out, lse, scale, causal, cfg, exact_lse=False),
        "kernel call": lambda: fn(*args),
        "torch.empty": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
    }
    result = {}
    for name, stage in stages.items():
        for _ in range(20):
            stage()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            stage()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        result[name] = (t1 - t0) / calls * 1e6
    return result
