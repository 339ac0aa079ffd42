"""One rank's real step (`rehearse.tensors=real`): real tensors on the local device, fake process group.

    report = rehearse_real_rank(model_cfg, optim_cfg, layout, options, rank, device="cuda")

The rank joins torch's fake process group of the layout's world size as rank R, like the fake
rehearsal (launcher/rehearse/rank.py), but its engine is built with real tensors on `device`:
collectives return at once and send nothing, so the values they leave are garbage while the
shapes, dtypes and kernels are the real rank's. That is the planner's compute model measured at
the exact local shapes of the full layout on one device. The step is the rehearsal's own
(launcher/rehearse/step.py build_rank_step: MoE routing balanced, since an all-to-all on the fake group returns
garbage split sizes; at most 2 micro-batches without a pipeline; a pipeline's smallest
equivalent count), run `warmup_steps` times untimed, then `timed_steps` times with each part
timed (the device synchronised at every boundary: nothing overlaps on a fake group anyway):
`forward`, `backward` and `optimizer` (a pipeline schedule interleaves forwards and backwards:
`forward_backward`). Then one step tracked by MemTracker (launcher/observe/memtrack.py) for
the categories (params, grads, optimizer, activations, peak), as the fake rehearsal reports.

Memory: on a GPU, `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the timed
steps (the steady state: after the warm-up created the optimizer states and the allocator's
pools); on a CPU there is no allocator to ask, so the peak reported is MemTracker's (the
tensors' bytes at the step's peak), said in `memory_source`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from launcher.engines import build_engine
from launcher.observe.run_score import environment
from launcher.observe.state_bytes import StateBytesProbe
from launcher.rehearse.step import build_rank_step, rank_report, track_rank_step

MEMORY_SOURCE = {
    "cuda": "torch.cuda.max_memory_allocated and max_memory_reserved over the timed steps",
    "cpu": "MemTracker's peak of one tracked step (tensor bytes; a CPU has no caching allocator to ask, "
           "so reserved is not measured)",
}


class PhaseTimer:
    """Wall seconds per named part of a step, summed over the steps run while `on`; the device
    is synchronised before and after each part so that a part's kernels are counted in it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on = False
        self.seconds: Dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self.on:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _join_fake_group(rank: int, world: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # The fake backend registers for cpu and cuda: collectives complete at once, nothing is sent.
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def rehearse_real_rank(model_cfg, optim_cfg, layout, options, rank: int, *, device: str = "cpu",
                       warmup_steps: int = 1, timed_steps: int = 3, microbatches: int = 2,
                       track: bool = True) -> Dict[str, Any]:
    """Build rank `rank`'s engine with real tensors on `device` against a fake process group of
    layout.mesh.world_size ranks, run its step (warm-up, timed, one tracked) and return the
    rehearsal's rank report ({rank, coords, params_numel, memory, error: None, notes}) with
    `real`: {device, gpu, microbatches_run, layout_microbatches, warmup_steps, timed_steps,
    time_s: {forward, backward | forward_backward, optimizer} (means per step of the micro-batches
    run), compute_s (forward + backward scaled to the layout's micro-batches), peak_allocated,
    peak_reserved (None off CUDA), memory_source}. track=False (rehearse.activations=false) skips the
    MemTracker step: activations and peak are then None (and on a CPU peak_allocated too).
    Initialises torch.distributed: one call per process."""
    if layout.owners.sharding_backend == "deepspeed":
        raise ValueError("DeepSpeed layouts have no real-tensor rehearsal (DeepSpeed's forward does not run on a "
                         "fake process group). Fix: rehearse.tensors=fake, or backend.sharding=native")
    # The first visible GPU (CUDA_VISIBLE_DEVICES picks it): the one launcher/rehearse/local_device.py checked.
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    _join_fake_group(rank, layout.mesh.world_size, dev)
    engine = build_engine(model_cfg, optim_cfg, layout, dev, options)
    probe = StateBytesProbe(engine.optimizers)
    notes: List[str] = [f"real tensors on {dev.type} against the fake process group: collectives return at once "
                        f"(values garbage, shapes and kernels real)"]
    timer = PhaseTimer(dev)
    step = build_rank_step(engine, layout, model_cfg, notes, microbatches, reduce_pipeline=True, phase=timer)
    for _ in range(warmup_steps):
        step.run()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    timer.on = True
    for _ in range(timed_steps):
        step.run()
    timer.on = False
    peak_allocated: Optional[int] = None
    peak_reserved: Optional[int] = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak_allocated = int(torch.cuda.max_memory_allocated(dev))
        peak_reserved = int(torch.cuda.max_memory_reserved(dev))
    held = probe.result()
    tracked: Dict[str, Optional[int]] = {"activations": None, "peak": None, "unrun_microbatch_bytes": 0}
    if track:
        tracked.update(track_rank_step(engine, layout, step))
    if peak_allocated is None:
        peak_allocated = tracked["peak"]
    elif tracked["unrun_microbatch_bytes"]:
        # The reduced pipeline schedule ran fewer micro-batches: add what the others' buffers hold
        # for the whole step, as the tracked peak does (step.track_rank_step).
        peak_allocated += tracked["unrun_microbatch_bytes"]
        peak_reserved += tracked["unrun_microbatch_bytes"]
        notes.append(f"peak allocated and reserved include {tracked['unrun_microbatch_bytes']} bytes of receive "
                     f"buffers of the micro-batches not run")
    elif step.schedule is not None and step.microbatches < layout.batch.microbatches:
        notes.append(f"peak allocated and reserved are those of {step.microbatches} of the "
                     f"{layout.batch.microbatches} micro-batches (no tracked step to count the others' buffers)")
    time_s = {k: v / timed_steps for k, v in timer.seconds.items()}
    layout_micro = layout.batch.microbatches  # the pipeline's micro-batches too (Layout.pp_microbatches)
    per_micro = (time_s.get("forward", 0.0) + time_s.get("backward", 0.0) + time_s.get("forward_backward", 0.0)) \
        / step.microbatches
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {
        **rank_report(rank, layout, held, tracked, notes),
        "real": {
            "device": dev.type,
            "gpu": gpu,
            "microbatches_run": step.microbatches,
            "layout_microbatches": layout_micro,
            "warmup_steps": warmup_steps,
            "timed_steps": timed_steps,
            "time_s": time_s,
            "compute_s": per_micro * layout_micro,
            "peak_allocated": peak_allocated,
            "peak_reserved": peak_reserved,
            "memory_source": MEMORY_SOURCE[dev.type],
            "environment": environment(),
        },
    }
