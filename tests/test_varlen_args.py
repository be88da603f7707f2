"""check_varlen's rules, one test per rule, on CPU tensors (a "meta" tensor gives a device mismatch)."""

import numpy as np
import pytest
import torch

from hopper_fmha.varlen_args import VarlenShape, check_varlen, varlen_values_checkable

pytestmark = pytest.mark.cpu

# Three sequences of q lengths 3, 0, 2 and k lengths 4, 1, 0, packed with one spare row each.
CU_Q = [0, 3, 3, 5]
CU_K = [0, 4, 5, 5]


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def args(total_q=6, total_k=6, heads=4, kv_heads=2, head_dim=64, head_dim_v=32, dtype=torch.float16):
    """Valid arguments for check_varlen: q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k."""
    q = torch.zeros(total_q, heads, head_dim, dtype=dtype)
    k = torch.zeros(total_k, kv_heads, head_dim, dtype=dtype)
    v = torch.zeros(total_k, kv_heads, head_dim_v, dtype=dtype)
    return [q, k, v, i32(CU_Q), i32(CU_K), 3, 4]


def call(*replace, seqused_k=None, check_values=True, **shape):
    """check_varlen on the valid arguments with (index, value) pairs replaced."""
    a = args(**shape)
    for i, value in replace:
        a[i] = value
    return check_varlen(*a, seqused_k=seqused_k, check_values=check_values)


Q, K, V, CU_SEQLENS_Q, CU_SEQLENS_K, MAX_Q, MAX_K = range(7)


def test_valid_packed_batch_with_empty_sequences():
    assert call() == VarlenShape(
        batch=3,
        total_q=6,
        total_k=6,
        heads=4,
        kv_heads=2,
        head_dim=64,
        head_dim_v=32,
        max_seqlen_q=3,
        max_seqlen_k=4,
    )


def test_valid_with_seqused_k_bf16_and_larger_max_seqlen():
    shape = call((MAX_Q, np.int64(10)), (MAX_K, 7), seqused_k=i32([4, 0, 0]), dtype=torch.bfloat16)
    assert shape.max_seqlen_q == 10 and type(shape.max_seqlen_q) is int
    assert shape.max_seqlen_k == 7


def test_empty_batch():
    shape = call((CU_SEQLENS_Q, i32([0])), (CU_SEQLENS_K, i32([0])), (MAX_Q, 0), (MAX_K, 0), total_q=0)
    assert shape.batch == 0 and shape.total_q == 0


# Rule 1: q, k, v.


@pytest.mark.parametrize("i, name", [(Q, "q"), (K, "k"), (V, "v")])
def test_qkv_not_a_tensor(i, name):
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got list"):
        call((i, [1.0]))


@pytest.mark.parametrize("i, name", [(Q, "q"), (K, "k"), (V, "v")])
def test_qkv_rank(i, name):
    with pytest.raises(ValueError, match=rf"^{name} must have rank 3 .*got shape \(1, 6, 2, 64\)"):
        call((i, torch.zeros(1, 6, 2, 64, dtype=torch.float16)))


def test_q_dtype():
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got torch.float32"):
        call(dtype=torch.float32)


def test_qkv_same_dtype():
    with pytest.raises(TypeError, match="q, k, v must have the same dtype"):
        call((V, torch.zeros(6, 2, 32, dtype=torch.bfloat16)))


def test_kv_same_total_and_heads():
    with pytest.raises(
        ValueError, match=r"k and v must have the same \(total_k, kv_heads\).*\(6, 2\) and \(5, 2\)"
    ):
        call((V, torch.zeros(5, 2, 32, dtype=torch.float16)))


def test_qk_same_head_dim():
    with pytest.raises(ValueError, match="q and k must have the same head_dim, got 64 and 128"):
        call((K, torch.zeros(6, 2, 128, dtype=torch.float16)))


@pytest.mark.parametrize("heads, kv_heads", [(4, 3), (4, 0)])
def test_heads_multiple_of_kv_heads(heads, kv_heads):
    with pytest.raises(ValueError, match=f"heads={heads}, kv_heads={kv_heads}"):
        call(heads=heads, kv_heads=kv_heads)


# Rule 2: cu_seqlens_q and cu_seqlens_k.


