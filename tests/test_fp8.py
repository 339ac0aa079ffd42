"""FP8 on the native path: hardware refusal, module filter, conversion, float8 all-gather scales."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from launcher.config.schema import Fp8Config
from launcher.parallel import fp8
from launcher.parallel.fp8 import (
    build_float8_linear_config,
    convert_to_float8,
    float8_all_gather_enabled,
    fp8_hardware_problem,
    needs_emulation,
    plan_float8_conversion,
)

import torchao.float8 as torchao_float8  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from tests.parallel_harness.matrix import DEEPSEEK_V3, QWEN3_MOE  # noqa: E402


# ----------------------------------------------------------------------------- hardware


@pytest.mark.parametrize("cc", [(8, 9), (9, 0), (10, 0)])
def test_fp8_capable_gpus_are_accepted(cc):
    assert fp8_hardware_problem("cuda", cc, emulate=False) is None
    assert not needs_emulation("cuda", cc)


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (7, 0)])
def test_gpus_before_8_9_are_refused_with_numbers_and_fixes(cc):
    msg = fp8_hardware_problem("cuda", cc, emulate=False)
    assert msg is not None
    assert f"{cc[0]}.{cc[1]}" in msg and "8.9" in msg
    assert "precision=bf16" in msg and "precision.fp8.emulate=true" in msg
    # Emulation is the escape hatch: accepted, and it really emulates.
    assert fp8_hardware_problem("cuda", cc, emulate=True) is None
    assert needs_emulation("cuda", cc)


def test_cpu_is_refused_unless_emulated():
    msg = fp8_hardware_problem("cpu", None, emulate=False)
    assert msg is not None and "cpu" in msg and "precision.fp8.emulate=true" in msg
    assert fp8_hardware_problem("cpu", None, emulate=True) is None
    assert needs_emulation("cpu", None)


def test_unknown_compute_capability_is_refused():
    msg = fp8_hardware_problem("cuda", None, emulate=False)
    assert msg is not None and "compute capability" in msg


def test_fp8_module_imports_without_torch():
    """The planner (no torch) asks fp8_hardware_problem()."""
    import subprocess
    import sys

    code = ("import sys; import launcher.parallel.fp8 as f; "
            "f.fp8_hardware_problem('cuda', (9, 0), False); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- module filter


class _Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        # Named like the output layer, but must not match the "output" exclude entry.
        self.output_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.output_proj(self.wo(self.wq(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, ffn: int, moe: bool):
        super().__init__()
        self.attention = _Attention(dim)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.router = nn.Linear(dim, 16, bias=False) if moe else None

    def forward(self, x):
        h = x + self.attention(x)
        if self.router is not None:
            h = h + self.router(h).sum(-1, keepdim=True)
        return h + self.w2(torch.relu(self.w1(h)))


class _TinyLM(nn.Module):
    """Llama-like naming: layers.N.*, output; one odd-sized and one tiny linear."""

    def __init__(self, dim: int = 64, ffn: int = 192, vocab: int = 256):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([_Block(dim, ffn, moe=False), _Block(dim, ffn, moe=True)])
        self.odd = nn.Linear(dim, 30, bias=False)  # 30 is not a multiple of 16
        self.small = nn.Linear(dim, 32, bias=False)  # below min_features=48 in one test
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        h = h + self.odd(h).mean(-1, keepdim=True) + self.small(h).mean(-1, keepdim=True)
        return self.output(h)


BLOCK_LINEARS = ["attention.wq", "attention.wo", "attention.output_proj", "w1", "w2"]


def test_filter_keeps_output_router_and_odd_sizes_in_bf16():
    model = _TinyLM()
    report = plan_float8_conversion(model, Fp8Config())
    expected = [f"layers.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS] + ["small"]
    assert sorted(report.converted) == sorted(expected)
    assert set(report.kept) == {"layers.1.router", "odd", "output"}
    assert "router" in report.kept["layers.1.router"]
    assert "not divisible by 16" in report.kept["odd"]
    assert report.total == 14


def test_filter_min_features_and_custom_exclude():
    model = _TinyLM()
    report = plan_float8_conversion(model, Fp8Config(min_features=48, exclude=["output", "layers.0"]))
    assert "small" in report.kept and "min_features=48" in report.kept["small"]
    assert not any(n.startswith("layers.0.") for n in report.converted)
    assert sorted(report.converted) == sorted(f"layers.1.{n}" for n in BLOCK_LINEARS)
    # The router is converted when nobody excludes it and its 64x16 shape qualifies.
    assert "layers.1.router" in plan_float8_conversion(model, Fp8Config(exclude=["output"])).converted


def test_convert_swaps_exactly_the_planned_layers_and_logs(caplog):
    model = _TinyLM()
    with caplog.at_level(logging.INFO, logger="launcher.parallel.fp8"):
        out = convert_to_float8(model, Fp8Config(emulate=True), device_type="cpu", fsdp_enabled=False)
    assert out is model
    float8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert float8 == set(model.float8_report.converted)
    assert plain == {"layers.1.router", "odd", "output"}
    assert all(m.config.emulate for m in model.modules() if isinstance(m, Float8Linear))
    assert "converted 11 of 14 Linear layers to float8 (tensorwise, emulated)" in caplog.text
    assert "output" in caplog.text and "router" in caplog.text
    # Checkpoints do not change with precision: same keys as the bf16 model, no report in them.
    assert set(model.state_dict()) == set(_TinyLM().state_dict())


def test_convert_refuses_cpu_without_emulation():
    with pytest.raises(RuntimeError, match="precision.fp8.emulate=true"):
        convert_to_float8(_TinyLM(), Fp8Config(emulate=False), device_type="cpu", fsdp_enabled=False)


def test_converted_model_trains_close_to_bf16():
    torch.manual_seed(0)
    ref = _TinyLM()
    model = _TinyLM()
    model.load_state_dict(ref.state_dict())
    convert_to_float8(model, Fp8Config(emulate=True), device_type="cpu", fsdp_enabled=False)
    tokens = torch.randint(0, 256, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(tokens).float()
        got = model(tokens).float()
    got.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    # float8 e4m3 keeps 3 mantissa bits: about 6% relative error per element is expected.
    rel = (got - want).norm() / want.norm()
    assert rel < 0.1, f"float8 output differs from bf16 by {rel:.3f} relative (limit 0.1)"


# ----------------------------------------------------------------------------- per family

def _family_model(overrides: dict):
    """debug_moe with a family's model keys (the layout matrix's tiny Qwen3-MoE / DeepSeek-V3),
    built with real weights on the CPU."""
    from launcher.models import build_model
    from tests.parallel_harness.run_layouts import model_config  # the matrix's config reader

    cfg = model_config("debug_moe", overrides)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model, cfg


def _expected_float8(cfg) -> tuple:
    """(converted, kept) FQNs the filter's rules give for the tiny families' blocks: every
    attention and FFN linear whose in and out features are multiples of 16, never the router
    or the output layer; GroupedExperts are no nn.Linear (CPU: they stay bf16, not listed)."""
    converted, kept = set(), {"output"}
    for i in range(cfg.n_layers):
        if cfg.family == "deepseek_v3":
            q, kv, heads = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.n_heads
            shapes = {"wq_a": (cfg.dim, q), "wq_b": (q, heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)),
                      "wkv_a": (cfg.dim, kv + cfg.qk_rope_head_dim),
                      "wkv_b": (kv, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)), "wo": (heads * cfg.v_head_dim, cfg.dim)}
            dense = i < cfg.n_dense_layers
        else:  # qwen3: heads of head_dim (24 here, not dim / n_heads)
            q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            shapes = {"wq": (cfg.dim, q), "wk": (cfg.dim, kv), "wv": (cfg.dim, kv), "wo": (q, cfg.dim)}
            dense = i in cfg.mlp_only_layers
        for name, dims in shapes.items():
            (converted if all(d % 16 == 0 for d in dims) else kept).add(f"layers.{i}.attention.{name}")
        ffn = "feed_forward" if dense else ("moe.shared_experts" if cfg.n_shared_experts else None)
        converted |= {f"layers.{i}.{ffn}.{w}" for w in ("w1", "w2", "w3")} if ffn else set()
        kept |= set() if dense else {f"layers.{i}.moe.router"}
    return converted, kept


FAMILY_FP8 = {
    "qwen3_moe": QWEN3_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    # Latent ranks of 8: q_lora_rank and kv_lora_rank not multiples of 16, so wq_a, wq_b and wkv_b
    # stay bf16; wkv_a (latent 8 + RoPE key 8 = 16 outputs) converts.
    "deepseek_v3_latent8": {**DEEPSEEK_V3, "q_lora_rank": 8, "kv_lora_rank": 8},
}


@pytest.mark.parametrize("family", list(FAMILY_FP8))
def test_family_linears_convert_by_shape_never_router_or_output(family):
    """Which module FQNs precision=fp8 swaps for float8 in each family's tiny model: MLA's low-rank
    projections only where both sizes are multiples of 16, never the router (top-k is
    discontinuous) nor the output layer; convert_to_float8 swaps exactly those."""
    model, cfg = _family_model(FAMILY_FP8[family])
    report = plan_float8_conversion(model, Fp8Config(emulate=True))
    converted, kept = _expected_float8(cfg)
    assert set(report.converted) == converted, f"{family}: {set(report.converted) ^ converted}"
    assert set(report.kept) == kept, f"{family}: {set(report.kept) ^ kept}"
    for name in (n for n in kept if n.endswith(".router")):
        assert report.kept[name] == "excluded by name 'router'"
    for name in (n for n in kept if ".attention." in n):
        assert "not divisible by 16" in report.kept[name], report.kept[name]
    convert_to_float8(model, Fp8Config(emulate=True), device_type="cpu", fsdp_enabled=False)
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == converted
    if family == "deepseek_v3_latent8":  # the case the rule exists for; MLA runs half float8, half not
        assert {"layers.1.attention.wq_a", "layers.1.attention.wkv_b"} <= set(report.kept)
        model(torch.randint(0, cfg.vocab_size, (2, 16))).float().square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)


# ----------------------------------------------------------------------------- recipes / all-gather


def test_all_gather_only_with_fsdp_and_tensorwise():
    assert float8_all_gather_enabled(Fp8Config(recipe="tensorwise"), fsdp_enabled=True)
    assert not float8_all_gather_enabled(Fp8Config(recipe="tensorwise"), fsdp_enabled=False)
    assert not float8_all_gather_enabled(Fp8Config(recipe="rowwise"), fsdp_enabled=True)
    assert not float8_all_gather_enabled(Fp8Config(all_gather=False), fsdp_enabled=True)


def test_linear_config_per_recipe():
    tw = build_float8_linear_config(Fp8Config(recipe="tensorwise"), fsdp_enabled=True, emulate=False)
    assert tw.enable_fsdp_float8_all_gather and not tw.emulate
    assert tw.cast_config_weight.scaling_granularity == ScalingGranularity.TENSORWISE
    rw = build_float8_linear_config(Fp8Config(recipe="rowwise"), fsdp_enabled=True, emulate=True)
    assert not rw.enable_fsdp_float8_all_gather and rw.emulate
    assert rw.cast_config_weight.scaling_granularity == ScalingGranularity.AXISWISE
    with pytest.raises(ValueError, match="tensorwise, rowwise"):
        build_float8_linear_config(Fp8Config(recipe="blockwise"), fsdp_enabled=False, emulate=True)


def test_rowwise_converts_and_runs():
    model = _TinyLM()
    convert_to_float8(model, Fp8Config(recipe="rowwise", emulate=True), device_type="cpu", fsdp_enabled=True)
    assert not model.float8_report.all_gather
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 256, (2, 16))).float().mean().backward()


def test_float8_all_gather_scales_are_precomputed_after_step():
    """FSDP2 on a one-rank gloo group: the per-step helper fills each weight's scale."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        torch.manual_seed(0)
        model = _TinyLM()
        convert_to_float8(model, Fp8Config(emulate=True), device_type="cpu", fsdp_enabled=True)
        assert model.float8_report.all_gather
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        assert fp8.float8_scale_precompute_needed(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randint(0, 256, (2, 16))).float().mean().backward()
        opt.step()
        fp8.precompute_float8_scales(model)
        weights = [
            m.weight._local_tensor
            for m in model.modules()
            if isinstance(m, Float8Linear) and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
        ]
        assert len(weights) == 11
        e4m3_max = torch.finfo(torch.float8_e4m3fn).max
        for w in weights:
            # scale = e4m3 max / amax(|w|) of the updated weight
            want = e4m3_max / w._tensor.abs().max().double().clamp(min=1e-12)
            assert w._precomputed_scale is not None
            assert torch.allclose(w._precomputed_scale.double(), want, rtol=1e-5)
    finally:
        if owns_group:
            dist.destroy_process_group()


def test_precompute_not_needed_without_fsdp():
    model = _TinyLM()
    convert_to_float8(model, Fp8Config(emulate=True), device_type="cpu", fsdp_enabled=False)
    assert not fp8.float8_scale_precompute_needed(model)


def test_converting_twice_changes_nothing():
    model = _TinyLM()
    convert_to_float8(model, Fp8Config(emulate=True), device_type="cpu", fsdp_enabled=False)
    before = {n: type(m) for n, m in model.named_modules()}
    convert_to_float8(model, Fp8Config(emulate=True), device_type="cpu", fsdp_enabled=False)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert model.float8_report.converted == [] and model.float8_report.already_float8 == 11
