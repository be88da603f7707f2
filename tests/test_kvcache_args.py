"""check_kvcache's rules, one test per rule, and append_kv against reference_with_kvcache's append, on CPU
tensors (a "meta" tensor gives a device mismatch, and runs append_kv without any data on the host)."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hopper_fmha.kvcache_args import KVCacheShape, append_kv, check_kvcache
from hopper_fmha.reference_kvcache import reference_with_kvcache

pytestmark = pytest.mark.cpu

F16 = torch.float16
# Dense: batch 2, capacity 40. Paged: 7 pages of 16 rows, 3 pages per sequence (capacity 48), page 6 spare.
TABLE = [[4, 0, 2], [1, 5, 3]]


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def zeros(*shape, dtype=F16, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


def args(paged=False, seqlen_new=5, heads=4, kv_heads=2, head_dim=64, head_dim_v=32, page_size=16):
    """Valid arguments as a dict: q, k_cache, v_cache, k, v, cache_seqlens (a tensor), page_table."""
    first, rows = (7, page_size) if paged else (2, 40)
    return dict(
        q=zeros(2, 3, heads, head_dim),
        k_cache=zeros(first, rows, kv_heads, head_dim),
        v_cache=zeros(first, rows, kv_heads, head_dim_v),
        k=zeros(2, seqlen_new, kv_heads, head_dim),
        v=zeros(2, seqlen_new, kv_heads, head_dim_v),
        cache_seqlens=i32([0, 35] if not paged else [11, 43]),
        page_table=i32(TABLE) if paged else None,
    )


def call(paged=False, check_values=True, shape=None, **changes):
    """check_kvcache on the valid arguments with some replaced."""
    a = args(paged, **(shape or {}))
    a.update(changes)
    return check_kvcache(**a, check_values=check_values)


# Valid calls.


def test_valid_dense():
    assert call() == KVCacheShape(
        batch=2,
        seqlen_q=3,
        heads=4,
        kv_heads=2,
        head_dim=64,
        head_dim_v=32,
        capacity=40,
        paged=False,
        page_size=0,
        num_pages=0,
        seqlen_new=5,
    )


def test_valid_paged():
    assert call(paged=True) == KVCacheShape(2, 3, 4, 2, 64, 32, 48, True, 16, 7, 5)


@pytest.mark.parametrize("paged", [False, True])
def test_valid_without_new_tokens_and_full_cache(paged):
    shape = call(paged, k=None, v=None, cache_seqlens=None)
    assert shape.seqlen_new == 0 and shape.capacity == (48 if paged else 40)


@pytest.mark.parametrize("seqlens", [0, 35, np.int64(20)])
def test_valid_int_cache_seqlens(seqlens):
    assert call(cache_seqlens=seqlens).seqlen_new == 5


def test_valid_empty_batch():
    empty = dict(q=zeros(0, 3, 4, 64), k=zeros(0, 5, 2, 64), v=zeros(0, 5, 2, 32), cache_seqlens=i32([]))
    assert call(**empty, k_cache=zeros(0, 40, 2, 64), v_cache=zeros(0, 40, 2, 32)).batch == 0
    assert call(True, **empty, page_table=i32([]).reshape(0, 3)).batch == 0


# Rule 1: q.


def test_q_not_a_tensor():
    with pytest.raises(TypeError, match="^q must be a torch.Tensor, got list"):
        call(q=[1.0])


def test_q_rank():
    with pytest.raises(ValueError, match=r"^q must have rank 4 .*got shape \(2, 3, 64\)"):
        call(q=zeros(2, 3, 64))


def test_q_dtype():
    with pytest.raises(TypeError, match="^q must be float16 or bfloat16, got torch.float32"):
        call(q=zeros(2, 3, 4, 64, dtype=torch.float32))


# Rule 2: k_cache and v_cache.


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_not_a_tensor(name):
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got NoneType"):
        call(**{name: None})


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_dtype(name):
    with pytest.raises(TypeError, match=f"^{name} must have q's dtype torch.float16, got torch.bfloat16"):
        call(**{name: zeros(2, 40, 2, 64, dtype=torch.bfloat16)})


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_device(name):
    with pytest.raises(ValueError, match=f"^{name} must be on the same device as q, got meta and q on cpu"):
        call(**{name: zeros(2, 40, 2, 64, device="meta")})


@pytest.mark.parametrize("paged, layout", [(False, "dense"), (True, "paged")])
@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_rank(name, paged, layout):
    with pytest.raises(ValueError, match=rf"^{name} must have rank 4, {layout} .*got shape \(80, 2, 64\)"):
        call(paged, **{name: zeros(80, 2, 64)})


def test_caches_agree_on_first_three_dims():
    with pytest.raises(
        ValueError, match=r"^k_cache and v_cache must agree .*\(2, 40, 2, 64\) and \(2, 39, 2, 32\)"
    ):
        call(v_cache=zeros(2, 39, 2, 32))


def test_k_cache_head_dim():
    with pytest.raises(
        ValueError, match=r"^k_cache's last dim must be q's head_dim 64, got shape \(2, 40, 2, 32\)"
    ):
        call(k_cache=zeros(2, 40, 2, 32))


@pytest.mark.parametrize("heads, kv_heads", [(4, 3), (4, 0)])
def test_heads_multiple_of_kv_heads(heads, kv_heads):
    with pytest.raises(
        ValueError, match=f"^heads of q must be a multiple .*heads={heads}, kv_heads={kv_heads}"
    ):
        call(shape=dict(heads=heads, kv_heads=kv_heads))


def test_dense_cache_batch():
    with pytest.raises(ValueError, match=r"^a dense k_cache must have q's batch 2 .*\(3, 40, 2, 64\)"):
        call(k_cache=zeros(3, 40, 2, 64), v_cache=zeros(3, 40, 2, 32))


# Rule 3: page_table.


def test_page_table_not_a_tensor():
    with pytest.raises(TypeError, match="^page_table must be None or a torch.Tensor of int32, got list"):
        call(True, page_table=TABLE)


def test_page_table_dtype():
    with pytest.raises(TypeError, match="^page_table must be int32, got torch.int64"):
        call(True, page_table=torch.tensor(TABLE))


@pytest.mark.parametrize("table", [[4, 0, 2], [[4, 0, 2]]], ids=["rank-1", "batch-1"])
def test_page_table_shape(table):
    with pytest.raises(
        ValueError, match="^page_table must have shape \\(batch, pages_per_seq\\) with q's batch 2"
    ):
        call(True, page_table=i32(table))


def test_page_table_device():
    with pytest.raises(ValueError, match="^page_table must be on the same device as q, got meta"):
        call(True, page_table=i32(TABLE, device="meta"))


@pytest.mark.parametrize("page_size", [1, 8, 24])
def test_page_size_multiple_of_16(page_size):
    with pytest.raises(ValueError, match=f"^page_size .*multiple of 16 .*TMA.*got {page_size}$"):
        call(True, shape=dict(page_size=page_size), cache_seqlens=0)


# Rule 4: k and v.


@pytest.mark.parametrize("name, given", [("k", "k None and v a tensor"), ("v", "k a tensor and v None")])
def test_k_and_v_together(name, given):
    with pytest.raises(ValueError, match=f"^k and v must be given both or neither, got {given}"):
        call(**{name: None})


@pytest.mark.parametrize("name", ["k", "v"])
def test_new_tokens_not_a_tensor(name):
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got list"):
        call(**{name: [0.0]})


@pytest.mark.parametrize("name", ["k", "v"])
def test_new_tokens_dtype(name):
    with pytest.raises(TypeError, match=f"^{name} must have q's dtype torch.float16, got torch.float32"):
        call(**{name: zeros(2, 5, 2, 64, dtype=torch.float32)})


@pytest.mark.parametrize("name", ["k", "v"])
def test_new_tokens_device(name):
    with pytest.raises(ValueError, match=f"^{name} must be on the same device as q, got meta"):
        call(**{name: zeros(2, 5, 2, 64, device="meta")})


@pytest.mark.parametrize("name", ["k", "v"])
def test_new_tokens_rank(name):
    with pytest.raises(ValueError, match=rf"^{name} must have rank 4, .*got shape \(10, 2, 64\)"):
        call(**{name: zeros(10, 2, 64)})


@pytest.mark.parametrize(
    "name, bad, expected",
    [
        ("k", (1, 5, 2, 64), (2, 5, 2, 64)),  # batch
        ("k", (2, 5, 1, 64), (2, 5, 2, 64)),  # kv_heads
        ("k", (2, 5, 2, 32), (2, 5, 2, 64)),  # head_dim
        ("v", (2, 4, 2, 32), (2, 5, 2, 32)),  # seqlen_new (k's)
        ("v", (2, 5, 2, 64), (2, 5, 2, 32)),  # head_dim_v
    ],
)
def test_new_tokens_shape(name, bad, expected):
    with pytest.raises(ValueError, match=rf"^{name} must have shape \({', '.join(map(str, expected))}\)"):
        call(**{name: zeros(*bad)})


# Rule 5: cache_seqlens' type.


@pytest.mark.parametrize("value, type_name", [(True, "bool"), (3.0, "float"), ([0, 35], "list")])
def test_cache_seqlens_type(value, type_name):
    with pytest.raises(
        TypeError, match=f"^cache_seqlens must be None, an int or an int32 tensor, got {type_name}"
    ):
        call(cache_seqlens=value)


def test_cache_seqlens_dtype():
    with pytest.raises(TypeError, match="^cache_seqlens must be an int32 tensor, got torch.int64"):
        call(cache_seqlens=torch.tensor([0, 35]))


@pytest.mark.parametrize("value", [[0], [[0, 35]], 3], ids=["length-1", "rank-2", "rank-0"])
def test_cache_seqlens_shape(value):
    with pytest.raises(ValueError, match=r"^cache_seqlens must have shape \(batch,\) = \(2,\)"):
        call(cache_seqlens=i32(value))


def test_cache_seqlens_device():
    with pytest.raises(ValueError, match="^cache_seqlens must be on the same device as q, got meta"):
        call(cache_seqlens=i32([0, 35], device="meta"))


# Rule 6: the head dims (hopper_fmha.config's rule).


def test_head_dims():
    with pytest.raises(ValueError, match="^head_dim must be a multiple of 8"):
        call(shape=dict(head_dim=60))
    with pytest.raises(ValueError, match="^head_dim_v .* must be <= head_dim"):
        call(shape=dict(head_dim=32, head_dim_v=64))


# Rule 7: cache_seqlens on the host, checked always.


@pytest.mark.parametrize("check_values", [True, False])
def test_none_cache_seqlens_with_new_tokens(check_values):
    with pytest.raises(ValueError, match="^cache_seqlens None means every sequence is full .*seqlen_new 5"):
        call(cache_seqlens=None, check_values=check_values)


@pytest.mark.parametrize("paged, value, limit", [(False, -1, 35), (False, 36, 35), (True, 44, 43)])
@pytest.mark.parametrize("check_values", [True, False])
def test_int_cache_seqlens_range(paged, value, limit, check_values):
    with pytest.raises(
        ValueError,
        match=rf"^cache_seqlens must be in \[0, capacity - seqlen_new\] = \[0, {limit}\].*got {value}$",
    ):
        call(paged, cache_seqlens=value, check_values=check_values)


# Rule 8: the device values.


@pytest.mark.parametrize(
    "paged, seqlens, b, limit",
    [(False, [-1, 0], 0, 35), (False, [0, 36], 1, 35), (True, [-1, 0], 0, 43), (True, [0, 44], 1, 43)],
)
def test_tensor_cache_seqlens_range(paged, seqlens, b, limit):
    with pytest.raises(
        ValueError,
        match=rf"^cache_seqlens\[{b}\] must be in \[0, capacity - seqlen_new\] = \[0, {limit}\] "
        rf".*got {seqlens[b]}$",
    ):
        call(paged, cache_seqlens=i32(seqlens))


@pytest.mark.parametrize("bad", [-1, 7, 99])
@pytest.mark.parametrize("seqlens", [i32([11, 43]), 28, None], ids=["tensor", "int", "none"])
def test_used_page_ids_in_range(bad, seqlens):
    """Sequence 1 uses all 3 of its pages in each case (43 + 5, 28 + 5 or full): a bad id in the last."""
    table = i32([TABLE[0], TABLE[1][:2] + [bad]])
    new = {} if seqlens is not None else dict(k=None, v=None)
    with pytest.raises(
        ValueError,
        match=rf"^page_table\[1, 2\] must be a page of k_cache in \[0, num_pages\) = \[0, 7\), got {bad} ",
    ):
        call(True, page_table=table, cache_seqlens=seqlens, **new)


def test_unused_page_ids_are_not_checked():
    """32 tokens after the append fill exactly pages 0 and 1 of each sequence: page 2's entries are unused."""
    table = i32([[4, 0, -1], [1, 5, 99]])
    assert call(True, page_table=table, cache_seqlens=27).paged
    with pytest.raises(ValueError, match=r"page_table\[0, 2\] .*got -1"):
        call(True, page_table=table, cache_seqlens=28)


