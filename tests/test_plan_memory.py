"""Memory model: the seed cases computed by hand from the model-state table in docs/planner.md,
per backend, ZeRO stage and offload, and the activation formulas' behaviour under TP, SP, CP, recomputation and pipeline schedules."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.plan.layout import Layout, MemoryPlan, NumericsPlan, RankBatchPlan
from launcher.plan.degrees import MeshPlan
from launcher.plan.estimate.memory import (
    estimate_memory,
    inflight_microbatches,
    layer_activation_bytes,
    model_state_memory,
)
from launcher.plan.estimate.params import StageParams, model_shape


def _states(psi, **lay):
    st = StageParams(rank=0, layers=(), shared=int(psi), routed=0, largest_unit=0,
                     has_embedding=False, has_output=False, n_moe_layers=0)
    s = model_state_memory(st, Layout.from_dict(lay))  # flat keys, as in plan.json
    return s["params"] + s["grads"] + s["optimizer"], s


@pytest.mark.parametrize("backend,zero3_bytes", [("native", 16), ("deepspeed", 18)])
def test_seed_7_5b_on_64_gpus(backend, zero3_bytes):
    # 16 bytes/param: 7.5e9 * 16 = 120 GB on every GPU without ZeRO, 120/64 = 1.875 GB with ZeRO-3
    # (FSDP2). DeepSpeed's ZeRO-3 holds an fp32 gradient partition at the step: 18 bytes/param.
    psi = 7.5e9
    no_zero, _ = _states(psi, dp_shard=64, zero_stage=0, sharding_backend=backend)
    zero3, _ = _states(psi, dp_shard=64, zero_stage=3, sharding_backend=backend)
    assert no_zero == pytest.approx(120e9, rel=1e-6)
    assert zero3 == pytest.approx(zero3_bytes * psi / 64, rel=1e-6)


def test_seed_1t_params_zero3_on_1024_gpus():
    psi = 1e12
    total, _ = _states(psi, dp_shard=1, zero_stage=0, sharding_backend="deepspeed")
    assert total == pytest.approx(16e12, rel=1e-6)  # 16 TB of states
    per_gpu, _ = _states(psi, dp_shard=1024, zero_stage=3, sharding_backend="deepspeed")
    # The ZeRO paper's "16 GB per GPU" counts 16 B/param; DeepSpeed's implementation (and its
    # estimate_zero3_model_states_mem_needs) 18: the fp32 gradient partition the master step reads.
    assert per_gpu == pytest.approx(18e12 / 1024, rel=1e-6)


def test_deepspeed_zero_stages_follow_the_design_formulas():
    psi, n = 1e9, 8
    z1, s1 = _states(psi, dp_shard=n, zero_stage=1, sharding_backend="deepspeed")
    z2, s2 = _states(psi, dp_shard=n, zero_stage=2, sharding_backend="deepspeed")
    # The paper's ZeRO-1 is 4Ψ + 12Ψ/N; our DeepSpeed config accumulates bf16 gradients in fp32
    # at ZeRO-1 (DeepSpeed's BF16_Optimizer), which adds an unsharded fp32 gradient buffer: 8Ψ + 12Ψ/N.
    assert z1 == pytest.approx(8 * psi + 12 * psi / n)
    # ZeRO-2: bf16 params 2Ψ + the fp32 gradient partition 4Ψ/N (which replaces the bf16 one at the
    # step) + 12Ψ/N.
    assert z2 == pytest.approx(2 * psi + 16 * psi / n)
    assert s1["params"] == pytest.approx(2 * psi) and s2["grads"] == pytest.approx(4 * psi / n)
    # DeepSpeed partitions over every data-parallel rank, dp_replicate included.
    z3, _ = _states(psi, dp_replicate=2, dp_shard=4, zero_stage=3, sharding_backend="deepspeed")
    assert z3 == pytest.approx(18 * psi / 8)


def test_fsdp2_keeps_fp32_shards_and_replicates_over_dp_replicate():
    psi = 1e9
    total, s = _states(psi, dp_replicate=2, dp_shard=4, zero_stage=3, sharding_backend="native")
    assert s["params"] == pytest.approx(4 * psi / 4)  # fp32 master shard, HSDP shards over dp_shard only
    assert s["grads"] == pytest.approx(4 * psi / 4)
    assert s["optimizer"] == pytest.approx(8 * psi / 4)
    # bf16 and fp32 runs keep the same states; only the unsharded working copy differs.
    _, s32 = _states(psi, dp_shard=4, zero_stage=3, precision="fp32")
    assert s32["params"] == s["params"]


def test_tp_and_ep_divide_before_zero():
    st = StageParams(rank=0, layers=(), shared=8_000_000, routed=64_000_000, largest_unit=0,
                     has_embedding=False, has_output=False, n_moe_layers=0)
    s = model_state_memory(st, Layout(mesh=MeshPlan(tp=2, ep=8, dp_shard=16), memory=MemoryPlan(zero_stage=3)))
    # shared: /tp /16 ranks; routed experts: TP leaves them whole (launcher/parallel/tp.py), /ep,
    # then sharded over the 16/8 = 2 remaining ranks (what action=rehearse measured for Mixtral).
    assert s["params"] == pytest.approx(4 * (8e6 / 2 / 16 + 64e6 / 8 / 2))
    # Folded over TP (an MoE under tp > 1, as resolve decides): the TP ranks join the experts'
    # sharding ranks, 16 x 2 / 8 = 4 (the layout matrix's rehearsal vs real run holds it exact).
    folded = Layout(mesh=MeshPlan(tp=2, ep=8, dp_shard=16), memory=MemoryPlan(zero_stage=3), experts_folded=True)
    assert model_state_memory(st, folded)["params"] == pytest.approx(4 * (8e6 / 2 / 16 + 64e6 / 8 / 4))


def test_offload_moves_states_to_the_host():
    psi = 1e9
    _, ds = _states(psi, dp_shard=8, zero_stage=2, sharding_backend="deepspeed",
                    offload_optimizer="cpu", offload_backend="deepspeed")
    assert ds["optimizer"] == 0 and ds["grads"] == 0 and ds["params"] == pytest.approx(2 * psi)
    assert ds["host"] == pytest.approx(12 * psi / 8 + 2 * psi / 8)
    _, nat = _states(psi, dp_shard=8, zero_stage=3, offload_optimizer="cpu", offload_backend="native")
    assert nat["params"] == nat["grads"] == nat["optimizer"] == 0  # CPUOffloadPolicy moves all three
    assert nat["host"] == pytest.approx(16 * psi / 8)


# ----------------------------------------------------------------------------- activations

SHAPE = model_shape(compose_spec(["model=llama3_8b"]).model)  # 32 heads, 8 KV heads, h 4096, f 14336


def test_layer_activations_by_hand():
    lay = Layout(batch=RankBatchPlan(seq_len=4096, micro_batch_size=1))
    h, f, tokens = 4096, 14336, 4096
    # fp32 norms 16h, linear inputs 2*2h, q/o/wo-input 3*2h, k/v 2*2(h/4) (SDPA enable_gqa: 8 of
    # 32 heads, not repeated), SwiGLU 4*2f.
    expected = tokens * (16 * h + 4 * h + 6 * h + h + 8 * f)
    assert layer_activation_bytes(SHAPE, lay, False, "none") == pytest.approx(expected)
    # Context parallelism repeats K/V to all heads (ring attention has no enable_gqa): 5*2h, tokens / cp.
    cp = dataclasses.replace(lay, mesh=dataclasses.replace(lay.mesh, cp=2))
    assert layer_activation_bytes(SHAPE, cp, False, "none") == pytest.approx(
        tokens / 2 * (16 * h + 4 * h + 10 * h + 8 * f))
    # Full recomputation keeps the block input only: 2 bytes * s * b * h.
    assert layer_activation_bytes(SHAPE, lay, False, "full") == pytest.approx(2 * tokens * h)


def test_compiled_selective_block_drops_w2_output():
    """trainer.compile under selective AC: the compiled block keeps what the policy saves except
    w2's output, which only the residual add reads (measured on the real llama_1b block:
    bench/compiled_block_activations.py, a x h per token and block less under op and
    op_alternate_mm). Full AC and MoE blocks (compiled without their experts) are unchanged."""
    base = Layout(batch=RankBatchPlan(seq_len=8192, micro_batch_size=2))
    tokens, a, h = 2 * 8192, 2, 4096

    def saving(lay, moe, mode):
        compiled = dataclasses.replace(lay, compile=True)
        return layer_activation_bytes(SHAPE, lay, moe, mode) - layer_activation_bytes(SHAPE, compiled, moe, mode)

    for mode in ("op", "op_alternate_mm"):
        assert saving(base, False, mode) == pytest.approx(tokens * a * h)
        # Under SP the term the formula counts for w2's output is split over TP.
        sp = dataclasses.replace(base, mesh=dataclasses.replace(base.mesh, tp=8), sp=True)
        assert saving(sp, False, mode) == pytest.approx(tokens * a * h / 8)
    assert saving(base, False, "full") == 0
    assert saving(base, True, "op") == 0


def test_tp_sp_cp_and_selective_shrink_activations():
    base = Layout(batch=RankBatchPlan(seq_len=8192, micro_batch_size=2))
    none = layer_activation_bytes(SHAPE, base, False, "none")
    tp = layer_activation_bytes(SHAPE, dataclasses.replace(base, mesh=dataclasses.replace(base.mesh, tp=8)), False, "none")
    sp = layer_activation_bytes(SHAPE, dataclasses.replace(base, mesh=dataclasses.replace(base.mesh, tp=8), sp=True), False, "none")
    cp = layer_activation_bytes(SHAPE, dataclasses.replace(base, mesh=dataclasses.replace(base.mesh, cp=2)), False, "none")
    sel = layer_activation_bytes(SHAPE, base, False, "op")
    assert none > tp > sp  # TP splits heads/FFN; SP also splits the norms
    assert tp > none / 8  # without SP the norm region stays whole on every TP rank
    # CP halves the tokens but repeats K/V to all heads (ring attention has no enable_gqa; the
    # exact count is in test_layer_activations_by_hand).
    assert none / 2 < cp < 0.6 * none
    assert sel < none
    # mbs doubles the tokens: activations double.
    mbs1 = layer_activation_bytes(SHAPE, dataclasses.replace(base, batch=dataclasses.replace(base.batch, micro_batch_size=1)), False, "none")
    assert none == pytest.approx(2 * mbs1)


def test_inflight_microbatches_per_schedule():
    assert inflight_microbatches(Layout(mesh=MeshPlan(pp=4), batch=RankBatchPlan(microbatches=16), schedule="1f1b"), 0) == 4  # p on the first stage
    assert inflight_microbatches(Layout(mesh=MeshPlan(pp=4), batch=RankBatchPlan(microbatches=16), schedule="1f1b"), 3) == 1
    assert inflight_microbatches(Layout(mesh=MeshPlan(pp=4), batch=RankBatchPlan(microbatches=16), schedule="gpipe"), 2) == 16  # GPipe keeps m
    assert inflight_microbatches(Layout(mesh=MeshPlan(pp=4), batch=RankBatchPlan(microbatches=2), schedule="1f1b"), 0) == 2  # never more than m
    inter = inflight_microbatches(Layout(mesh=MeshPlan(pp=4), vpp=2, batch=RankBatchPlan(microbatches=16), schedule="interleaved_1f1b"), 0)
    assert inter == pytest.approx(4 * (1 + 3 / 8))  # p (1 + (p-1)/(p v))


def test_first_stage_is_most_loaded_under_1f1b_and_memory_grows_with_mbs():
    lay = Layout(mesh=MeshPlan(pp=4, dp_shard=8, tp=2), sp=True, batch=RankBatchPlan(microbatches=8, seq_len=4096), memory=MemoryPlan(zero_stage=3))
    stages = estimate_memory(SHAPE, lay)
    assert len(stages) == 4
    assert max(stages, key=lambda s: s.total).rank == 0
    assert stages[0].activations > stages[3].activations
    bigger = estimate_memory(SHAPE, dataclasses.replace(lay, batch=dataclasses.replace(lay.batch, micro_batch_size=2)))
    assert bigger[0].activations == pytest.approx(2 * stages[0].activations, rel=1e-6)
    full = estimate_memory(SHAPE, dataclasses.replace(lay, memory=dataclasses.replace(lay.memory, ac_mode="full")))
    assert full[0].activations < stages[0].activations / 5


# ----------------------------------------------------------------------------- activations vs the real block

# Tiny blocks of each family, built on CPU. Qwen3: head size 24 (not dim / n_heads = 16), QK-norm.
# DeepSeek-V3: MLA with both latents and the sigmoid, bias-corrected, group-limited router; its
# v_head_dim equals qk_nope + qk_rope so that SDPA takes CPU's flash kernel (the fused kind a GPU
# runs, which keeps no s x s scores: with unequal widths CPU falls back to the math kernel).
_TINY = {
    "llama": ("debug", {}),
    "qwen3": ("debug", {"family": "qwen3", "qk_norm": True, "head_dim": 24}),
    "deepseek_v3": ("debug_moe", {"family": "deepseek_v3", "n_kv_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                                  "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "n_experts": 16,
                                  "top_k": 4, "score_func": "sigmoid", "routed_scaling_factor": 2.5, "n_group": 4,
                                  "topk_group": 2, "aux_loss_coef": 0.0}),
}


def _saved_bytes_of_block(cfg, layer: int, batch: int, seq: int) -> int:
    """Bytes autograd saves for backward in one forward of block `layer` (bf16 weights and input, as
    under mixed precision): every saved tensor's storage once, leaving out the parameters and
    buffers the block holds anyway."""
    import torch

    from launcher.models import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    held = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, seq, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[str(layer)](x, model.rope)
    return sum(saved.values())


def test_compiled_selective_block_saves_what_the_formula_says():
    """The real debug block under selective AC, eager vs compiled (the runtime's wrapping and
    compile, in the engine's order), measured by bench/compiled_block_activations.py with the CPU
    allocator: the bytes the compiled block stops keeping are what layer_activation_bytes takes
    out for trainer.compile (w2's output)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import compiled_block_activations as bench  # lazy: imports torch and compiles blocks

    cfg = compose_spec(["model=debug"]).model
    shape = model_shape(cfg)
    batch, seq = 4, 128
    lay = Layout(batch=RankBatchPlan(micro_batch_size=batch, seq_len=seq), numerics=NumericsPlan(precision="bf16"))
    for mode in ("op", "op_alternate_mm"):
        eager, compiled = (bench.measure("debug", mode, c, batch, seq)["saved_per_token"] * batch * seq
                           for c in (False, True))
        predicted = (layer_activation_bytes(shape, lay, False, mode)
                     - layer_activation_bytes(shape, dataclasses.replace(lay, compile=True), False, mode))
        assert eager - compiled == predicted > 0, (mode, eager, compiled, predicted)


@pytest.mark.parametrize("family,layer,tolerance", [("llama", 0, 0.05), ("qwen3", 0, 0.05),
                                                     ("deepseek_v3", 0, 0.06), ("deepseek_v3", 1, 0.1)])
def test_layer_activations_match_what_the_real_block_saves(family, layer, tolerance):
    """layer_activation_bytes (no recomputation) against the tensors the real block saves for
    backward on CPU, per family: Qwen3's QK-norm (fp32 q and k, in and out), MLA's latent norms and
    latent inputs, its assembled q and k and the whole wkv_b output v is a view of. Block 0 of the
    DeepSeek-V3 config is dense, block 1 MoE (whose routing bookkeeping the formula leaves out)."""
    import dataclasses as dc

    from launcher.models.shape import is_mla

    base, overrides = _TINY[family]
    cfg = dc.replace(compose_spec([f"model={base}"]).model, **overrides)
    shape = model_shape(cfg)
    assert shape.is_moe_layer(layer) == (family == "deepseek_v3" and layer == 1)
    assert is_mla(cfg) == (family == "deepseek_v3")
    batch, seq = 2, 64
    measured = _saved_bytes_of_block(cfg, layer, batch, seq)
    lay = Layout(batch=RankBatchPlan(micro_batch_size=batch, seq_len=seq), numerics=NumericsPlan(precision="bf16"))
    predicted = layer_activation_bytes(shape, lay, shape.is_moe_layer(layer), "none")
    assert abs(predicted / measured - 1) < tolerance, (family, layer, predicted, measured)
