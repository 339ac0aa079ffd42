"""Bytes of model states one rank holds: parameters, gradients, optimizer states.

    probe = StateBytesProbe(engine.optimizers)   # before the first step
    ... engine.train_step(...) ...
    probe.result()   # {"params_numel", "params", "grads", "optimizer"}

The same probe measures a real run (tests/parallel_harness) and the rehearsal
(launcher/rehearse/rank.py), so the two are compared on one definition:

- params: the local part (``DTensor.to_local()``) of every distinct tensor the optimizers
  step, i.e. the shards FSDP2 keeps between steps (the unsharded working copies are the
  planner's "other");
- grads: the local part of every gradient present when an optimizer step starts (after the
  last backward of the step, before ``zero_grad``);
- optimizer: the state tensors after the step (AdamW's exp_avg and exp_avg_sq), without
  the 0-dim ``step`` counters (4 bytes per tensor, which the planner leaves out).
DeepSpeed's wrappers are unwrapped once (``.optimizer``), like the memory tracker does.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List

import torch

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def torch_optimizers(optimizers: Iterable[Any]) -> List[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizers` (a wrapper with ``.optimizer``, e.g. DeepSpeed's
    ZeRO optimizer, is unwrapped once); the probe and the memory tracker both measure these."""
    out = []
    for opt in optimizers:
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
        else:
            log.warning("cannot measure an optimizer of type %s; its states count as untracked", type(opt).__name__)
    return out


def _stepped_params(optimizers: List[torch.optim.Optimizer]) -> List[torch.Tensor]:
    seen, params = set(), []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    return params


class StateBytesProbe:
    """Hooks on the optimizers' step that record the bytes of gradients (before the step) and
    optimizer states (after it); the latest step's values are kept."""

    def __init__(self, optimizers: Iterable[Any]):
        self.optimizers = torch_optimizers(optimizers)
        self.grads = 0
        self.optimizer = 0
        self._pending = 0
        self._handles = []
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(self._before_step))
            self._handles.append(opt.register_step_post_hook(self._after_step))

    def _before_step(self, opt, args, kwargs) -> None:
        if opt is self.optimizers[0]:
            self._pending = 0
        self._pending += sum(_nbytes(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None)
        self.grads = self._pending

    def _after_step(self, opt, args, kwargs) -> None:
        self.optimizer = self.optimizer_state_bytes()

    def optimizer_state_bytes(self) -> int:
        total = 0
        for opt in self.optimizers:
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        total += _nbytes(value)
        return total

    def result(self) -> Dict[str, int]:
        params = _stepped_params(self.optimizers)
        return {
            "params_numel": sum(_local(p).numel() for p in params),
            "params": sum(_nbytes(p) for p in params),
            "grads": int(self.grads),
            "optimizer": int(self.optimizer),
        }

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
