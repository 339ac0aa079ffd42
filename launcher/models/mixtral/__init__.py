"""Mixtral: the Llama decoder with every block a top-k MoE (softmax router, renormalised top-k,
no shared experts). Same model, plan and formulas as llama; Mixtral's Hugging Face names
(`block_sparse_moe`) are in launcher/models/llama/hf.py, which reads and writes both."""

from launcher.models.family import ModelFamily

FAMILY = ModelFamily(
    name="mixtral",
    hf_model_types=("mixtral",),
    model="launcher.models.transformer:Transformer",
    tp_plan="launcher.models.llama.tp:block_plan",
    hf="launcher.models.llama.hf",
    params="launcher.models.llama.params",
)
