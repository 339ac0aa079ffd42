"""PNG plots of a plan: per-GPU memory breakdown and the pipeline schedule.

matplotlib is imported inside `save_plan_plots` (a bare Figure, PNG through Agg) so that importing the planner,
and `action=plan plan.format=json`, stay fast. Drawing costs rank 0 about a second of CPU (most
of it matplotlib's import), so a run dir whose charts were drawn from the same figures (a resumed
or restarted run, a run after `action=plan`) keeps them: CHARTS_KEY holds a digest of every figure
the charts show.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List, Tuple

from launcher.plan.estimate.memory import CATEGORIES, GiB

MEMORY_PNG = "plan_memory.png"
PIPELINE_PNG = "plan_pipeline.png"
CHARTS_KEY = "plan_charts.key"
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
          "other": "#8172B3"}


def schedule_blocks(pp: int, m: int, schedule: str, vpp: int = 1) -> List[List[Tuple[str, int, int, int]]]:
    """Per pipeline rank, the (kind, microbatch, chunk, start slot) of each forward 'F' and backward 'B'.

    A simple time-slot simulation: one slot per chunk forward, two per chunk backward; GPipe runs
    all forwards then all backwards; 1F1B warms up with pp-1-r forwards, then alternates;
    interleaved / zero-bubble schedules are drawn as 1F1B over pp*vpp virtual stages mapped
    back onto their ranks (an illustration of order and bubble, not a cycle-accurate trace).
    """
    stages = pp * max(1, vpp)
    # Orders per virtual stage.
    orders: List[List[Tuple[str, int]]] = []
    for s in range(stages):
        if schedule == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(m, stages - s)
        order = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            order.append(("B", b))
            b += 1
            if f < m:
                order.append(("F", f))
                f += 1
        orders.append(order)
    # Dependencies: F(s, i) after F(s-1, i); B(s, i) after B(s+1, i) and F(s, i).
    done = {}
    free_at = [0] * pp
    pos = [0] * stages
    out: List[List[Tuple[str, int, int, int]]] = [[] for _ in range(pp)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            if pos[s] >= len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            if kind == "F":
                dep = done.get(("F", s - 1, i), 0) if s > 0 else 0
                ready = s == 0 or ("F", s - 1, i) in done
            else:
                ready = ("F", s, i) in done and (s == stages - 1 or ("B", s + 1, i) in done)
                dep = max(done.get(("F", s, i), 0), done.get(("B", s + 1, i), 0))
            if not ready:
                continue
            rank = s % pp
            start = max(free_at[rank], dep)
            length = 1 if kind == "F" else 2
            done[(kind, s, i)] = start + length
            free_at[rank] = start + length
            out[rank].append((kind, i, s // pp, start))
            pos[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:  # cannot happen for these orders; guard against an endless loop
            break
    return out


def save_plan_plots(plan, spec, out_dir) -> List[Path]:
    """Write the memory bar chart and the pipeline schedule chart into out_dir; return the paths."""
    out = Path(out_dir)
    paths = [out / MEMORY_PNG, out / PIPELINE_PNG]
    key = _charts_key(plan, spec)
    try:
        if (out / CHARTS_KEY).read_text() == key and all(p.is_file() for p in paths):
            return paths
    except OSError:
        pass
    # A bare Figure, not pyplot: no display backend is chosen, no global figure registry, and
    # savefig renders PNG with Agg.
    from matplotlib.figure import Figure  # lazy: ~0.8 s to import, only the plan's PNGs need it

    out.mkdir(parents=True, exist_ok=True)
    (out / CHARTS_KEY).unlink(missing_ok=True)
    _memory_plot(Figure, plan, spec, paths[0])
    _pipeline_plot(Figure, plan, paths[1])
    (out / CHARTS_KEY).write_text(key)  # after both PNGs: a crash mid-way draws them again
    return paths


def _charts_key(plan, spec) -> str:
    """A digest of what the charts show: the plan's memory and pipeline figures, the model's and
    the hardware's names."""
    shown = {"memory": plan.memory, "pipeline": plan.pipeline, "model": spec.model.name,
             "hardware": spec.hardware.name}
    return hashlib.sha256(json.dumps(shown, sort_keys=True, default=str).encode()).hexdigest()


