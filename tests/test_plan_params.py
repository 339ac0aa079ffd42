"""Parameter counts from the model shape match the real model and the FLOPs module."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.plan.estimate.flops import param_counts
from launcher.plan.estimate.params import model_shape, stage_params

# `hf` has no shape of its own (it reads model.init_from's config.json: tests/test_hf_weights.py).
MODELS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml") if p.stem != "hf")


@pytest.mark.parametrize("name", MODELS)
def test_param_count_matches_meta_model(name):
    import torch
    from launcher.models import build_model

    cfg = compose_spec([f"model={name}"]).model
    with torch.device("meta"):
        model = build_model(cfg)
    real = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    shape = model_shape(cfg)
    assert shape.total == real, f"{name}: planner counts {shape.total:,}, model has {real:,}"
    assert shape.total == param_counts(cfg).total
    assert shape.active == param_counts(cfg).active


def test_published_sizes():
    # Llama 3 8B / 70B / 405B and Mixtral 8x7B (46.7 B total, 12.9 B active) by their shapes.
    got = {n: model_shape(compose_spec([f"model={n}"]).model) for n in
           ("llama3_8b", "llama3_70b", "llama3_405b", "mixtral_8x7b")}
    assert got["llama3_8b"].total == 8_030_261_248
    assert got["llama3_70b"].total == 70_553_706_496
    assert got["llama3_405b"].total == 405_853_388_800
    assert got["mixtral_8x7b"].total == 46_702_792_704
    assert got["mixtral_8x7b"].active == 12_879_925_248
    # Qwen3 model cards: 0.6B (0.44B without embeddings, tied), 8.2B (6.95B without embedding and
    # output), 32.8B (31.2B), 30.5B with 3.3B active (3.35B, truncated), 235B with 22B active.
    qwen = {n: model_shape(compose_spec([f"model={n}"]).model) for n in
            ("qwen3_0_6b", "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b", "qwen3_235b_a22b")}
    assert round((qwen["qwen3_0_6b"].total - qwen["qwen3_0_6b"].embedding) / 1e9, 2) == 0.44
    for name, total, body in (("qwen3_8b", 8.2, 6.95), ("qwen3_32b", 32.8, 31.2)):
        s = qwen[name]
        assert round(s.total / 1e9, 1) == total
        assert round((s.total - s.embedding - s.output) / 1e9, len(str(body).split(".")[1])) == body
    assert (round(qwen["qwen3_30b_a3b"].total / 1e9, 1), round(qwen["qwen3_30b_a3b"].active / 1e9, 2)) == (30.5, 3.35)
    assert (round(qwen["qwen3_235b_a22b"].total / 1e9), round(qwen["qwen3_235b_a22b"].active / 1e9)) == (235, 22)
    # DeepSeek-V3: 671B total, 37B active (the paper's counts, without the multi-token-prediction
    # block); DeepSeek-V2-Lite's shape: 15.7B total.
    ds = model_shape(compose_spec(["model=deepseek_v3", "model.mtp_layers=0"]).model)
    assert (round(ds.total / 1e9), int(ds.active / 1e9)) == (671, 37)
    assert round(model_shape(compose_spec(["model=deepseek_v3_small"]).model).total / 1e9, 1) == 15.7
    # Mixtral 8x22B: 141B total, 39B active (Mistral AI's announcement).
    mx = model_shape(compose_spec(["model=mixtral_8x22b"]).model)
    assert (round(mx.total / 1e9), round(mx.active / 1e9)) == (141, 39)


def test_gqa_and_tied_embeddings_by_hand():
    m = compose_spec(["model=debug", "model.tie_embeddings=true"]).model
    s = model_shape(m)
    # dim 64, 4 heads (head_dim 16), 2 KV heads: wq, wo 64x64; wk, wv 64x32.
    assert s.attention == 2 * 64 * 64 + 2 * 64 * 32
    assert s.dense_ffn == 3 * 64 * 192
    assert s.output == 0 and s.embedding == 256 * 64
    assert s.total == 4 * (s.attention + 128 + s.dense_ffn) + 256 * 64 + 64


def test_moe_counts_by_hand():
    m = compose_spec(["model=debug_moe"]).model
    s = model_shape(m)
    # 4 layers, the first dense; MoE blocks: router 64x4, 4 routed + 1 shared experts of 3*64*96.
    expert = 3 * 64 * 96
    assert s.n_dense_layers == 1 and s.n_moe_layers == 3
    assert s.router == 64 * 4
    moe_block = s.attention + 128 + 64 * 4 + 5 * expert
    assert s.total == s.dense_block + 3 * moe_block + 2 * 256 * 64 + 64
    assert s.active == s.dense_block + 3 * (moe_block - 2 * expert) + 2 * 256 * 64 + 64


def test_stage_split_first_holds_embedding_last_holds_output():
    s = model_shape(compose_spec(["model=llama3_8b"]).model)
    stages = stage_params(s, pp=4)
    assert [st.n_layers for st in stages] == [8, 8, 8, 8]
    assert stages[0].has_embedding and not stages[0].has_output
    assert stages[-1].has_output and not stages[-1].has_embedding
    assert sum(st.shared + st.routed for st in stages) == s.total
    # Interleaved: rank 0 runs chunks 0 and 4 of 8; zbv (V shape): chunks 0 and 7.
    inter = stage_params(s, pp=4, vpp=2, schedule="interleaved_1f1b")
    assert inter[0].layers == tuple(range(0, 4)) + tuple(range(16, 20))
    zbv = stage_params(s, pp=4, vpp=2, schedule="zbv")
    assert zbv[0].has_embedding and zbv[0].has_output
    assert zbv[0].layers == tuple(range(0, 4)) + tuple(range(28, 32))
    # Uneven split: earlier stages take the remainder.
    assert [st.n_layers for st in stage_params(s, pp=5)] == [7, 7, 6, 6, 6]


def _module_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token counted from the torch model's modules, independently of the
    planner's shapes: 6 x (every nn.Linear weight, the routed experts' weights x top_k / n_experts,
    and the RMSNorm weights: flops.py's N_matmul counts every active non-embedding parameter, as
    torchtitan's 6 x non-embedding parameters does) plus, per block, q.k over the query width
    (wq's or wq_b's outputs) and the weighted sum over the value width (wo's inputs): 2 FLOPs per
    multiply-add, s keys per token, x3 for forward + backward."""
    import torch

    from launcher.models.layers import RMSNorm
    from launcher.models.moe import MoE

    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        experts = sum(p.numel() for p in moe.experts.parameters())
        matmul += experts * moe.top_k // moe.n_experts
    norms = sum(m.weight.numel() for m in model.modules() if isinstance(m, RMSNorm))
    widths = 0
    # Multi-token prediction (model.mtp_layers): its blocks, and the output head used once more per depth.
    mtp = list(model.mtp.values()) if model.mtp is not None else []
    matmul += len(mtp) * model.output.weight.numel()
    for block in [*model.layers.values(), *(d.block for d in mtp)]:
        attn = block.attention
        q = attn.wq_b if hasattr(attn, "wq_b") else attn.wq
        widths += q.out_features + attn.wo.in_features
    return 6.0 * (matmul + norms) + 3 * 2.0 * seq_len * widths


