"""The optimizer of an `OptimConfig`: AdamW alone (optim=adamw, no optim.groups), or Muon with
AdamW (optim=muon, or any optim.groups) - one entry point for both engines."""

from __future__ import annotations

import torch
from torch import nn

from launcher.engines.muon import build_muon_with_adamw
from launcher.engines.optim import adamw_kernel_flags, build_adamw
from launcher.plan.decide.optim_groups import uses_groups


def build_optimizer(module: nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW over `param_groups` (unchanged since before Muon, so its checkpoints load as they
    did), else `MuonWithAdamW` over the groups of launcher/plan/decide/optim_groups.py."""
    if not uses_groups(cfg):
        return build_adamw(module, cfg)
    device_type = next((p.device.type for p in module.parameters()), "cpu")
    return build_muon_with_adamw(module, cfg, adamw_kernel_flags(getattr(cfg, "implementation", "auto"), device_type))
