"""Time and money to a token budget: steps, wall time, GPU-hours and cost, with their ranges.

Pure Python, from the plan's step time and its error band (launcher/plan/estimate/bands.py). The wall
time counts the training steps and in-loop evaluation (eval.*: launcher/plan/estimate/eval_time.py):
start-up, checkpoint saves, validation and restarts come on top (the checkpoint section gives the
save time; `checkpoint.async_save` hides most of it).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple


def budget(steps: int, tokens_per_step: int, step_s: float, step_s_range: Tuple[float, float],
           world_size: int, usd_per_gpu_hour: Optional[float], eval_s: float = 0.0) -> Dict[str, Any]:
    """plan.json's `budget`: tokens, steps, wall_s, wall_s_range, gpu_hours, gpu_hours_range,
    usd, usd_range (None without hardware.usd_per_gpu_hour), usd_per_gpu_hour and eval_s (the
    run's evaluation seconds, inside wall_s; its range scales with the step time's)."""
    wall = steps * step_s + eval_s
    scale = [r / step_s if step_s > 0 else 1.0 for r in step_s_range]
    wall_range = (steps * step_s_range[0] + eval_s * scale[0], steps * step_s_range[1] + eval_s * scale[1])
    hours = lambda seconds: seconds * world_size / 3600.0  # noqa: E731
    gpu_hours, gpu_hours_range = hours(wall), (hours(wall_range[0]), hours(wall_range[1]))
    price = usd_per_gpu_hour
    return {
        "tokens": steps * tokens_per_step,
        "steps": steps,
        "wall_s": wall,
        "wall_s_range": list(wall_range),
        "gpu_hours": gpu_hours,
        "gpu_hours_range": list(gpu_hours_range),
        "usd_per_gpu_hour": price,
        "usd": None if price is None else gpu_hours * price,
        "usd_range": None if price is None else [gpu_hours_range[0] * price, gpu_hours_range[1] * price],
        "eval_s": eval_s,
    }
