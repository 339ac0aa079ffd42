"""GQA through SDPA's enable_gqa: same output as copying K/V per query head, without the copy."""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.models.layers import Attention, grouped_attention, rope_table


class _OpRecorder(TorchDispatchMode):
    """Records (op name, output numels) of every aten op run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[str, List[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), [o.numel() for o in outs if isinstance(o, torch.Tensor)]))
        return out


def _qkv(b=2, hq=8, hkv=2, s=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g),
            torch.randn(b, hkv, s, d, generator=g))


def _reference(q, k, v):
    """The previous implementation: K/V materialised per query head."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_enable_gqa_matches_repeat_interleave_fp32():
    q, k, v = _qkv()
    torch.testing.assert_close(grouped_attention(q, k, v), _reference(q, k, v), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped_attention(q, k, v, expand_kv=True), _reference(q, k, v),
                               rtol=0, atol=0)


def test_enable_gqa_gradients_match_fp32():
    q, k, v = (t.requires_grad_() for t in _qkv(seed=1))
    grouped_attention(q, k, v).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _reference(q, k, v).square().sum().backward()
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _expanded_copies(ops: List[Tuple[str, List[int]]], expanded_numel: int) -> List[str]:
    """Ops other than SDPA itself whose output has the size of K or V repeated per query head."""
    return [name for name, numels in ops
            if "scaled_dot_product" not in name and expanded_numel in numels]


def test_no_kv_copy_of_repeated_size_is_allocated():
    q, k, v = _qkv()
    expanded = k.numel() * (q.shape[1] // k.shape[1])
    with _OpRecorder() as rec:
        grouped_attention(q, k, v)
    assert _expanded_copies(rec.ops, expanded) == [], rec.ops
    # The recorder does see the copy on the expanding path (so the check above can fail).
    with _OpRecorder() as rec:
        grouped_attention(q, k, v, expand_kv=True)
    assert _expanded_copies(rec.ops, expanded)


def test_attention_module_default_and_expanded_agree():
    torch.manual_seed(0)
    attn = Attention(dim=64, n_heads=8, n_kv_heads=2)
    x = torch.randn(2, 16, 64)
    rope = rope_table(8, 16, 10000.0)
    assert attn.expand_kv is False
    out = attn(x, rope)
    attn.expand_kv = True
    torch.testing.assert_close(out, attn(x, rope), rtol=1e-6, atol=1e-6)


def test_context_parallel_switches_to_expanded_kv():
    from launcher.parallel.cp import use_expanded_kv

    model = torch.nn.ModuleDict({"a": Attention(32, 4, 2), "b": Attention(32, 4, 1)})
    assert use_expanded_kv(model) == 2
    assert all(m.expand_kv for m in model.values())