@pytest.mark.parametrize("i, name", [(CU_SEQLENS_Q, "cu_seqlens_q"), (CU_SEQLENS_K, "cu_seqlens_k")])
def test_cu_seqlens_not_a_tensor(i, name):
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor of int32, got list"):
        call((i, [0, 3, 3, 5]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
@pytest.mark.parametrize("i, name", [(CU_SEQLENS_Q, "cu_seqlens_q"), (CU_SEQLENS_K, "cu_seqlens_k")])
def test_cu_seqlens_dtype(i, name, dtype):
    with pytest.raises(TypeError, match=f"^{name} must be int32, got {dtype}"):
        call((i, torch.tensor(CU_Q, dtype=dtype)))


@pytest.mark.parametrize("i, name", [(CU_SEQLENS_Q, "cu_seqlens_q"), (CU_SEQLENS_K, "cu_seqlens_k")])
def test_cu_seqlens_rank(i, name):
    with pytest.raises(ValueError, match=rf"^{name} must have rank 1, got shape \(1, 4\)"):
        call((i, i32([CU_Q])))


@pytest.mark.parametrize("i, name", [(CU_SEQLENS_Q, "cu_seqlens_q"), (CU_SEQLENS_K, "cu_seqlens_k")])
def test_cu_seqlens_empty(i, name):
    with pytest.raises(ValueError, match=f"^{name} must have length batch \\+ 1 >= 1, got length 0"):
        call((i, i32([])))


def test_cu_seqlens_same_length():
    with pytest.raises(
        ValueError, match="cu_seqlens_q and cu_seqlens_k must have the same length .*got 4 and 3"
    ):
        call((CU_SEQLENS_K, i32([0, 4, 5])))


@pytest.mark.parametrize("i, name", [(CU_SEQLENS_Q, "cu_seqlens_q"), (CU_SEQLENS_K, "cu_seqlens_k")])
def test_cu_seqlens_device(i, name):
    with pytest.raises(ValueError, match=f"^{name} must be on the same device as q, got meta and q on cpu"):
        call((i, i32(CU_Q, device="meta")))


# Rule 3: seqused_k.


def test_seqused_k_not_a_tensor():
    with pytest.raises(TypeError, match="^seqused_k must be a torch.Tensor of int32, got list"):
        call(seqused_k=[4, 0, 0])


def test_seqused_k_dtype():
    with pytest.raises(TypeError, match="^seqused_k must be int32, got torch.int64"):
        call(seqused_k=torch.tensor([4, 0, 0]))


def test_seqused_k_rank():
    with pytest.raises(ValueError, match=r"^seqused_k must have rank 1, got shape \(\)"):
        call(seqused_k=i32(4))


def test_seqused_k_length():
    with pytest.raises(ValueError, match="^seqused_k must have length batch = 3, got 4"):
        call(seqused_k=i32([4, 0, 0, 0]))


def test_seqused_k_device():
    with pytest.raises(ValueError, match="^seqused_k must be on the same device as q, got meta"):
        call(seqused_k=i32([4, 0, 0], device="meta"))


# Rule 4: max_seqlen_q and max_seqlen_k.


@pytest.mark.parametrize("value, type_name", [(True, "bool"), (3.0, "float"), (torch.tensor(3), "Tensor")])
@pytest.mark.parametrize("i, name", [(MAX_Q, "max_seqlen_q"), (MAX_K, "max_seqlen_k")])
def test_max_seqlen_type(i, name, value, type_name):
    with pytest.raises(TypeError, match=f"^{name} must be an int \\(pass a Python int.*got {type_name}$"):
        call((i, value))


@pytest.mark.parametrize("i, name", [(MAX_Q, "max_seqlen_q"), (MAX_K, "max_seqlen_k")])
def test_max_seqlen_negative(i, name):
    with pytest.raises(ValueError, match=f"^{name} must be >= 0, got -1"):
        call((i, -1))


# Rule 5: the values.


@pytest.mark.parametrize("i, name", [(CU_SEQLENS_Q, "cu_seqlens_q"), (CU_SEQLENS_K, "cu_seqlens_k")])
def test_cu_seqlens_start_at_zero(i, name):
    with pytest.raises(ValueError, match=rf"^{name} must start at 0, got {name}\[0\] = 1"):
        call((i, i32([1, 3, 3, 5])))


@pytest.mark.parametrize("i, name", [(CU_SEQLENS_Q, "cu_seqlens_q"), (CU_SEQLENS_K, "cu_seqlens_k")])
def test_cu_seqlens_non_decreasing(i, name):
    with pytest.raises(
        ValueError, match=f"^{name} must be non-decreasing, got a negative length -2 for batch index 2"
    ):
        call((i, i32([0, 3, 4, 2])))


@pytest.mark.parametrize(
    "i, name, total", [(CU_SEQLENS_Q, "cu_seqlens_q", "total_q"), (CU_SEQLENS_K, "cu_seqlens_k", "total_k")]
)
def test_cu_seqlens_inside_tensor(i, name, total):
    with pytest.raises(ValueError, match=rf"^{name}\[-1\] must be <= {total} .*got 7 > 6"):
        call((i, i32([0, 3, 3, 7])), (MAX_Q, 7), (MAX_K, 7))


@pytest.mark.parametrize("i, name, longest", [(MAX_Q, "max_seqlen_q", 3), (MAX_K, "max_seqlen_k", 4)])
def test_max_seqlen_below_longest(i, name, longest):
    with pytest.raises(
        ValueError, match=f"^{name} must be >= the longest . sequence, {longest}, got 2.*uncomputed"
    ):
        call((i, 2))


@pytest.mark.parametrize("used, b, bound", [([5, 0, 0], 0, 4), ([4, 2, 0], 1, 1), ([4, 0, -1], 2, 0)])
def test_seqused_k_range(used, b, bound):
    with pytest.raises(ValueError, match=rf"^seqused_k\[{b}\] must be in \[0, {bound}\]"):
        call(seqused_k=i32(used))


def test_check_values_false_skips_value_rules():
    bad = i32([1, 0, 9, 99])
    shape = call((CU_SEQLENS_Q, bad), (MAX_Q, 0), seqused_k=i32([-1, 9, 9]), check_values=False)
    assert shape.batch == 3 and shape.max_seqlen_q == 0


def test_check_values_false_keeps_metadata_rules():
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        call((CU_SEQLENS_Q, torch.tensor(CU_Q)), check_values=False)


# varlen_values_checkable.


def test_values_checkable_in_eager():
    assert varlen_values_checkable()


def test_values_not_checkable_when_the_environment_says_so(monkeypatch):
    monkeypatch.setenv("HOPPER_FMHA_CHECK_VALUES", "0")
    assert not varlen_values_checkable()
    monkeypatch.setenv("HOPPER_FMHA_CHECK_VALUES", "1")
    assert varlen_values_checkable()


def test_values_not_checkable_under_compile(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not varlen_values_checkable()


def test_values_not_checkable_under_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not varlen_values_checkable()
