"""Llama (1, 2, 3.x): the shared decoder of launcher/models/transformer.py, dense or with our
own MoE blocks (experts, shared experts, leading dense blocks). Pure Python: see family.py."""

from launcher.models.family import ModelFamily

FAMILY = ModelFamily(
    name="llama",
    hf_model_types=("llama",),
    model="launcher.models.transformer:Transformer",
    tp_plan="launcher.models.llama.tp:block_plan",
    hf="launcher.models.llama.hf",
    params="launcher.models.llama.params",
)
