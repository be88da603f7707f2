"""ours x3 then FA4 x3 on a paper shape (for ncu): prof2.py D [causal]"""
import sys, torch, hopper_fmha
from flash_attn.cute import flash_attn_func as fa4
d = int(sys.argv[1]); H = 2048 // d; causal = len(sys.argv) > 2 and sys.argv[2] == "1"
torch.manual_seed(0)
q, k, v = (torch.randn(4, 4096, H, d, device="cuda", dtype=torch.float16) for _ in range(3))
import hopper_fmha.kernels as hk
for mode in ("auto", "single"):
  hk.SCHEDULE = mode
  for _ in range(3):
    hopper_fmha.flash_attn_func(q, k, v, causal=causal)
for _ in range(3):
    fa4(q, k, v, causal=causal)
torch.cuda.synchronize(); print("prof done", d)