def _save(fig, path: Path) -> Path:
    """Lay the figure out once and write it. tight_layout leaves a placeholder layout engine
    behind, which makes savefig draw the whole figure once more before the real draw (hundreds
    of pipeline labels twice); with the engine removed the one draw gives the same picture."""
    fig.tight_layout()
    fig.set_layout_engine(None)  # None (unlike "none") removes the placeholder
    fig.savefig(path, dpi=110)
    return path


def _memory_plot(Figure, plan, spec, path: Path) -> Path:
    per_rank = plan.memory.get("per_pp_rank") or [plan.memory | {"pp_rank": 0}]
    ranks = [r["pp_rank"] for r in per_rank]
    fig = Figure(figsize=(max(5, 0.5 * len(ranks) + 3), 4.5))
    ax = fig.subplots()
    bottom = [0.0] * len(ranks)
    for cat in CATEGORIES:
        vals = [r[cat] / GiB for r in per_rank]
        ax.bar(range(len(ranks)), vals, bottom=bottom, label=cat, color=COLORS[cat])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(ranks)))
    ax.set_xticklabels([str(r) for r in ranks])
    cap = plan.memory["capacity"] / GiB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(len(ranks) - 0.5, cap, f" {spec.hardware.name} {cap:.0f} GiB", va="bottom", ha="right", fontsize=8)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GiB per GPU")
    verdict = "fits" if plan.memory["fits"] else "does NOT fit"
    ax.set_title(f"{spec.model.name}: memory per GPU ({verdict})")
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.92))
    return _save(fig, path)


def _pipeline_plot(Figure, plan, path: Path) -> Path:
    p = plan.pipeline
    pp, vpp = int(p.get("pp", 1)), int(p.get("virtual_stages", 1))
    m = min(int(p.get("microbatches", 1)), 32)  # more than 32 micro-batches are unreadable
    schedule = p.get("schedule", "1f1b")
    blocks = schedule_blocks(pp, m, "gpipe" if schedule == "gpipe" else "1f1b", vpp)
    end = max((start + (1 if k == "F" else 2) for row in blocks for k, _, _, start in row), default=1)
    fig = Figure(figsize=(min(18, 2 + end * 0.18), 1 + 0.45 * pp))
    ax = fig.subplots()
    for rank, row in enumerate(blocks):
        # One bar collection per colour on a rank, not one per block: 405B's 8x2 stages x 16
        # micro-batches are 512 blocks, and a collection each was most of the command's time.
        spans: dict = {}
        for kind, mb, chunk, start in row:
            width = 1 if kind == "F" else 2
            color = ("#4C72B0" if kind == "F" else "#DD8452") if chunk % 2 == 0 else ("#8DA9D6" if kind == "F" else "#F0B88A")
            spans.setdefault(color, []).append((start, width))
            if end <= 200:
                label = ax.text(start + width / 2, pp - 1 - rank, str(mb), ha="center", va="center", fontsize=6)
                label.set_in_layout(False)  # inside its bar: tight_layout need not measure it
        for color, xranges in spans.items():
            ax.broken_barh(xranges, (pp - 1 - rank - 0.4, 0.8), facecolors=color, edgecolor="white")
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"stage {pp - 1 - i}" for i in range(pp)])
    ax.set_xlabel("time (forward = 1 slot, backward = 2)")
    shown = f", first {m} micro-batches" if m < int(p.get("microbatches", 1)) else ""
    ax.set_title(f"pipeline {schedule}, pp={pp}, v={vpp}: bubble {p.get('bubble_fraction', 0.0):.1%}{shown} "
                 f"(blue forward, orange backward)")
    return _save(fig, path)
