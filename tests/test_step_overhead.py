"""Per-step work of the launcher's loop that the bare loop of bench/step_overhead.py does not do.

On torch's fake process group (2 ranks in one process; real FSDP2 sharding and DTensor dispatch):
- gradient clipping costs a fixed number of DTensor dispatches, not one per parameter;
- the stop agreement runs in the background: a check reads the all-reduce the previous check started;
- AdamW uses torch's fused kernel on CUDA (`optim.implementation=auto`): foreach cost 15 % of a
  1B model's H100 step against the bare loop (docs/benchmarks.md).
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
from launcher.engines.optim import clip_grad_norm


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


def test_adamw_is_fused_on_cuda_and_every_implementation_makes_the_same_update():
    from launcher.config.schema import OptimConfig
    from launcher.engines.optim import adamw_kernel_flags, build_adamw

    assert adamw_kernel_flags("auto", "cuda") == {"fused": True}
    assert adamw_kernel_flags("auto", "cpu") == {}  # torch's default: the rehearsal's fake tensors too
    with pytest.raises(ValueError, match="optim.implementation='fast'"):
        adamw_kernel_flags("fast", "cuda")

    def trained(implementation: str) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        opt = build_adamw(model, OptimConfig(lr=1e-2, implementation=implementation))
        want = {"fused": True} if implementation == "fused" else {"foreach": implementation == "foreach"}
        assert {k: opt.defaults[k] for k in want} == want
        for _ in range(3):
            model(torch.randn(5, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return model

    ref = trained("for_loop")
    for implementation in ("foreach", "fused"):  # fused runs on the CPU too (torch >= 2.4)
        for p, q in zip(trained(implementation).parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_unknown_adamw_implementation_is_refused_before_launch():
    from launcher.config.validate import validate

    problems = validate(compose_spec(["+recipe=debug", "optim.implementation=fast"]))
    assert any("optim.implementation='fast'" in p and "Fix: optim.implementation=auto" in p for p in problems), problems


class _KeepsStepStats:
    """The real engine, keeping every StepStats it returns so the test can ask which were read."""

    def __init__(self, engine):
        self.engine, self.stats = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def train_step(self, microbatches):
        self.stats.append(self.engine.train_step(microbatches))
        return self.stats[-1]


def test_the_loop_reads_step_stats_only_at_log_steps_and_logs_the_eager_values(tmp_path):
    """No host sync per step: the Trainer copies a step's loss, grad norm and MoE aux loss to the
    host (StepStats.materialise, one device wait) only at the steps it logs, and what it logs is
    what reading every step at once gives."""
    from launcher.engines import build_engine
    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime import entry
    from launcher.checkpoint.manager import CheckpointManager
    from launcher.runtime.metrics import MetricsLogger
    from launcher.runtime.signals import StopWatcher
    from launcher.runtime.trainer import LoopConfig, Trainer
    from tests.conftest import read_metrics

    spec = compose_spec(["+recipe=debug", "model=debug_moe", "cluster.gpus_per_node=1", "trainer.global_batch_size=2",
                         "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.steps=7", "trainer.log_every=3",
                         "checkpoint.enabled=false", "checkpoint.interval=0", "logging.wandb.mode=disabled",
                         "logging.progress=false"])
    plan = build_plan(spec, check(spec))
    cpu = torch.device("cpu")

    def engine():
        return build_engine(spec.model, spec.optim, plan.layout, cpu, entry.engine_options(spec, tmp_path))

    run_dir = tmp_path / "run"
    batches = entry.build_batches(spec, plan, 0, run_dir)
    lazy = _KeepsStepStats(engine())
    metrics = MetricsLogger(run_dir, enabled=True, wandb_cfg=spec.logging.wandb, config={}, total_steps=7,
                            progress=False)
    cfg = LoopConfig(steps=7, log_every=3, checkpoint_interval=0, checkpoint_enabled=False, save_final=False,
                     tokens_per_step=plan.batch.tokens_per_step, samples_per_step=plan.batch.global_batch_size,
                     world_size=1, mesh=plan.mesh.to_dict())
    checkpoints = CheckpointManager(tmp_path / "ckpt", keep=1, verify_checksums=False, rank=0, world_size=1)
    Trainer(cfg, run_dir=run_dir, rank=0, engine=lazy, batches=batches, checkpoints=checkpoints, metrics=metrics,
            stop=StopWatcher(run_dir, cpu)).fit()
    metrics.close()

    logged = {1, 3, 6, 7}  # the first step, every log_every-th, the last
    assert [st.materialised for st in lazy.stats] == [s in logged for s in range(1, 8)]

    eager = engine()  # same seed, same batches: read at once, every step
    want = {}
    for step in range(1, 8):
        st = eager.train_step(batches.for_step(step))
        want[step] = (st.loss, st.grad_norm, st.extra["moe_aux_loss"])
    rows = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    assert set(rows) == logged
    for step in logged:
        assert (rows[step]["loss"], rows[step]["grad_norm"], rows[step]["moe_aux_loss"]) == want[step], step
    # The steps never logged hold the same numbers when read later (their tensors were kept).
    for step in sorted(set(range(1, 8)) - logged):
        st = lazy.stats[step - 1]
        assert (st.loss, st.grad_norm, st.extra["moe_aux_loss"]) == want[step], step