def test_check_values_false_skips_only_the_value_rules():
    bad_table = i32([[-1, 99, 7], [7, 7, 7]])
    shape = call(True, page_table=bad_table, cache_seqlens=i32([-5, 1000]), check_values=False)
    assert shape.paged and shape.num_pages == 7
    assert call(cache_seqlens=i32([-1, 99]), check_values=False).seqlen_new == 5
    with pytest.raises(TypeError, match="page_table must be int32"):
        call(True, page_table=torch.tensor(TABLE), check_values=False)


def test_values_need_no_host_data_without_check_values():
    """Everything on the meta device (no data at all): the rules without values pass."""
    meta = {name: t.to("meta") for name, t in args(paged=True).items()}
    assert check_kvcache(**meta, check_values=False).capacity == 48


class _Reads(TorchDispatchMode):
    """Records the non-view ops that read the storage of the given tensors."""

    def __init__(self, *tensors):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = tree_leaves((args, kwargs))
        if not func.is_view and any(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.ptrs for t in leaves
        ):
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("paged", [False, True])
def test_one_read_of_the_device_values(paged):
    a = args(paged)
    with _Reads(*(t for t in (a["cache_seqlens"], a["page_table"]) if t is not None)) as reads:
        check_kvcache(**a)
    assert reads.ops == [torch.ops.aten.cat.default]
    with _Reads(a["cache_seqlens"]) as reads:
        check_kvcache(**a, check_values=False)
    assert reads.ops == []


