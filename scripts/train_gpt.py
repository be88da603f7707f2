"""Train a small GPT with hopper_fmha's attention and with PyTorch SDPA, and compare the loss curves.

The evidence for "a model trains through hopper_fmha's backward": two copies of one GPT, the same
initial weights (one seed) and the same batches, differ only in the attention call:

- `--attention hopper`: `hopper_fmha.flash_attn_func(q, k, v, causal=True)`, q, k, v and out in
  FlashAttention's layout (batch, seqlen, heads, head_dim);
- `--attention sdpa`: `torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)` on
  (batch, heads, seqlen, head_dim) views of the same tensors.

`--attention both` (the default) first compares the gradients of one step at the initial weights
(each bf16 attention against fp32 SDPA), then trains the two models one after the other for
`--steps` steps and compares the curves. The run fails (exit status 1) unless

- the curves agree: the mean losses of the last `--window` (20) steps are within `--rel-tol` (2%)
  of each other, relative to SDPA's, and each is at least `--min-drop` (30%) below that run's
  first loss (all losses finite);
- the gradient check passes: for every parameter tensor, hopper's relative error against the
  fp32 reference is at most 2x SDPA's + 0.01 (FlashAttention's own test rule, with slack for
  tensors whose gradients are tiny), so a wrong dQ, dK or dV fails even if training looks fine.

Exit status 2: the run could not start (no Hopper GPU for `--attention hopper`, no backward in
this hopper_fmha, bad options). A single attention's run fails if its losses are not finite or
its curve does not drop by `--min-drop`.

Model: token + learned position embeddings, `--layers` pre-LayerNorm blocks (causal
self-attention, MLP 4x with GELU), final LayerNorm, head tied to the token embedding. Defaults:
4 layers, d_model 512, 8 heads (head_dim 64), seqlen 1024, batch 8, vocab 512; AdamW lr 3e-4
(betas 0.9/0.95, weight decay 0.1 on matrices), 30 warmup steps then cosine to lr/10, gradient
norm clipped at 1. On CUDA the forward runs under bf16 autocast (fp32 weights, gradients and
AdamW state; attention sees bf16 q, k, v); on CPU everything is fp32 (`--dtype` overrides).

Data: synthetic and learnable, generated before training from a seeded generator (the same
batches for every attention): each sequence follows one of `--chains` (2) fixed random
first-order Markov chains over the vocab, each token having `--successors` (4) possible next
tokens with random probabilities. The loss starts at log(vocab) (6.24 at the defaults); the
current token alone can bring it to the data's bigram entropy (1.61); the context, read through
attention (the last transitions name the chain), towards the "oracle" loss of a model that knows
the chain (1.08). With 8 chains a CPU-sized model (4 layers, d_model 256, 512 tokens a step)
dropped 22% in 300 steps at lr 3e-4; with 2 it dropped 55%.

On the GPU machine, from the project root (about a minute on an H200, mostly CUDA start-up and
kernel compilation; each 300-step training takes seconds):

    source .gpu/activate.sh && python scripts/train_gpt.py --out $OUT/train

CPU smoke test (SDPA only; hopper_fmha needs a Hopper GPU):

    python scripts/train_gpt.py --device cpu --attention sdpa --steps 30 --layers 2 --d-model 64 \\
        --heads 2 --seqlen 32 --vocab 32 --lr 3e-3 --warmup 5 --window 5 --min-drop 0.1 --out /tmp/train
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent

# (batch, seqlen, heads, head_dim) q, k, v -> out of the same shape (FlashAttention's layout).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CannotRun(Exception):
    """The run cannot start here (exit status 2, a message and no traceback)."""


@dataclasses.dataclass
class Config:
    steps: int = 300
    batch: int = 8
    seqlen: int = 1024
    layers: int = 4
    d_model: int = 512
    heads: int = 8
    vocab: int = 512
    lr: float = 3e-4
    warmup: int = 30
    seed: int = 0
    chains: int = dataclasses.field(default=2, metadata={"help": "Markov chains of the data"})
    successors: int = dataclasses.field(default=4, metadata={"help": "next tokens per token and chain"})
    dtype: str = "bf16"  # "bf16": bf16 autocast over fp32 weights; "fp32": no autocast
    window: int = dataclasses.field(default=20, metadata={"help": "steps of the final mean and smoothing"})
    rel_tol: float = dataclasses.field(default=0.02, metadata={"help": "agreement: final means' rel. diff"})
    min_drop: float = dataclasses.field(
        default=0.30, metadata={"help": "trained: final <= (1 - this) x first"}
    )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


# ---- attention ----


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch SDPA behind FlashAttention's layout: (B, T, H, D) in and out."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return out.transpose(1, 2)


def _import_hopper_fmha():
    try:
        import hopper_fmha
    except Exception as e:
        raise CannotRun(f"cannot import hopper_fmha ({type(e).__name__}: {e})") from e
    return hopper_fmha


def _hopper_attention_fn(hopper_fmha) -> AttentionFn:
    def hopper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return hopper_fmha.flash_attn_func(q, k, v, causal=True)

    return hopper_attention


def get_attention(name: str, device: torch.device, cfg: Config) -> AttentionFn:
    """The attention callable for `name`; for hopper, first checks that it can train here."""
    if name == "sdpa":
        return sdpa_attention
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        found = "no CUDA device" if device.type != "cuda" else torch.cuda.get_device_name(device)
        raise CannotRun(
            f"--attention {name} needs a Hopper GPU (sm_90, H100/H200) and --device cuda; found {found}. "
            "On this machine run --attention sdpa."
        )
    if cfg.dtype != "bf16":
        raise CannotRun("--attention hopper needs --dtype bf16 (hopper_fmha takes fp16/bf16 only)")
    fn = _hopper_attention_fn(_import_hopper_fmha())
    # Preflight at the training shape (the kernels it compiles are the training's): does the output
    # carry a gradient, and is that gradient finite?
    q, k, v = (
        torch.randn(
            cfg.batch,
            cfg.seqlen,
            cfg.heads,
            cfg.head_dim,
            device=device,
            dtype=torch.bfloat16,
            requires_grad=True,
        )
        for _ in range(3)
    )
    try:
        out = fn(q, k, v)
        if out.grad_fn is None:
            raise RuntimeError("the output has no grad_fn: gradients would stop at the attention")
        out.float().square().sum().backward()
    except Exception as e:
        raise CannotRun(f"hopper_fmha cannot train here: {type(e).__name__}: {e}") from e
    if not all(t.grad is not None and bool(t.grad.isfinite().all()) for t in (q, k, v)):
        raise CannotRun("hopper_fmha's backward gave missing or non-finite gradients in the preflight check")
    return fn


# ---- model ----


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attention: AttentionFn = sdpa_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seqlen, width = x.shape
        q, k, v = self.qkv(x).view(batch, seqlen, 3, self.heads, self.head_dim).unbind(2)
        out = self.attention(q, k, v)  # (batch, seqlen, heads, head_dim)
        return self.proj(out.reshape(batch, seqlen, width))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seqlen, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                # Projections into the residual stream start smaller, one per block side.
                std = (
                    0.02 / math.sqrt(2 * cfg.layers)
                    if name.endswith(("proj.weight", "mlp.2.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def set_attention(self, fn: AttentionFn) -> None:
        for block in self.blocks:
            block.attn.attention = fn

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()  # logits, head tied to the embedding


def build_model(cfg: Config, device: torch.device) -> GPT:
    torch.manual_seed(cfg.seed)  # the same initial weights for every attention
    return GPT(cfg).to(device)


def loss_of(model: GPT, batch: torch.Tensor, cfg: Config, amp: bool | None = None) -> torch.Tensor:
    amp = cfg.dtype == "bf16" if amp is None else amp
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# ---- data ----


def make_data(cfg: Config, device: torch.device) -> tuple[torch.Tensor, float]:
    """Every batch of the run, (steps, batch, seqlen + 1) int64 tokens, and the oracle loss.

    Sequence b follows chain c_b (uniform over the chains): token x is followed by succ[c_b, x, j]
    with probability prob[c_b, x, j], j < successors (distinct successors, probabilities from a
    flat Dirichlet). The oracle loss is the mean of -log prob over the predicted tokens: the loss
    of a model that knows each sequence's chain.
    """
    g = torch.Generator().manual_seed(cfg.seed + 1)
    C, V, K = cfg.chains, cfg.vocab, cfg.successors
    succ = torch.rand(C, V, V, generator=g).argsort(-1)[..., :K]
    prob = -torch.rand(C, V, K, generator=g).log()
    prob /= prob.sum(-1, keepdim=True)
    cum = prob.cumsum(-1).view(C * V, K)
    n, length = cfg.steps * cfg.batch, cfg.seqlen + 1
    chain = torch.randint(C, (n,), generator=g)
    uniform = torch.rand(length, n, 1, generator=g)
    tokens = torch.empty(length, n, dtype=torch.long)  # position-major: one row per step below
    rows = torch.empty(length - 1, n, dtype=torch.long)  # chain * V + token: the transition used
    choice = torch.empty(length - 1, n, dtype=torch.long)  # which successor
    tokens[0] = torch.randint(V, (n,), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a thousand small steps: threads cost more than they give (10x here)
    try:
        for t in range(1, length):
            torch.add(tokens[t - 1], chain, alpha=V, out=rows[t - 1])
            torch.sum(uniform[t] > cum[rows[t - 1]], -1, out=choice[t - 1]).clamp_(max=K - 1)
            tokens[t] = succ.view(C * V, K)[rows[t - 1], choice[t - 1]]
    finally:
        torch.set_num_threads(threads)
    oracle = -prob.view(C * V, K)[rows, choice].log().mean().item()
    tokens = tokens.t().contiguous()
    return tokens.view(cfg.steps, cfg.batch, length).to(device), oracle


# ---- training ----


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lr_at(step: int, cfg: Config) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    cfg: Config, attention: AttentionFn, data: torch.Tensor, device: torch.device, label: str = ""
) -> dict:
    """Train a fresh model (seeded weights) on `data`; the loss per step and the throughput."""
    model = build_model(cfg, device)
    model.set_attention(attention)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    losses = torch.empty(cfg.steps, device=device)
    timed_from = min(10, cfg.steps // 3)  # the first steps compile kernels and warm caches: untimed
    log_every = max(1, cfg.steps // 6)
    _sync(device)
    start = time.perf_counter()
    first_step_s = timed_start = None
    for step in range(cfg.steps):
        if step == timed_from:
            _sync(device)
            timed_start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = loss_of(model, data[step], cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses[step] = loss.detach()
        if step == 0:
            _sync(device)
            first_step_s = time.perf_counter() - start
        if step % log_every == 0 or step == cfg.steps - 1:
            print(f"  [{label}] step {step:4d}  loss {loss.item():.4f}", flush=True)
    _sync(device)
    end = time.perf_counter()
    timed_steps = cfg.steps - timed_from
    return {
        "losses": [round(x, 5) for x in losses.tolist()],
        "tokens_per_s": timed_steps * cfg.batch * cfg.seqlen / (end - timed_start),
        "first_step_s": first_step_s,
        "train_s": end - start,
    }


def gradient_check(
    cfg: Config, attentions: dict[str, AttentionFn], batch: torch.Tensor, device: torch.device
) -> dict:
    """One step's gradients at the initial weights: each attention (in cfg.dtype) against SDPA in
    fp32. Passes if, for every parameter tensor, the candidate's relative error is at most twice
    SDPA's plus 0.01."""
    model = build_model(cfg, device)
    grads = {}
    runs = [("fp32 sdpa", sdpa_attention, False)] + [(name, fn, None) for name, fn in attentions.items()]
    for name, fn, amp in runs:
        model.set_attention(fn)
        model.zero_grad(set_to_none=True)
        loss_of(model, batch, cfg, amp=amp).backward()
        grads[name] = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    ref = grads.pop("fp32 sdpa")

    def rel(g: dict, n: str) -> float:
        return ((g[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item()

    def total(g: dict) -> float:
        diff = sum(((g[n] - ref[n]) ** 2).sum() for n in ref)
        return (diff / sum((ref[n] ** 2).sum() for n in ref)).sqrt().item()

    result = {"reference": "sdpa fp32", "rule": "rel_err <= 2 * sdpa_rel_err + 0.01 per parameter tensor"}
    result["rel_err"] = {name: total(g) for name, g in grads.items()}
    result["ok"] = True
    for name, g in grads.items():
        if name == "sdpa":
            continue
        worst = max(ref, key=lambda n: rel(g, n) - 2 * rel(grads["sdpa"], n))
        bound = 2 * rel(grads["sdpa"], worst) + 0.01
        result[f"{name}_worst"] = {"parameter": worst, "rel_err": rel(g, worst), "bound": bound}
        result["ok"] = result["ok"] and rel(g, worst) <= bound
    return result


# ---- comparison ----


def smooth(losses: list[float], window: int) -> list[float]:
    """Trailing moving average (over the available steps at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(losses):
        acc += x - (losses[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def final_loss(losses: list[float], window: int = 20) -> float:
    tail = losses[-window:]
    return sum(tail) / len(tail)


def trained(losses: list[float], window: int = 20, min_drop: float = 0.30) -> bool:
    """Finite, and the mean of the last `window` steps is `min_drop` below the first loss."""
    return all(math.isfinite(x) for x in losses) and final_loss(losses, window) <= (1 - min_drop) * losses[0]


def curves_agree(
    candidate: list[float],
    reference: list[float],
    window: int = 20,
    rel_tol: float = 0.02,
    min_drop: float = 0.30,
) -> bool:
    """Two loss curves agree iff both trained (finite, final mean `min_drop` below the first loss)
    and the means of their last `window` steps are within `rel_tol` of the reference's."""
    if not (trained(candidate, window, min_drop) and trained(reference, window, min_drop)):
        return False
    a, b = final_loss(candidate, window), final_loss(reference, window)
    return abs(a - b) <= rel_tol * b


def compare(candidate: list[float], reference: list[float], cfg: Config) -> dict:
    sa, sb = smooth(candidate, cfg.window), smooth(reference, cfg.window)
    diffs = [abs(x - y) if math.isfinite(x - y) else math.inf for x, y in zip(sa, sb, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    a, b = final_loss(candidate, cfg.window), final_loss(reference, cfg.window)
    return {
        "rule": (
            f"mean of the last {cfg.window} steps within {cfg.rel_tol:.0%} of sdpa's, and each at least "
            f"{cfg.min_drop:.0%} below its run's first loss, all losses finite"
        ),
        "final_rel_diff": abs(a - b) / b if b else math.inf,
        "max_abs_diff_smoothed": diffs[worst],
        "max_abs_diff_smoothed_step": worst,
        "smoothing": f"trailing mean over {cfg.window} steps",
        "agree": curves_agree(candidate, reference, cfg.window, cfg.rel_tol, cfg.min_drop),
    }


# ---- output ----


def environment(device: torch.device, hopper_loaded: bool) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        env["hopper_fmha"] = version("hopper-fmha")
    except PackageNotFoundError:
        env["hopper_fmha"] = sys.modules["hopper_fmha"].__version__ if hopper_loaded else None

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    env["git_commit"] = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    env["git_dirty"] = None if status is None else bool(status)
    return env


def write_plot(path: Path, runs: dict[str, dict], cfg: Config, oracle: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    styles = {"sdpa": ("tab:blue", "-"), "hopper": ("tab:orange", "--")}
    for name, run in runs.items():
        color, ls = styles.get(name, (None, "-"))
        ax.plot(run["losses"], color=color, alpha=0.3, lw=0.6)
        label = f"{name} ({cfg.window}-step mean)"
        ax.plot(smooth(run["losses"], cfg.window), color=color, ls=ls, lw=1.6, label=label)
    ax.axhline(math.log(cfg.vocab), color="gray", ls="--", lw=0.8, label="log(vocab)")
    ax.axhline(oracle, color="gray", ls=":", lw=0.8, label="oracle (chain known)")
    ax.set(xlabel="step", ylabel="loss (nats)", ylim=(0, None))
    model = f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads"
    data = f"batch {cfg.batch} x seqlen {cfg.seqlen}, vocab {cfg.vocab}"
    ax.set_title(f"GPT ({model}; {data}; {cfg.dtype})", fontsize=9)
    ax.grid(alpha=0.3, lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(result: dict) -> None:
    cfg = result["config"]
    print(
        f"\n{'attention':<10} {'first loss':>10} {'final':>8} {'drop':>6} {'tokens/s':>10} {'1st step s':>10}"
    )
    for name, run in result["runs"].items():
        losses = run["losses"]
        final = run["final_loss"]
        drop = 1 - final / losses[0] if losses[0] else math.nan
        print(
            f"{name:<10} {losses[0]:>10.4f} {final:>8.4f} {drop:>6.0%} {run['tokens_per_s']:>10.4g} "
            f"{run['first_step_s']:>10.2f}"
        )
    uniform, oracle = math.log(cfg["vocab"]), result["oracle_loss"]
    print(f"(final: mean of the last {cfg['window']} steps; log(vocab) {uniform:.4f}, oracle {oracle:.4f})")
    if "gradient_check" in result:
        check = result["gradient_check"]
        errs = ", ".join(f"{name} {err:.3g}" for name, err in check["rel_err"].items())
        verdict = "ok" if check["ok"] else "FAIL"
        print(f"gradient check at step 0, relative error vs fp32 SDPA: {errs} -> {verdict}")
        for key, worst in check.items():
            if key.endswith("_worst"):
                tensor, err, bound = worst["parameter"], worst["rel_err"], worst["bound"]
                print(f"  closest to its bound: {tensor} {err:.3g} (bound {bound:.3g})")
    if "comparison" in result:
        c = result["comparison"]
        print(
            f"curves: final relative difference {c['final_rel_diff']:.2%} (tolerance {cfg['rel_tol']:.0%}), "
            f"max |difference| of the smoothed curves {c['max_abs_diff_smoothed']:.4f} at step "
            f"{c['max_abs_diff_smoothed_step']}"
        )
        print(f"agree ({c['rule']}): {'YES' if c['agree'] else 'NO'}")
    print("PASS" if result["ok"] else "FAIL")


# ---- main ----


def run(cfg: Config, attention: str, device: torch.device, out: Path | None, command: str = "") -> dict:
    """The whole experiment; returns the result (what train_gpt.json holds), result["ok"] the verdict."""
    names = ["sdpa", "hopper"] if attention == "both" else [attention]
    fns = {name: get_attention(name, device, cfg) for name in names}  # fail early, before any training
    t0 = time.perf_counter()
    data, oracle = make_data(cfg, device)
    print(f"data: {tuple(data.shape)} tokens in {time.perf_counter() - t0:.1f} s, oracle loss {oracle:.4f}")
    result: dict = {"command": command, "config": dataclasses.asdict(cfg), "oracle_loss": oracle}
    result["dtype"] = (
        "bf16 autocast (fp32 weights, gradients and AdamW state)" if cfg.dtype == "bf16" else "fp32"
    )
    if len(names) > 1:
        result["gradient_check"] = gradient_check(cfg, fns, data[0], device)
    result["runs"] = {}
    for name in names:
        print(f"training with {name} attention, {cfg.steps} steps")
        run_result = train(cfg, fns[name], data, device, label=name)
        run_result["final_loss"] = final_loss(run_result["losses"], cfg.window)
        run_result["trained"] = trained(run_result["losses"], cfg.window, cfg.min_drop)
        result["runs"][name] = run_result
    result["environment"] = environment(device, "hopper" in names)
    ok = all(r["trained"] for r in result["runs"].values())
    if len(names) > 1:
        result["comparison"] = compare(
            result["runs"]["hopper"]["losses"], result["runs"]["sdpa"]["losses"], cfg
        )
        ok = ok and result["comparison"]["agree"] and result["gradient_check"]["ok"]
    result["ok"] = ok
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_gpt.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out / 'train_gpt.json'}")
        try:  # the plot needs matplotlib (the bench extra); the JSON holds every number
            import matplotlib  # noqa: F401
        except ImportError:
            print('no plot: matplotlib is not installed (pip install -e ".[bench]")')
        else:
            write_plot(out / "train_gpt.png", result["runs"], cfg, oracle)
            print(f"wrote {out / 'train_gpt.png'}")
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Config()
    p.add_argument("--attention", choices=["both", "hopper", "sdpa"], default="both")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--out", type=Path, default=None, help="folder for train_gpt.json and train_gpt.png")
    for field in dataclasses.fields(Config):
        if field.name != "dtype":
            flag = "--" + field.name.replace("_", "-")
            default = getattr(defaults, field.name)
            help = field.metadata.get("help", "")
            p.add_argument(
                flag, type=type(default), default=default, help=f"{help} (default {default})".strip()
            )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name != "dtype"}
    cfg = Config(**fields, dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    command = shlex.join(["scripts/train_gpt.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CannotRun(
                "--device cuda, but torch sees no CUDA device (--device cpu --attention sdpa runs here)"
            )
        if cfg.d_model % cfg.heads or cfg.head_dim % 8:
            raise CannotRun(
                f"--d-model {cfg.d_model} / --heads {cfg.heads} must give a head_dim divisible by 8"
            )
        if cfg.steps <= cfg.window:
            raise CannotRun(f"--steps {cfg.steps} must exceed --window {cfg.window}")
        result = run(cfg, args.attention, device, args.out, command)
    except CannotRun as e:
        print(f"train_gpt: {e}", file=sys.stderr)
        return 2
    print_summary(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
