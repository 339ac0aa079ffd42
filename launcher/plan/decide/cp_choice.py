"""Which context-parallel implementation serves parallel.cp > 1 (backend.cp_impl), and why.

- ``allgather``: K/V (MLA: the latent and the shared RoPE key) all-gathered per layer, their
  gradients reduce-scattered; attention under one explicit mask, so it runs on every device and
  takes document masks and per-document positions. Costs: the whole sequence's K/V per layer on
  every rank (saved for backward), exposed all-gather / reduce-scatter per layer, and under MLA
  cp times the wkv_b up-projection (launcher/plan/estimate/perf.py, memory.py).
- ``ring``: torch's ring attention (CUDA, causal only); K/V stay at s/cp per rank, passed
  around the ring while attention computes.

``auto`` picks ring where it can run (CUDA causal attention: it holds the least K/V and its
passes overlap attention, and it is what the published long-context runs used), all-gather
wherever ring cannot (the CPU; document masking or data.reset_positions; multi-token prediction,
whose shifted tokens and targets the engine cuts from whole rows with the all-gather slice). Pure
Python.
"""

from __future__ import annotations

from typing import Tuple

CP_IMPLS = ("auto", "allgather", "ring")


def choose_cp_impl(requested: str, cp: int, device: str, document_masking: bool, mtp: bool = False) -> Tuple[str, str]:
    """(implementation, why): "off" for cp=1, else "allgather" or "ring" (``requested`` when
    not auto; a ring that cannot run is refused by cp_impl_problems)."""
    if cp <= 1:
        return "off", "parallel.cp=1"
    if requested != "auto":
        return requested, f"backend.cp_impl={requested}"
    if device == "cpu":
        return "allgather", "auto: ring attention has no CPU kernel"
    if document_masking:
        return "allgather", "auto: ring attention takes no document mask (data.document_masking / reset_positions)"
    if mtp:
        return "allgather", ("auto: multi-token prediction (model.mtp_layers) takes its shifted tokens and targets "
                             "from whole rows, cut with the all-gather slice")
    return "ring", ("auto: causal attention on GPUs, ring keeps K/V at seq_len/cp per rank and overlaps its "
                    "passes with attention (backend.cp_impl=allgather gathers the whole sequence's K/V)")


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
