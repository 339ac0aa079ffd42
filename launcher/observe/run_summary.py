"""run_summary.json's file name and its scored figure, without torch.

A run's rank 0 writes run_summary.json (launcher/observe/run_score.py); the real-tensor rehearsal
(`rehearse.tensors=real`, launcher/rehearse/driver.py) writes its rehearsal_summary.json with the
same figures on the host, which imports no torch. bench/planner_accuracy.py reads both.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

RUN_SUMMARY_FILE = "run_summary.json"


def figure(measured: Optional[float], predicted: Optional[float], band: Optional[List[float]]) -> Dict[str, Any]:
    """One scored figure: measured, predicted, measured/predicted and whether it fell in the band."""
    if measured is None or not predicted:
        return {"measured": measured, "predicted": predicted, "ratio": None, "in_band": None, "range": band}
    in_band = None if not band else bool(band[0] <= measured <= band[1])
    return {"measured": measured, "predicted": predicted, "ratio": measured / predicted, "in_band": in_band,
            "range": band}
