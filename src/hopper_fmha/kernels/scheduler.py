"""Who takes which tile: the persistent tile scheduler of the warp-specialized kernel.

A tile is `tile_m` query rows of one (batch, head) (with CTA pairs, `cluster_m` = 2: a pair of
neighbouring query tiles, one per CTA of the cluster). Contract (`TileScheduler`):
    host:      grid(seqlen_q, num_heads, num_batch, max_ctas): how many CTAs to launch.
    kernel:    create(seqlen_q, num_heads, num_batch, lpt_group, s_tile, counters): this launch's
               scheduler; num_tiles(); tile_coords(tile) -> (m_block, head, batch).
    producer:  ctas() -> (cta, num_ctas); the first tile is `cta`; fetch_tile(tile, cta, num_ctas)
               the next one; announce(tile, announced) hands each to the consumers, then an index
               past the last tile; finish(num_ctas) at exit.
    consumers: next_announced() -> the tile to work on; ack_announced() once read.
Orders: tiles of equal work (non-causal) go in a fixed serpentine order over rounds of num_ctas
tiles (`next_tile`); tiles that differ in work (causal) go longest first within groups of
`lpt_group` (head, batch) pairs whose K and V fit in L2 together, each to whichever CTA takes
the next index from a global counter (`counters`, two int32 per launch slot, zero between
launches: the last CTA to finish sets them back).

Split-KV (`split_kv`): each (query tile, head, batch) is num_splits tiles, one per contiguous
range of its key blocks; without lpt_group (the kernels pass 0 with split_kv).
Varlen: tiles are counted up to max_seqlen_q for every sequence; the kernel's producer skips
those past a sequence's end before announcing any (`WsFwdSm90.skip_empty`), so a batch's tiles
differ in number without a table of them.
To come, a field of the compile key: pack-GQA (a tile holds the query rows of several heads
sharing one K/V head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class TileScheduler:
    """Static: tile_m, cluster_m, dynamic (take tiles from the global counter, else serpentine),
    and the named barriers (ids and thread count: the producer warp and the consumers) through
    which the producer announces tiles. `create` adds one launch's values, in the kernel.
    A frozen dataclass: the DSL's loops pass it through unchanged."""

    tile_m: cutlass.Constexpr[int]
    cluster_m: cutlass.Constexpr[int]
    dynamic: cutlass.Constexpr[bool]
    sync_threads: cutlass.Constexpr[int]
    barrier_full: cutlass.Constexpr[int]  # the producer has written the next tile index
    barrier_empty: cutlass.Constexpr[int]  # every consumer thread has read it
    split_kv: cutlass.Constexpr[bool] = False  # a tile is also one of num_splits key ranges
    seqlen_q: Int32 = None
    num_heads: Int32 = None
    num_batch: Int32 = None
    lpt_group: Int32 = None
    s_tile: cute.Tensor = None
    counters: cute.Pointer = None
    num_splits: Int32 = 1

    # ---------------------------------------------------------------- host side
    @cute.jit
    def grid(
        self, seqlen_q: Int32, num_heads: Int32, num_batch: Int32, max_ctas: Int32, num_splits: Int32 = 1
    ):
        """The launch grid: one CTA per tile (max_ctas = 0), else min(max_ctas, tiles) CTAs
        (rounded to whole clusters) that loop over tiles."""
        num_tiles = cute.ceil_div(cute.size(seqlen_q), self.tile_m * self.cluster_m)
        num_tiles = num_tiles * num_heads * num_batch
        if const_expr(self.split_kv):
            num_tiles = num_tiles * num_splits
        num_clusters = num_tiles
        if max_ctas > 0:
            num_clusters = cutlass.min(num_tiles, cutlass.max(max_ctas // self.cluster_m, 1))
        return (num_clusters * self.cluster_m, 1, 1)

    # ---------------------------------------------------------------- device side
    def create(
        self,
        seqlen_q: Int32,
        num_heads: Int32,
        num_batch: Int32,
        lpt_group: Int32,
        s_tile: cute.Tensor,
        counters: cute.Pointer,
        num_splits: Int32 = 1,
    ) -> TileScheduler:
        """This launch's scheduler. lpt_group: > 0 orders tiles longest first (causal) within
        groups of that many (head, batch) pairs. s_tile: the shared-memory word of the announced
        tile. counters: this launch's two global counters (dynamic). num_splits (split_kv): key
        ranges per (query tile, head, batch)."""
        return replace(
            self,
            seqlen_q=seqlen_q,
            num_heads=num_heads,
            num_batch=num_batch,
            lpt_group=lpt_group,
            s_tile=s_tile,
            counters=counters,
            num_splits=num_splits,
        )

    @cute.jit
    def num_m_units(self) -> Int32:
        """Query tiles per (batch, head), counted in clusters (pairs of tiles when cluster_m = 2)."""
        return ((self.seqlen_q + self.tile_m - 1) // self.tile_m + self.cluster_m - 1) // self.cluster_m

    @cute.jit
    def num_tiles(self) -> Int32:
        num = self.num_m_units() * self.num_heads * self.num_batch
        if const_expr(self.split_kv):
            num = num * self.num_splits
        return num

    @cute.jit
    def tile_coords(self, tile: Int32):
        """Tile index -> (m_block, head, batch, split); split is the constant 0 without split_kv.

        Without lpt_group: m_block fastest, so CTAs running together share one head's K and V.
        With it (causal): (head, batch) pairs form groups of lpt_group; inside a group tiles go
        by decreasing work (m_block from the last), heads fastest, so the cheap diagonal tiles
        come last and fill the tail; K and V of a group fit in L2.
        """
        num_heads, num_batch, lpt_group = self.num_heads, self.num_batch, self.lpt_group
        num_m = self.num_m_units()
        m_block = tile % num_m
        hb = tile // num_m
        split = 0
        if const_expr(self.split_kv):
            # The splits of one (m_block, head, batch) next to each other: the CTAs that run them
            # together read disjoint key ranges of the same K and V.
            split = hb % self.num_splits
            hb = hb // self.num_splits
        if lpt_group > 0:
            num_hb = num_heads * num_batch
            group_tiles = lpt_group * num_m
            group = tile // group_tiles
            rest = tile - group * group_tiles
            group_size = lpt_group
            if group == num_hb // lpt_group:  # the last, partial group
                group_size = num_hb - group * lpt_group
            m_block = num_m - 1 - rest // group_size
            hb = group * lpt_group + rest % group_size
        if const_expr(self.cluster_m > 1):
            # The pair's query tiles; past the end for the second CTA when the count is odd
            # (its Q loads as zeros, its O and LSE are clipped or skipped).
            m_block = m_block * self.cluster_m + cute.arch.block_idx_in_cluster()
        return m_block, hb % num_heads, hb // num_heads, split

    @cute.jit
    def ctas(self):
        """(cta, num_ctas): this CTA's index and the CTA count, in clusters (the CTAs of a pair
        walk the same tiles). A CTA's first tile is its index."""
        cta = cute.arch.block_idx()[0] // self.cluster_m
        num_ctas = cute.arch.grid_dim()[0] // self.cluster_m
        return cta, num_ctas

    @cute.jit
    def next_tile(self, tile: Int32, cta: Int32, num_ctas: Int32) -> Int32:
        """The CTA's next tile: rounds of num_ctas tiles, dealt in serpentine order.

        Round r takes tiles [r * num_ctas, (r + 1) * num_ctas); CTA c gets the c-th of an even
        round and the c-th from the end of an odd one. On a longest-first order (causal) a CTA
        with a long tile in one round gets a short one in the next, so the work evens out
        without a global counter. A CTA whose tile is past the end has none in later rounds.
        """
        round_start = tile - tile % num_ctas + num_ctas
        nxt = round_start + cta
        if (round_start // num_ctas) % 2 == 1:
            nxt = round_start + num_ctas - 1 - cta
        return nxt

    @cute.jit
    def fetch_tile(self, tile: Int32, cta: Int32, num_ctas: Int32) -> Int32:
        """The tile after `tile` for this CTA (producer warp): from the global counter, or serpentine."""
        if const_expr(self.dynamic):
            nxt = Int32(0)
            if cute.arch.lane_idx() == 0:
                nxt = cute.arch.atomic_add(self.counters, Int32(1), sem="relaxed", scope="gpu") + num_ctas
            return cute.arch.shuffle_sync(nxt, 0)
        return self.next_tile(tile, cta, num_ctas)

    @cute.jit
    def finish(self, num_ctas: Int32):
        """Producer warp, after its last announce: the last CTA to get here zeroes the counters
        for the next launch (every CTA has had its last answer from the tile counter before it
        increments the second one)."""
        if const_expr(self.dynamic):
            counters = self.counters
            with cute.arch.elect_one():
                done = cute.arch.atomic_add(counters + 1, Int32(1), sem="acq_rel", scope="gpu")
                if done == num_ctas - 1:
                    cute.arch.atomic_exch(counters, Int32(0), sem="relaxed", scope="gpu")
                    cute.arch.atomic_exch(counters + 1, Int32(0), sem="relaxed", scope="gpu")

    @cute.jit
    def announce(self, tile: Int32, announced: Int32):
        """Producer warp: write the next tile index once the consumers have read the last one
        (`announced`: how many were announced before).

        Named barriers (not an mbarrier) order the shared-memory word, so that compute-sanitizer's
        racecheck sees the synchronization: barrier_empty (the consumers arrive after reading)
        before writing, barrier_full (the consumers wait) after.
        """
        threads = self.sync_threads
        if announced > 0:
            cute.arch.barrier(barrier_id=self.barrier_empty, number_of_threads=threads)
        with cute.arch.elect_one():
            self.s_tile[0] = tile
        cute.arch.barrier_arrive(barrier_id=self.barrier_full, number_of_threads=threads)

    @cute.jit
    def next_announced(self) -> Int32:
        """Consumers: the tile the producer announced next."""
        cute.arch.barrier(barrier_id=self.barrier_full, number_of_threads=self.sync_threads)
        return self.s_tile[0]

    @cute.jit
    def ack_announced(self):
        """Consumers: the announced tile has been read; the producer may write the next index
        (the last one, past the end, is not acknowledged: nothing is announced after it)."""
        cute.arch.barrier_arrive(barrier_id=self.barrier_empty, number_of_threads=self.sync_threads)
