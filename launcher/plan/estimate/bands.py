"""Error bands: how far the planner's time and memory have been from measurements, by layout kind.

Pure Python. Each band is the range of predicted / measured ratios over the accuracy rows of one
kind of layout (bench/reference/published.csv and measured.csv, planned by
bench/planner_accuracy.py, which prints this table with --bands; tests/test_plan_accuracy.py
asserts the table below equals what the rows give, so it cannot drift from them). A prediction
P with ratios in [lo, hi] means the measured value was between P / hi and P / lo.

Step time: the ratio is predicted tokens/s over measured (a ratio below 1: the planner is
pessimistic, the run was faster). Memory: predicted over measured allocator peak.

Context parallel is banded from torchtitan's long-context rows (Tables 2 and 6, 32K-256K) and
mixture of experts from torchtitan's DeepSeek-V3 on 512 H100s (time and memory) and our own
one-layer Mixtral on one H100 (time), plus, for memory, the DeepEP run of that DeepSeek-V3.
A kind's time band comes from its held rows when it has any (bench/planner_accuracy.py's
derive_bands): a row approximated because the published run had a speed feature the runtime lacks
(AsyncTP, DeepEP, Megatron-Core's kernels and dispatcher) measures another runtime's speed (the
Megatron-Bridge MoE rows are 0.26-1.07 of it); a kind known only from approximated rows (3d) is
banded by them, and memory by every row. A kind (or a kind's figure) with no measured row gets
UNMEASURED_WIDENING of the widest band of any kind for that figure, labelled unmeasured in the
plan, until rows of it exist; a band from rows that agree closely is widened to MIN_HALF_WIDTH
either side of its middle.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

# kind -> {"time": (lo, hi), "memory": (lo, hi), "rows": number of accuracy rows behind it}
BANDS: Dict[str, Dict[str, Any]] = {
    "single_gpu": {"time": (0.99, 1.05), "memory": (0.98, 1.02), "rows": 12},
    "fsdp": {"time": (0.84, 0.95), "memory": (0.96, 1.03), "rows": 14},
    "2d": {"time": (0.82, 0.82), "memory": (0.91, 0.91), "rows": 2},
    "3d": {"time": (0.8, 0.81), "memory": (0.77, 0.88), "rows": 6},
    "cp": {"time": (0.85, 1.14), "memory": (0.75, 0.99), "rows": 9},
    "moe": {"time": (0.98, 1.27), "memory": (0.98, 1.04), "rows": 6},
}
KINDS = ("single_gpu", "fsdp", "2d", "3d", "cp", "moe")
# A kind without rows: the union of the measured bands, each side pushed 25 % further out.
UNMEASURED_WIDENING = 0.25
# A band narrower than this around its middle (one row, or rows that agree) is widened to it:
# one agreeing row says little about the next layout of its kind.
MIN_HALF_WIDTH = 0.05


def layout_kind(layout: Any, n_experts: int) -> str:
    """The accuracy kind of a layout: moe > cp > 3d (pipeline) > 2d (tensor parallel) > fsdp > single_gpu."""
    if n_experts > 0:
        return "moe"
    if layout.mesh.cp > 1:
        return "cp"
    if layout.mesh.pp > 1:
        return "3d"
    if layout.mesh.tp > 1:
        return "2d"
    return "single_gpu" if layout.mesh.world_size == 1 else "fsdp"


def ratio_band(kind: str, figure: str, bands: Dict[str, Dict[str, Any]] = BANDS) -> Tuple[float, float, bool]:
    """(lo, hi, measured) predicted/measured ratios for `figure` ("time" or "memory") of `kind`
    (`bands`: BANDS, or another table of the same shape)."""
    if figure in bands.get(kind, {}):
        lo, hi = bands[kind][figure]
        mid = (lo + hi) / 2
        return min(lo, mid - MIN_HALF_WIDTH), max(hi, mid + MIN_HALF_WIDTH), True
    measured = [b[figure] for b in bands.values() if figure in b]
    lo = min(b[0] for b in measured)
    hi = max(b[1] for b in measured)
    return lo * (1 - UNMEASURED_WIDENING), hi * (1 + UNMEASURED_WIDENING), False


def memory_range(total: float, reserved: float, kind: str) -> Tuple[float, float]:
    """The peak-memory range for a predicted total: the band applies to the allocator's share
    (total minus the fixed reserve outside it, hardware.reserved_gb), as the rows measure it."""
    low, high = value_range(total - reserved, kind, "memory")
    return low + reserved, high + reserved


def memory_at_risk(total_range: Sequence[float], capacity: float) -> bool:
    """The upper end of a peak-memory range exceeds the GPU (hardware.memory_gb, in bytes): the
    point estimate may fit, but layouts of this kind have peaked that much above their plan."""
    return total_range[1] > capacity


def band_summary(kind: str) -> Dict[str, Any]:
    """plan.json's `band`: the kind, whether rows of it were measured (`measured`: its step time;
    `memory_measured`: its memory, which a kind's rows may lack), and how many."""
    return {"kind": kind, "measured": ratio_band(kind, "time")[2], "memory_measured": ratio_band(kind, "memory")[2],
            "rows": BANDS.get(kind, {}).get("rows", 0),
            "time_ratio": list(ratio_band(kind, "time")[:2]), "memory_ratio": list(ratio_band(kind, "memory")[:2])}


def value_range(predicted: float, kind: str, figure: str) -> Tuple[float, float]:
    """The range the measured value fell in for predictions of this kind: (P / hi, P / lo).

    For step time the ratio is of tokens/s, so the step time range is (P * lo, P * hi)."""
    lo, hi, _ = ratio_band(kind, figure)
    if figure == "time":
        return predicted * lo, predicted * hi
    return predicted / hi, predicted / lo
