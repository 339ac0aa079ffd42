"""Per-step work of the launcher's loop that the bare loop of bench/step_overhead.py does not do.

On torch's fake process group (2 ranks in one process; real FSDP2 sharding and DTensor dispatch):
- gradient clipping costs a fixed number of DTensor dispatches, not one per parameter;
- the stop agreement runs in the background: a check reads the all-reduce the previous check started.
The step time itself is a benchmark result (bench/step_overhead.py), never asserted here.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.config.loader import compose_spec
from launcher.models import build_model
from launcher.parallel.optim import clip_grad_norm


class _DTensorOps(TorchDispatchMode):
    """Counts the ops called on DTensors (each one a trip through DTensor's Python dispatch)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_clip_costs_a_fixed_number_of_dtensor_dispatches(fake_two_ranks):
    from torch.distributed.fsdp import fully_shard

    model = build_model(compose_spec(["+recipe=debug"]).model)
    for block in model.layers.values():
        fully_shard(block, mesh=fake_two_ranks)
    fully_shard(model, mesh=fake_two_ranks)
    model(torch.randint(0, 256, (2, 16))).float().sum().backward()
    params = list(model.parameters())
    assert len(params) > 30
    with _DTensorOps() as seen:
        clip_grad_norm(params, max_norm=1e-6)  # the norm is larger: every gradient is scaled
    assert seen.ops["mul_"] == 0 and seen.ops["linalg_vector_norm"] <= 2, seen.ops
    assert seen.ops["_foreach_mul_"] == 1 and seen.ops["_foreach_norm"] == 1, seen.ops


def test_stop_agreement_is_read_at_the_next_check(fake_two_ranks, tmp_path, monkeypatch):
    from launcher.parallel import phase
    from launcher.runtime.signals import StopWatcher

    monkeypatch.setattr(phase, "_group", dist.group.WORLD)  # the fake group stands in for the gloo phase group

    stop = StopWatcher(tmp_path, torch.device("cpu"))
    assert stop.should_stop() is False
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "stop").touch()  # seen by this check, agreed on in the background
    assert stop.should_stop() is False
    assert stop.should_stop() is True
