"""Measured peak memory per category during training steps, to compare with the plan.

    measured = track_step_memory(engine.model_parts, engine.optimizers, lambda: engine.train_step(mbs))
    row = compare_with_plan(measured, plan.memory)   # predicted vs measured, per category

Categories are the planner's (launcher/plan/estimate/memory.py): params, grads, optimizer,
activations, other (buffers, unsharded FSDP copies, collective buffers, temporaries), total.
Each category is reported at its own maximum over the step (what the planner predicts) and
`total` is the peak of the sum (what decides an OOM), with the breakdown at that peak; measured
with torch's MemTracker (FSDPMemTracker for an FSDP2 root): it works on CPU, so the
planner's numbers can be checked without a GPU. On CUDA, torch.cuda.max_memory_allocated
is reported too (`cuda_max_allocated`): it sees every allocation, including ones the
dispatch-level tracker cannot (NCCL, cuBLAS workspaces go through the allocator or not).

The first step runs untracked: AdamW creates its states lazily in the first `step()`, so
the tracked step is a steady-state step with every state already allocated.
"""

from __future__ import annotations

import functools
import gc
import logging
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook

from launcher.plan.estimate.memory import category_maxima
from launcher.observe.state_bytes import torch_optimizers

log = logging.getLogger("launcher")

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")

# MemTracker / FSDPMemTracker reference types -> planner categories.
_CATEGORY_OF = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    # Working copies and temporaries: the planner's "other".
    "Unsharded Param": "other",
    "Unsharded Grad": "other",
    "All Gather": "other",
    "Reduce Scatter": "other",
    "Buffer": "other",
    "Temp": "other",
    "Other": "other",
}


def _as_list(x) -> List[Any]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


@functools.lru_cache(maxsize=None)
def _lean_memtracker_class():
    """torch's MemTracker with a cheaper per-op dispatch that records the same bytes.

    MemTracker's ``__torch_dispatch__`` runs on every op of the tracked step. Two of its parts
    cost more than the bookkeeping they do (a fake llama405b pipeline rank spent about a fifth of
    its time in them): it walks the op's outputs with ``tree_map_only``, which also rebuilds
    the output structure it then drops, and it looks up the active fake mode twice, each time
    through a function that imports two modules and lists the whole mode stack. Here the outputs
    are only iterated (same tensors, same order) and the fake mode is read once per op from
    the dispatcher's FAKE slot (the mode stack is the same before and after the op runs).
    Everything else (reference types, storages, the peak update) is torch's own.
    tests/test_plan_memtrack.py holds both trackers to the same snapshot. Private torch API:
    when its attributes are not as expected, torch's MemTracker is used unchanged. (The
    FSDPMemTracker of a single FSDP2 root keeps torch's dispatch.)"""
    try:
        # lazy: private torch names, tried here so that where one moved torch's own MemTracker is used
        from torch.distributed._tools.mem_tracker import _ModState
        from torch.utils._pytree import tree_iter  # lazy: as above

        wait_tensor = torch.ops._c10d_functional.wait_tensor.default
        probe = MemTracker()
        for name in ("_track", "_update_peak_stats", "_mod_tracker", "_in_opt", "_in_ac"):
            getattr(probe, name)
    except (ImportError, AttributeError):  # pragma: no cover - torch moved a private name
        log.warning("memtrack: torch's MemTracker internals moved; using its own (slower) dispatch")
        return MemTracker

    fake_key = torch._C._TorchDispatchModeKey.FAKE

    def active_fake_mode():
        # torch._guards.active_fake_mode scans the mode stack for the innermost FakeTensorMode.
        # FakeTensorMode is an infrastructure mode: the innermost one entered sits in the
        # stack's FAKE slot, which torch's stack listing ends with, so that slot is the answer.
        return torch._C._get_dispatch_mode(fake_key)

    class LeanMemTracker(MemTracker):
        def __enter__(self):  # noqa: D105
            entered = super().__enter__()
            if not hasattr(self, "_fake_mode_on_entry"):  # pragma: no cover - torch renamed it
                self._fake_mode_on_entry = active_fake_mode()
            return entered

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
            if DTensor in types:  # let DTensor desugar into local ops first, as MemTracker does
                return NotImplemented
            fake = active_fake_mode()
            # A fake wait_tensor returns a new tensor where a real one returns its input.
            res = args[0] if (func is wait_tensor and fake) else func(*args, **(kwargs or {}))
            if fake is self._fake_mode_on_entry:  # not DTensor's nested propagation mode
                if self._in_opt:
                    reftype = _MemRefType.OPT
                elif self._mod_tracker.is_bw and not self._in_ac:
                    reftype = _MemRefType.TEMP
                else:
                    reftype = _MemRefType.ACT
                if isinstance(res, torch.Tensor):
                    self._track(reftype, res)
                else:
                    for leaf in tree_iter(res):
                        if isinstance(leaf, torch.Tensor):
                            self._track(reftype, leaf)
                self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
            return res

    return LeanMemTracker


