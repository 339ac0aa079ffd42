"""Which context-parallel implementation serves parallel.cp > 1 (backend.cp_impl), and why.

- ``allgather``: K/V (MLA: the latent and the shared RoPE key) all-gathered per layer, their
  gradients reduce-scattered; attention under one explicit mask, so it runs on every device and
  takes document masks and per-document positions. Costs: the whole sequence's K/V per layer on
  every rank (saved for backward), exposed all-gather / reduce-scatter per layer, and under MLA
  cp times the wkv_b up-projection (launcher/plan/estimate/perf.py, memory.py).
- ``ring``: torch's ring attention (CUDA, causal only); K/V stay at s/cp per rank, passed
  around the ring while attention computes (repeated to every query head: it takes no GQA).

``auto`` picks by memory: all-gather wherever the planner's memory of the layout with it (the
gathered K/V of every saved layer included, launcher/plan/estimate/memory.py) fits
hardware.memory_gb; ring only where all-gather does not fit, ring can run (CUDA, plain causal
attention) and needs less. Where ring cannot run (the CPU, where hardware.memory_gb is not the
limit; document masking or data.reset_positions; multi-token prediction, whose shifted tokens and
targets the engine cuts from whole rows with the all-gather slice) auto is all-gather whatever its memory, and a
layout that does not fit is the plan's usual "DOES NOT FIT" verdict (a warning, as for any other
cause), its reason saying that the gathered K/V do not fit. The memory is estimated once per
implementation by the caller's layouts (resolve.py, the search); this module decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from launcher.plan.estimate.cp_allgather import gathered_bytes_per_token
from launcher.plan.estimate.figures import capacity_bytes, reserved_bytes
from launcher.plan.estimate.memory import GiB, estimate_memory, most_loaded
from launcher.plan.estimate.params import ModelShape

CP_IMPLS = ("auto", "allgather", "ring")


@dataclass(frozen=True)
class CpMemory:
    """What backend.cp_impl=auto weighs: the planner's bytes of the most loaded GPU (reserve
    included) with each implementation, the GPU's capacity, and one layer's gathered K/V."""

    allgather: int
    ring: Optional[int]  # None where ring cannot run (not estimated)
    capacity: int  # hardware.memory_gb
    gathered_per_layer: int  # one micro-batch's whole-sequence K/V (MLA: latent + RoPE key) per layer
    hardware: str
    seq_len: int

    @property
    def allgather_fits(self) -> bool:
        return self.allgather <= self.capacity


def cp_memory(layout_with: Callable[[str], Any], shape: ModelShape, hardware: Any, ring: bool) -> CpMemory:
    """The memory backend.cp_impl=auto decides by: ``layout_with(impl)`` is the layout being
    resolved with that implementation (and the document mask it implies); ``ring``: whether to
    estimate ring too (only where it can run)."""
    reserve = reserved_bytes(hardware)

    def need(impl: str) -> int:
        return int(most_loaded(estimate_memory(shape, layout_with(impl), reserve)).total)

    gathered = layout_with("allgather")
    return CpMemory(
        allgather=need("allgather"),
        ring=need("ring") if ring else None,
        capacity=capacity_bytes(hardware),
        gathered_per_layer=int(gathered.microbatch_tokens * gathered_bytes_per_token(shape, gathered)),
        hardware=str(hardware.name),
        seq_len=int(gathered.batch.seq_len),
    )


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _fit_text(m: CpMemory) -> str:
    """The gathered K/V and the most loaded GPU's total with all-gather against the GPU."""
    verb = "fit" if m.allgather_fits else "do not fit"
    sign = "<=" if m.allgather_fits else ">"
    return (f"the gathered K/V ({_gib(m.gathered_per_layer)} per layer at seq_len {m.seq_len}) {verb}: the most "
            f"loaded GPU needs {_gib(m.allgather)} {sign} hardware.memory_gb={m.capacity / GiB:g} ({m.hardware})")


def choose_cp_impl(requested: str, cp: int, device: str, document_masking: bool,
                   memory: Callable[[bool], CpMemory], mtp: bool = False, pipeline: bool = False) -> Tuple[str, str]:
    """(implementation, why): "off" for cp=1, else "allgather" or "ring" (``requested`` when not
    auto; a ring that cannot run is refused by cp_impl_problems). ``memory(ring)``: the layout's
    CpMemory (estimating ring too when asked), called only where auto runs on GPUs.
    ``pipeline``: parallel.pp > 1 (the schedule takes the all-gather slices only)."""
    if cp <= 1:
        return "off", "parallel.cp=1"
    if requested != "auto":
        return requested, f"backend.cp_impl={requested}"
    if device == "cpu":
        return "allgather", "auto: ring attention has no CPU kernel"
    # Where ring cannot serve this job, auto takes all-gather whatever its memory, saying why.
    ring_cannot = ("auto: ring attention takes no document mask (data.document_masking / reset_positions)"
                   if document_masking else
                   "auto: multi-token prediction (model.mtp_layers) takes its shifted tokens and targets from whole "
                   "rows, cut with the all-gather slice" if mtp else
                   "auto: the pipeline schedule takes the all-gather slices (parallel.pp > 1)" if pipeline else "")
    m = memory(not ring_cannot)  # ring is estimated only where it can run
    if ring_cannot:
        return "allgather", ring_cannot + ("" if m.allgather_fits else f"; {_fit_text(m)}")
    if m.allgather_fits:
        return "allgather", f"auto: {_fit_text(m)}"
    if m.ring is not None and m.ring < m.allgather:
        return "ring", (f"auto: {_fit_text(m)}; ring attention keeps K/V at seq_len/cp per rank "
                        f"({_gib(m.ring)})")
    return "allgather", (f"auto: {_fit_text(m)}, and ring attention (K/V repeated to every query head) would "
                         f"need {_gib(m.ring or 0)}: all-gather, the smaller")


def cp_description(cp: int, impl: str = "", why: str = "") -> str:
    """The native context-parallel implementation string of the plan's backend table."""
    return f"native context parallel (cp={cp}, {impl}: {why})" if impl else f"native context parallel (cp={cp})"


def cp_impl_problems(requested: str, cp: int, device: str, document_masking: bool,
                     mtp: bool = False) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """(reason, fixes) for a backend.cp_impl that cannot serve this job (rules.py reports them)."""
    if requested not in CP_IMPLS:
        return ((f"backend.cp_impl={requested} is not one of {', '.join(CP_IMPLS)}", ("backend.cp_impl=auto",)),)
    if cp <= 1 or requested != "ring":
        return ()
    out = []
    fixes = ("backend.cp_impl=allgather", "backend.cp_impl=auto")
    if device == "cpu":
        out.append((f"backend.cp_impl=ring with parallel.cp={cp} and trainer.device=cpu: torch's ring attention "
                    f"has no CPU kernel", fixes + ("run on GPUs",)))
    if document_masking:
        out.append((f"backend.cp_impl=ring with parallel.cp={cp} and data.document_masking / data.reset_positions: "
                    f"ring attention takes no document mask", fixes))
    if mtp:
        out.append((f"backend.cp_impl=ring with parallel.cp={cp} and model.mtp_layers > 0: multi-token prediction's "
                    f"shifted tokens and targets are cut from whole rows by the all-gather slice only",
                    fixes + ("model.mtp_layers=0",)))
    return tuple(out)
