"""DeepSeek-V3 (and the V2-Lite / Moonlight shape): multi-head latent attention with a decoupled
shared RoPE key and YaRN RoPE scaling, a sigmoid router with e_score_correction_bias (aux-loss-free
balancing), group-limited routing, routed_scaling_factor, shared experts, leading dense blocks.
The model (launcher/models/deepseek_v3/model.py) is the shared decoder with its own attention and
MoE settings. Pure Python: see launcher/models/family.py."""

from launcher.models.family import ModelFamily

FAMILY = ModelFamily(
    name="deepseek_v3",
    hf_model_types=("deepseek_v3",),
    model="launcher.models.deepseek_v3.model:DeepseekV3Transformer",
    tp_plan="launcher.models.deepseek_v3.tp:block_plan",
    hf="launcher.models.deepseek_v3.hf",
    params="launcher.models.deepseek_v3.params",
)