def _make_tracker(modules: List[nn.Module], optimizers: List[torch.optim.Optimizer]):
    """FSDPMemTracker for one FSDP2 root, else MemTracker with its lean dispatch."""
    if len(modules) == 1 and len(optimizers) <= 1 and isinstance(modules[0], FSDPModule):
        return FSDPMemTracker(modules[0], optimizers[0] if optimizers else None)
    tracker = _lean_memtracker_class()()
    tracker.track_external(*modules, *optimizers)
    _track_master_weights(tracker, modules, optimizers)
    return tracker


def _track_master_weights(tracker, modules: List[nn.Module], optimizers: List[torch.optim.Optimizer]) -> None:
    """DeepSpeed's inner optimizer steps fp32 master copies that are not module parameters:
    count them as optimizer memory (the planner's 12 bytes/param include them)."""
    own = {id(p) for m in modules for p in m.parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            for t in group["params"]:
                if id(t) not in own and hasattr(tracker, "_update_and_maybe_create_winfos"):
                    tracker._update_and_maybe_create_winfos(t, _MemRefType.OPT)


def _categorise(snapshot: Dict[Any, Dict[str, int]]) -> Dict[str, int]:
    """Sum a tracker snapshot ({device: {ref type: bytes}}) into the planner's categories."""
    out = {c: 0 for c in CATEGORIES}
    for per_device in snapshot.values():
        for ref, nbytes in per_device.items():
            if ref == "Total":
                continue
            out[_CATEGORY_OF.get(str(getattr(ref, "value", ref)), "other")] += int(nbytes)
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def _global_peak_update(tracker) -> Callable[[Any], None]:
    """MemTracker's per-op peak update without its per-module part.

    torch's ``_update_peak_stats`` walks every module tracked so far on every op (to keep each
    module's own peak), so a step costs O(ops x modules): quadratic in the layer count, the
    larger part of a fake 70B step's time. Only the global peak is used here (the per-module
    statistics are cleared before each root forward anyway), so only that is kept: the same
    comparison and copy as torch's global part."""
    def update(peak_state) -> None:
        for dev, dev_snap in tracker._curr_mem_snap.items():
            total = dev_snap.get("Total", 0)
            if tracker._peak_mem.get(dev, 0) < total:
                tracker._peak_mem[dev] = total
                # torch deep-copies; the snapshot maps reference types to ints, so a copy is one.
                tracker._peak_mem_snap[dev] = dict(dev_snap)

    return update


def _record_category_maxima(tracker) -> Dict[str, int]:
    """Keep each category's own maximum over the step, not only its share at the total peak.

    The planner predicts each category at its largest (gradients complete, activations of
    every in-flight micro-batch); at the moment of the total peak some of them are not all
    alive (e.g. no gradients yet at the end of the first forward). MemTracker updates its
    peak after every op; this replaces that update (global peak only, see
    _global_peak_update) and records each category's maximum. Private torch API: if it moves, only the at-peak breakdown is reported.
    """
    maxima: Dict[str, int] = {}
    original = getattr(tracker, "_update_peak_stats", None)
    current = getattr(tracker, "_curr_mem_snap", None)
    if original is None or current is None:
        return maxima
    peak_update = (_global_peak_update(tracker)
                   if all(hasattr(tracker, a) for a in ("_peak_mem", "_peak_mem_snap")) else original)
    category_of: Dict[Any, str] = {}  # reference type -> category, looked up once per type

    def update(peak_state):
        peak_update(peak_state)
        sums: Dict[str, int] = {}
        for per_device in tracker._curr_mem_snap.values():
            for ref, nbytes in per_device.items():
                cat = category_of.get(ref)
                if cat is None:
                    cat = category_of[ref] = ("" if ref == "Total" else
                                              _CATEGORY_OF.get(str(getattr(ref, "value", ref)), "other"))
                if cat:
                    sums[cat] = sums.get(cat, 0) + nbytes
        for cat, v in sums.items():
            if v > maxima.get(cat, 0):
                maxima[cat] = v

    tracker._update_peak_stats = update
    return maxima


def _allow_repeated_root_forward(tracker, mods: List[nn.Module]):
    """MemTracker and FSDPMemTracker refuse a second forward of a root module in one tracked
    region (gradient accumulation and pipeline schedules run several). Their per-module
    statistics are not used here, only the peaks, so they are cleared before each root
    forward. A global pre-hook runs before the module's own hooks (FSDP's included)."""
    del mods  # the outermost module called may be a wrapper (DeepSpeedEngine, replicate)
    parents = getattr(getattr(tracker, "_mod_tracker", None), "parents", None)
    if parents is None:
        return None

    def hook(module, args):
        top_level = tracker._mod_tracker.parents == {"Global"}
        if top_level and module in tracker.memory_tracking:
            tracker.reset_mod_stats()

    # Looped pipeline schedules (interleaved 1F1B, zero bubble) start a chunk's forward while
    # another chunk's backward is pending: that backward's modules lost their (unused) stats
    # in the reset above, so their backward hooks skip instead of raising KeyError.
    for name in ("_pre_bw_hook", "_post_bw_hook"):
        original = getattr(tracker, name)

        def tolerant(module, args, _original=original):
            if module is not None and module not in tracker.memory_tracking:
                return None
            return _original(module, args)

        setattr(tracker, name, tolerant)
    return register_module_forward_pre_hook(hook)


class _NoHook:
    """The handle of a gradient hook that was not registered."""

    def remove(self) -> None:
        pass


@contextmanager
def _module_grad_hooks_skip_leaves(tracker) -> Iterator[None]:
    """While tracking, torch's ModTracker hooks no leaf tensor for a module's backward.

    ModTracker (inside MemTracker) marks a module's backward as done with a gradient hook on
    its inputs, which asks the autograd engine, for each of them, whether the running backward
    will reach it. The engine refuses that question for a leaf tensor inside
    ``torch.autograd.grad`` ("A leaf node was passed to _will_engine_execute_node ..."), and the
    zero-bubble pipeline schedules (zero_bubble, zbv) compute a stage's input gradients with
    ``autograd.grad``, where the stage's input (a receive buffer) is a leaf: every tracked step
    of them failed, real or fake. Here leaves are left out of those hooks; a module whose inputs
    are all leaves is marked done when the backward ends, the way ModTracker already treats a
    module whose inputs need no gradient. Only ModTracker's module nesting moves; no tensor is
    counted differently (the per-module statistics are not used here)."""
    original = getattr(mod_tracker, "register_multi_grad_hook", None)
    at_backward_end = getattr(getattr(tracker, "_mod_tracker", None), "_post_bw_callbacks_to_enqueue", None)
    if original is None or at_backward_end is None:  # pragma: no cover - torch changed ModTracker
        yield
        return

    def register(tensors, fn, *args, **kwargs):
        if kwargs.get("mode", "all") != "all":  # keyword-only in torch's signature
            # Only the "all" mode asks the engine about each tensor; "any" (ModTracker's
            # output hooks) hooks each tensor on its own, leaves included.
            return original(tensors, fn, *args, **kwargs)
        kept = [t for t in tensors if t.grad_fn is not None]
        if kept:
            return original(kept, fn, *args, **kwargs)
        at_backward_end.append(fn)
        return _NoHook()

    mod_tracker.register_multi_grad_hook = register
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while the block runs, with a collection before.

    Some tensors of a step live in reference cycles and are freed only when the collector runs
    (seen with torch's zero-bubble pipeline schedules, found by tracing the fake and the real
    step op by op: docs/notes/2026-11-rehearsal-findings.md). It runs after a count of Python object
    allocations, which differs between fake and real tensors, so the tracked peak moved with it
    (debug model, pp 2 zero_bubble rank 0: a collection freed 36,864 B of activations in the
    fake step's first backward, which the real step kept until a collection in its next
    forward). Paused, the tracked steps hold such tensors until they end: the figure is the same
    for fake and real tensors and the upper bound over collection timings. The pause is
    process-wide (other threads' cyclic garbage waits too), so a tracked step may peak above an
    ordinary one by what such cycles hold (llama405b rank 0: 459 MB host RSS paused, 431 MB not)."""
    was_enabled = gc.isenabled()
    gc.collect()  # the warm-up steps' cyclic garbage is not the tracked step's
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


def track_step_memory(
    modules: Union[nn.Module, Sequence[nn.Module]],
    optimizers: Union[Any, Sequence[Any], None],
    run_one_step: Callable[[], Any],
    *,
    warmup_steps: int = 1,
    tracked_steps: int = 1,
    on_enter: Optional[Callable[[Any], None]] = None,
) -> Dict[str, int]:
    """Run `warmup_steps` untracked and `tracked_steps` tracked steps; return peak bytes per category.

    modules: the model, or the model parts of this rank (pipeline stages); optimizers: one or
    several (torch optimizers, or wrappers with a torch `.optimizer`); run_one_step: runs one
    complete optimizer step (forward, backward, step, zero_grad) on this rank.
    Returns bytes: {params, grads, optimizer, activations, other} each at its own maximum during
    the tracked steps, `total` = the peak of their sum, `at_peak_<category>` = the breakdown at
    that peak, plus `cuda_max_allocated` when the model is on a GPU. Collective on multi-rank runs when
    run_one_step is (every rank must call it). on_enter(tracker), if given, runs once the tracker is
    entered, before the tracked steps (to register tensors that persist across steps).
    """
    mods = _as_list(modules)
    opts = torch_optimizers(_as_list(optimizers))
    for _ in range(max(0, warmup_steps)):
        run_one_step()
    on_cuda = any(p.is_cuda for m in mods for p in m.parameters())
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = _make_tracker(mods, opts)
    maxima = _record_category_maxima(tracker)
    handle = _allow_repeated_root_forward(tracker, mods)
    try:
        with _cyclic_gc_paused(), _module_grad_hooks_skip_leaves(tracker), tracker:
            if on_enter is not None:
                on_enter(tracker)
            for _ in range(max(1, tracked_steps)):
                run_one_step()
    finally:
        if handle is not None:
            handle.remove()
    at_peak = _categorise(tracker.get_tracker_snapshot("peak"))
    after = _categorise(tracker.get_tracker_snapshot("current"))
    result = {c: max(maxima.get(c, 0), at_peak[c]) for c in CATEGORIES}
    # Optimizer: the persistent states (after the step); the step's own temporaries are
    # reported apart, they are freed before the next forward.
    result["optimizer_step_peak"] = result["optimizer"]
    result["optimizer"] = after["optimizer"]
    result["total"] = at_peak["total"]
    result.update({f"at_peak_{c}": at_peak[c] for c in CATEGORIES})
    if on_cuda:
        torch.cuda.synchronize()
        result["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated())
    return result


def compare_with_plan(measured: Dict[str, int], plan_memory: Dict[str, Any], device: str = "cpu") -> Dict[str, Any]:
    """Predicted vs measured per category with the relative error, for metrics.jsonl and W&B.

    On CPU the planner's CUDA-only reserve (context, NCCL) is left out of the prediction.
    Keys: mem_<category>_predicted, mem_<category>_measured, mem_<category>_error (relative,
    (measured - predicted) / predicted; absent when nothing was predicted).
    """
    detail = plan_memory.get("detail", {})
    reserved = 0 if device == "cuda" else int(detail.get("reserved", 0))
    # The planner's allocator fragmentation is reserved-but-unallocated memory: MemTracker and
    # max_memory_allocated count allocations, so it is left out on every device.
    reserved += int(detail.get("allocator_fragmentation", 0))
    row: Dict[str, Any] = {}
    # Each measured category is at its own maximum, so the plan's are too (category_maxima).
    maxima = category_maxima(plan_memory)
    for cat in CATEGORIES + ("total",):
        predicted = maxima.get(cat, int(plan_memory.get(cat, 0)))
        if cat in ("other", "total"):
            predicted -= reserved
        got = int(measured.get(cat, 0))
        row[f"mem_{cat}_predicted"] = predicted
        row[f"mem_{cat}_measured"] = got
        if predicted > 0:
            row[f"mem_{cat}_error"] = (got - predicted) / predicted
    # MemTracker attributes a recomputed block (activation checkpointing) sometimes to
    # activations, sometimes to temporaries: their sum is the robust comparison.
    pred = row["mem_activations_predicted"] + row["mem_other_predicted"]
    got = row["mem_activations_measured"] + row["mem_other_measured"]
    row["mem_activations_other_predicted"] = pred
    row["mem_activations_other_measured"] = got
    if pred > 0:
        row["mem_activations_other_error"] = (got - pred) / pred
    if "cuda_max_allocated" in measured:
        row["mem_cuda_max_allocated"] = measured["cuda_max_allocated"]
    return row


def process_peak_rss_bytes() -> Optional[int]:
    """Peak resident set of this process (VmHWM), the whole-process cross-check on CPU."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
