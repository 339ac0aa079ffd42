"""Qwen3 dense and Qwen3-MoE: the Llama-style decoder with per-head RMSNorm on q and k before RoPE
(model.qk_norm), a head size of its own (model.head_dim), and for MoE a softmax top-k router over
model.n_experts experts without shared experts, renormalised when model.norm_topk_prob, with dense
blocks where mlp_only_layers / decoder_sparse_step say. Pure Python: see launcher/models/family.py."""

from launcher.models.family import ModelFamily

FAMILY = ModelFamily(
    name="qwen3",
    hf_model_types=("qwen3", "qwen3_moe"),
    model="launcher.models.transformer:Transformer",
    tp_plan="launcher.models.llama.tp:block_plan",
    hf="launcher.models.qwen3.hf",
    params="launcher.models.llama.params",
)
