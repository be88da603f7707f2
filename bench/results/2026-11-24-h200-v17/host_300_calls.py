"""The issue's measurement: 300 back-to-back eager calls on a tiny problem, host µs per call."""
import os, sys, time
import torch
print("torch", torch.__version__, "native dlpack exchange api:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
import hopper_fmha, tvm_ffi
print("after tvm_ffi import:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"), "TVM_FFI_DISABLE_TORCH_C_DLPACK=", os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK"))
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
def per_call(f, n=300):
    for _ in range(30): f()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): f()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6
for d, causal in ((64, False), (128, False), (128, True)):
    q = torch.randn(1, 128, 2048 // d, d, device="cuda", dtype=torch.bfloat16); k = torch.randn_like(q); v = torch.randn_like(q)
    ours = per_call(lambda: hopper_fmha.flash_attn_func(q, k, v, causal=causal))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cud = per_call(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    print(f"d{d} causal={causal}: ours {ours[0]:.1f} us/call issue ({ours[1]:.1f} incl. drain); cuDNN {cud[0]:.1f} ({cud[1]:.1f})")