@pytest.mark.parametrize("name", ["qwen3_0_6b", "qwen3_30b_a3b", "deepseek_v3_small", "deepseek_v3", "debug_moe"])
def test_flops_per_token_match_the_meta_models_matmuls(name):
    """The planner's FLOPs per token (from the family's attention layout and parameter counts)
    equal a count made from the real model's Linear shapes on the meta device: Qwen3's head size
    (not dim / n_heads), MLA's low-rank projections and its q.k (nope + rope) and v widths."""
    import torch
    from launcher.models import build_model
    from launcher.plan.estimate.flops import training_flops_per_token

    cfg = compose_spec([f"model={name}"]).model
    with torch.device("meta"):
        model = build_model(cfg)
    seq = 4096
    assert training_flops_per_token(cfg, seq) == pytest.approx(_module_flops_per_token(model, seq), rel=1e-12)


def test_deepseek_v3_flops_per_token_against_the_published_count():
    """DeepSeek-V3 671B: the tech report (DeepSeek-AI, arXiv:2412.19437, abstract and section 1:
    "671B total parameters with 37B activated for each token") and torchtitan's MFU formula for it
    (torchtitan/models/utils.py get_moe_model_nparams_and_flops: 6 x active non-embedding parameters
    + 6 x n_layers x n_heads x (qk_nope + qk_rope + v_head) x seq_len, from
    torchtitan/models/deepseek_v3/model/args.py). With the published 37B (rounded; it includes the
    0.93B input embedding a lookup does not multiply) the planner's count lies within 2 %; the
    attention term is torchtitan's exactly."""
    from launcher.plan.estimate.flops import attention_flops_per_token, training_flops_per_token
    from launcher.plan.estimate.params import attention_width

    cfg = compose_spec(["model=deepseek_v3", "model.mtp_layers=0"]).model  # the report counts the main model
    seq = 4096
    published_attention = 6 * 61 * 128 * (128 + 64 + 128) * seq
    assert attention_flops_per_token(61, attention_width(model_shape(cfg)), seq) == pytest.approx(published_attention)
    published = 6 * 37e9 + published_attention
    got = training_flops_per_token(cfg, seq)
    assert got == pytest.approx(published, rel=0.02), f"{got:.4g} vs {published:.4g}"
    # A Llama-style count of MLA (h = dim = 128 heads x 56) would give about a third of that
    # attention term: the widths must be MLA's (128 heads x 192 for q.k, x 128 for v).
    assert published_attention > 2.5 * 12 * 61 * 7168 * seq
