"""A model of the deterministic causal backward's dQ turns (session 36; `sm90_bwd.DQ_CHAINS_MASKED`).

Key-block CTAs of `keys` keys against query blocks of `queries` rows, causal: CTA n visits the
query blocks from its diagonal, floor(keys * n / queries), to the last, one step each. At a query
block the turns go from the highest key block that sees it down to 0 (`sm90_bwd_ws.dq_turn`,
`descending`), so with k chains CTA n's add waits for CTA n + k's add at that block, plus a
hand-off latency L (in steps: the add's completion, the semaphore's release and the next poll).
The SMs take CTAs in the kernel's launch order (each head's key blocks from the last, heads one
after another). Printed: the makespan of that schedule as a share of the plain (non-deterministic,
`LPT_HEADS` groups of 4) one, for L and k. It ignores L2, the diagonal blocks' extra work and the
consumers' run-ahead (one dQ buffer a step: a step ends no sooner than its add).

    python scripts/turn_model.py [--heads 32] [--seqlen 4096] [--keys 48] [--queries 64]
"""

from __future__ import annotations

import argparse
import heapq


def orders(heads: int, num_n: int, group: int = 4):
    """(deterministic, plain) launch orders of (head, key block): the deterministic kernel's
    (each head's key blocks from the last, `sm90_bwd_ws` reverses n_block) and the plain causal
    kernel's under `LPT_HEADS` = group (the kernel's own `lpt_place`, launch index by launch index)."""
    from hopper_fmha.kernels.sm90_bwd_ws import lpt_place

    deterministic = [(h, n) for h in range(heads) for n in reversed(range(num_n))]
    grid = (num_n, heads, 1)
    plain = [lpt_place(x % num_n, x // num_n, 0, grid, group)[1::-1] for x in range(heads * num_n)]
    return deterministic, plain


def makespan(order, first, num_m, sms, latency=None, chains=1):
    """Steps until the last CTA ends. order: (head, key block) in launch order; first[n]: key block
    n's first query block; latency None: no turns (the plain backward)."""
    free = [0.0] * sms
    added = {}  # (head, n, m) -> when CTA n's add into block m ended
    end = 0.0
    for h, n in order:
        t = heapq.heappop(free)
        for m in range(first[n], num_m):
            t += 1
            if latency is not None:
                later = n + chains
                if later < len(first) and m >= first[later]:
                    t = max(t, added[(h, later, m)] + latency)
                added[(h, n, m)] = t
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32, help="batch x heads")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--keys", type=int, default=48, help="keys per CTA (d256: 48)")
    parser.add_argument("--queries", type=int, default=64, help="queries per step")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    num_n = -(-args.seqlen // args.keys)
    num_m = -(-args.seqlen // args.queries)
    first = [args.keys * n // args.queries for n in range(num_n)]
    launch, lpt = orders(args.heads, num_n)
    plain = makespan(lpt, first, num_m, args.sms)
    ideal = args.heads * sum(num_m - f for f in first) / args.sms
    shape = f"{args.heads} heads x {num_n} CTAs, {num_m} query blocks"
    print(f"{shape}: plain {plain:.0f} steps, ideal {ideal:.0f}")
    for chains in (1, 2, 3):
        shares = [plain / makespan(launch, first, num_m, args.sms, L, chains) for L in (0.5, 1, 1.5, 2, 3)]
        print(f"chains {chains}: share of plain at L = 0.5 / 1 / 1.5 / 2 / 3 steps: "
              + " / ".join(f"{x:.2f}" for x in shares))  # fmt: skip


if __name__ == "__main__":
    main()
