"""Every trainable parameter of a model, by canonical name and full shape, without torch.

The planner assigns `optim.groups` to parameters by canonical name (launcher/plan/decide/
optim_groups.py) and must do it without building the model. The names are the family's Hugging
Face tensor maps (launcher/models/<family>/hf.py, `TensorMap.ours`: the checkpoint's and the HF
maps' names), corrected for the two ways a map differs from the module tree:
- a map also carries buffers the HF files hold (DeepSeek-V3's router correction bias, moved by
  the balancing rule and held by no optimizer): left out;
- a Mixtral-format map has no place for shared experts (Mixtral has none; our MoE block may):
  added after the block's routed experts, where the MoE module registers them.
tests/test_optim_groups.py checks the list against the module tree the model builds on the meta device.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from launcher.models.family import family_of

# Canonical-name suffixes of tensors the maps hold that are buffers, not parameters.
BUFFER_SUFFIXES = (".moe.e_score_correction_bias",)


def trainable_parameters(model: Any) -> List[Tuple[str, Tuple[int, ...]]]:
    """(canonical name, full shape) of every trainable parameter of ModelConfig `model`, in the
    module's order within each block (the order the optimizer steps them)."""
    out: List[Tuple[str, Tuple[int, ...]]] = []
    names = set()
    maps = family_of(model).hf_module().tensor_maps(model)
    for m in maps:
        if m.ours.endswith(BUFFER_SUFFIXES):
            continue
        out.append((m.ours, tuple(int(d) for d in m.shape)))
        names.add(m.ours)
    # The module registers the multi-token-prediction depths after the final norm and the head;
    # the HF files put them before (they are layers n_layers.. there).
    out.sort(key=lambda item: item[0].startswith("mtp."))
    shared = int(getattr(model, "n_shared_experts", 0) or 0)
    if not shared:
        return out
    hidden = (int(getattr(model, "moe_ffn_dim", 0) or 0) or int(model.ffn_dim)) * shared
    dim = int(model.dim)
    full: List[Tuple[str, Tuple[int, ...]]] = []
    for name, shape in out:
        full.append((name, shape))
        if name.endswith(".moe.experts.w3"):  # the block's last routed-expert weight
            prefix = name[: -len("experts.w3")] + "shared_experts."
            if prefix + "w1.weight" not in names:
                full += [(prefix + "w1.weight", (hidden, dim)), (prefix + "w2.weight", (dim, hidden)),
                         (prefix + "w3.weight", (hidden, dim))]
    return full
