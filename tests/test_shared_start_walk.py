"""The deterministic walk with fewer query blocks than key blocks (`sm90_bwd_ws.SHARED_STARTS`):
its turn order (`shared_start_turn`, the function the kernel traces) checked on the host: a
permutation per query block, the order in which the CTAs reach the block, and a simulated run of
the semaphores that finishes (no CTA waits on one that reaches the block later) and shortens the
hand-off chains of the plain order."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

from hopper_fmha.kernels.sm90_bwd_ws import shared_start_turn  # noqa: E402

SHAPES = [(1, 2), (2, 3), (3, 7), (5, 6), (16, 33), (64, 86), (63, 64), (7, 50)]


def walk(n: int, count: int) -> list[int]:
    """CTA n's query blocks, step by step: from n % C, wrapping."""
    return [(n % count + i) % count for i in range(count)]


@pytest.mark.parametrize("count, num_n", SHAPES)
def test_turns_are_the_arrival_order(count, num_n):
    for m in range(count):
        turns = {n: shared_start_turn(m, n, count, num_n, min) for n in range(num_n)}
        assert sorted(turns.values()) == list(range(num_n)), (m, turns)
        order = sorted(range(num_n), key=turns.__getitem__)
        steps = [walk(n, count).index(m) for n in order]
        # CTAs take their turns in the order they reach the block; those reaching it at the same
        # step (sharing a start) by n // C
        assert steps == sorted(steps)
        for i in range(num_n - 1):
            a, b = order[i], order[i + 1]
            if steps[i] == steps[i + 1]:
                assert a % count == b % count and a // count < b // count


def simulate(count, num_n, turn_of, start_of, latency):
    """Event-free simulation: every CTA resident; a step takes 1, a turn's add completes
    `latency` after it is issued, and the next turn may start then. Returns the finish time of the
    last CTA, or None if the run cannot finish (a wait on a turn nobody can pass)."""
    done = {m: 0.0 for m in range(count)}  # when block m's last add completed
    passed = {m: 0 for m in range(count)}  # turns passed at block m
    time = [0.0] * num_n
    step = [0] * num_n
    for _ in range(count * num_n * num_n + 1):
        moved = False
        for n in range(num_n):
            if step[n] == count:
                continue
            m = (start_of(n) + step[n]) % count
            if turn_of(m, n) != passed[m]:
                continue
            issue = max(time[n] + 1.0, done[m])
            done[m] = issue + latency
            passed[m] += 1
            time[n] = issue
            step[n] += 1
            moved = True
        if all(s == count for s in step):
            return max(time)
        if not moved:
            return None
    return None


@pytest.mark.parametrize("count, num_n", [(3, 7), (16, 33), (64, 86)])
def test_simulated_run_finishes_and_shortens_the_chains(count, num_n):
    shared = simulate(
        count, num_n, lambda m, n: shared_start_turn(m, n, count, num_n, min), lambda n: n % count, 0.5
    )
    # the plain order at stride 0: every CTA from block 0, turns descending (the launch order)
    plain = simulate(count, num_n, lambda m, n: num_n - 1 - n, lambda n: 0, 0.5)
    assert shared is not None and plain is not None
    # each block's chain is at most ceil(num_n / C) CTAs deep: the last CTA finishes within a few
    # hand-offs of the C steps, where the plain order's chain grows with num_n
    assert shared <= count + (-(-num_n // count)) * 0.5 + 1
    assert plain >= count + (num_n - 1) * 0.5 - 1
