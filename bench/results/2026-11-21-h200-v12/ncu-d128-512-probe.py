"""d128 N=512 bf16 (sweep shape B=32 H=16): ours x2 then cuDNN x2, non-causal then causal (for ncu)."""
import sys, torch
import hopper_fmha
from torch.nn.attention import sdpa_kernel, SDPBackend
torch.manual_seed(0)
B, N, H, d = 32, 512, 16, 128
q, k, v = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    for _ in range(2):
        hopper_fmha.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(2):
            torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    torch.cuda.synchronize()
    print("done causal", causal, flush=True)