# append_kv.


def _caches(paged, capacity, seed, kv_heads=2, d=8, dv=8, page_size=16, spare_pages=2):
    """Random k_cache, v_cache (bfloat16) and, if paged, a random permutation page table (batch 3)."""
    gen = torch.Generator().manual_seed(seed)
    first, rows = (3 * capacity // page_size + spare_pages, page_size) if paged else (3, capacity)
    k_cache = torch.randn(first, rows, kv_heads, d, generator=gen).bfloat16()
    v_cache = torch.randn(first, rows, kv_heads, dv, generator=gen).bfloat16()
    table = None
    if paged:
        table = torch.randperm(first, generator=gen)[: 3 * capacity // page_size].reshape(3, -1).int()
    return k_cache, v_cache, table


@pytest.mark.parametrize("seqlen_new", [0, 1, 5])
@pytest.mark.parametrize("kind", ["int", "tensor"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_append_kv_as_reference(paged, kind, seqlen_new):
    """Seqlens 0, one just before a page boundary (the append crosses it) and full after the append."""
    capacity = 48
    seqlens = [0, 14, capacity - seqlen_new] if kind == "tensor" else 30
    cache_seqlens = i32(seqlens) if kind == "tensor" else seqlens
    k_cache, v_cache, table = _caches(paged, capacity, seed=seqlen_new + 10 * paged)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 1, 4, 8, generator=gen).bfloat16()
    k = torch.randn(3, seqlen_new, 2, 8, generator=gen).bfloat16()
    v = torch.randn(3, seqlen_new, 2, 8, generator=gen).bfloat16()
    new = dict(k=k, v=v) if seqlen_new else {}
    assert check_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=table, **new)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference_with_kvcache(q, k_ref, v_ref, cache_seqlens=cache_seqlens, page_table=table, **new)
    before = k_cache.clone()
    append_kv(k_cache, v_cache, k, v, cache_seqlens, table)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert bool((k_cache != before).any()) == bool(seqlen_new)


def _guarded(first, rows, kv_heads, d, sentinel=-7.0):
    """A cache that is a view into a larger buffer, each dim with a guard of `sentinel` on both sides."""
    buffer = torch.full((first + 2, rows + 2, kv_heads + 2, d + 2), sentinel)
    cache = buffer[1:-1, 1:-1, 1:-1, 1:-1]
    cache.zero_()
    return buffer, cache


def _guard_intact(buffer, sentinel=-7.0):
    inside = torch.zeros_like(buffer, dtype=torch.bool)
    inside[1:-1, 1:-1, 1:-1, 1:-1] = True
    return bool((buffer[~inside] == sentinel).all())


@pytest.mark.parametrize(
    "cache_seqlens",
    [i32([48, -7, 2**31 - 1]), i32([46, 0, -(2**31)]), 47, -3, 2**70],
    ids=["past-end", "crossing-end", "int-past-end", "int-negative", "int-huge"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_append_kv_unchecked_values_stay_inside_the_cache(paged, cache_seqlens):
    """Values check_kvcache would reject (overflowing seqlens, page ids outside the cache) write only
    slots of the cache: the guard around it keeps its sentinel; the new tokens do land in the cache."""
    first, rows = (5, 16) if paged else (3, 48)
    k_buffer, k_cache = _guarded(first, rows, 2, 8)
    v_buffer, v_cache = _guarded(first, rows, 2, 4)
    table = i32([[0, 1, -1], [4, 5, 99], [-(2**31), 2**31 - 1, 2]]) if paged else None
    k, v = torch.ones(3, 5, 2, 8), torch.ones(3, 5, 2, 4)
    append_kv(k_cache, v_cache, k, v, cache_seqlens, table)
    assert _guard_intact(k_buffer) and _guard_intact(v_buffer)
    assert (k_cache == 1).any() and (v_cache == 1).any()


def test_append_kv_on_device_values_only():
    """On the meta device (no data: any host read of a value would raise) with a cache of 10**9 tokens per
    sequence: runs, and allocates nothing larger than batch * seqlen_new rows."""
    batch, seqlen_new, capacity = 4, 3, 10**9
    created = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func is not torch.ops.aten.index_put_.default:
                created.extend(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    for page_table in (None, i32([[0] * 8] * batch, device="meta")):
        rows = capacity if page_table is None else capacity // 8
        first = batch if page_table is None else 8
        k_cache = zeros(first, rows, 2, 8, device="meta")
        v_cache = zeros(first, rows, 2, 4, device="meta")
        k, v = zeros(batch, seqlen_new, 2, 8, device="meta"), zeros(batch, seqlen_new, 2, 4, device="meta")
        for cache_seqlens in (i32([5] * batch, device="meta"), 5):
            with Sizes():
                append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table)
    assert created and max(created) <= batch * seqlen_new * 2 * 8


def test_append_kv_without_slots_or_tokens_writes_nothing():
    k_cache, v_cache = torch.zeros(2, 0, 1, 8), torch.zeros(2, 0, 1, 8)
    append_kv(k_cache, v_cache, torch.ones(2, 3, 1, 8), torch.ones(2, 3, 1, 8), 0)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    append_kv(k_cache, v_cache, torch.ones(2, 0, 1, 8), torch.ones(2, 0, 1, 8), None)
    assert not k_cache.any() and not v_cache.any()
