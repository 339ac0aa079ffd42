"""`action=rehearse`: rehearse the chosen ranks, each in its own process, and compare with the plan.

    result = rehearse(spec, plan, run_dir)   # writes run_dir/rehearsal.json, returns the same dict
    print(render_rehearsal(result))

The run dir holds config.yaml and plan.json as for a real run; every chosen rank runs
launcher/rehearse/rank.py's main in a process of its own, `rehearse.workers` at a time, so a
rank whose build aborts in C++ (or is killed) is that rank's reported problem. Each such
process is forked from one server process that imported rank.py (torch, the engines) once
(multiprocessing's forkserver): a rank starts in a fraction of a second instead of spending
about 3 s importing torch, and starts from a process that has built nothing, as a fresh
interpreter would. rehearsal.json:

    {"world_size": N, "ranks": [{"rank", "coords", "params_numel",
       "memory": {"params", "grads", "optimizer", "activations", "peak"},
       "predicted": {...the plan's numbers for that rank..., "relative_error": {...}},
       "error": null | {"type", "message", "module", "function", "fix"},
       "real": {...}   # rehearse.tensors=real only: timings and peaks beside the plan's
     }], "ok": bool, "real": {"device", "gpu", "hardware", "gpu_is_hardware", "label"}}

With `rehearse.tensors=real` (launcher/rehearse/real.py) the ranks run one at a time with real
tensors on `rehearse.device`, after the checks of launcher/rehearse/local_device.py (exit 2
before anything is built), and the rehearsal also writes rehearsal_summary.json: the figures of
a run's run_summary.json (tokens/s per GPU on the compute basis, peak memory) that
bench/planner_accuracy.py --fit reads like a run's.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from launcher.config.errors import ConfigError
from launcher.config.schema import JobConfig
from launcher.config.validate import rehearse_ranks_value
from launcher.observe.rehearsal_table import CATEGORIES, COLUMN_MEANINGS, GAP_THRESHOLD, known_gaps, planned_figure
from launcher.plan.estimate.memory import GiB
from launcher.plan.degrees import MESH_DIM_NAMES
from launcher.plan.estimate.params import model_shape
from launcher.plan.present.plan import Plan
from launcher.rehearse.files import SHARED_STEPS_DIR
from launcher.rehearse.local_device import local_device, local_device_problems
from launcher.rehearse.real_report import REHEARSAL_SUMMARY_FILENAME, real_label, real_row, real_summary
from launcher.rehearse.ranks import (predicted_for_rank, predicted_peaks_for_rank, predicted_time_for_rank,
                                     rank_problems, rehearsal_ranks, relative_errors)

log = logging.getLogger(__name__)

REHEARSAL_FILENAME = "rehearsal.json"
RANK_TIMEOUT_S = 900  # one rank's build and fake step; a llama405b pipeline rank takes about a minute

RANK_MODULE = "launcher.rehearse.rank"


def _rank_env() -> Dict[str, str]:
    """What the rank processes' environment adds to this process's."""
    env = {"PYTHONUNBUFFERED": "1"}
    # One thread: fake tensors compute nothing; real ones on a CPU check the code path (a GPU's
    # kernels use no CPU thread pool), and a busy CPU's spinning thread pools slow it 20-fold.
    for key, value in (("OMP_NUM_THREADS", "1"), ("DS_ACCELERATOR", "cpu")):
        env[key] = os.environ.get(key, value)
    return env


def _rank_context() -> multiprocessing.context.BaseContext:
    """The forkserver context the ranks are forked from, its server started with the rank module
    imported and the ranks' environment (the server's, which its forks inherit; this process's
    own is restored at once: a real launch after the rehearsal must not inherit it).

    The server outlives one rehearsal: the next rehearsal of this process (tests, bench scripts)
    forks from it again instead of paying its start (torch and the engines imported, about 4 s
    of CPU) and its end. stop_rank_server ends it (before a real launch, which needs the memory)."""
    global _server
    ctx = multiprocessing.get_context("forkserver")
    added = _rank_env()
    if _server is not None and _server == (_forkserver_pid(), added):
        return ctx
    stop_rank_server()  # one started by other code of this process has neither the module nor the environment
    ctx.set_forkserver_preload([RANK_MODULE])
    saved = {key: os.environ.get(key) for key in added}
    os.environ.update(added)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _server = (_forkserver_pid(), added)
    return ctx


# (pid, environment added) of the forkserver this module started and may fork ranks from again.
_server: Optional[Tuple[Optional[int], Dict[str, str]]] = None


def _forkserver_pid() -> Optional[int]:
    """The running forkserver's pid (None when none runs). Not public API: without it every
    rehearsal starts its own server, as a fresh process would."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except OSError:
        return None
    return pid


def stop_rank_server() -> None:
    """Stop this process's forkserver, if one runs: once the ranks are done, it holds torch
    imported (about 300 MB), idle for the rest of this process (a real run may follow the
    rehearsal). Its stop is not public API; without it the server still ends with this process."""
    global _server
    _server = None
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def _rank_process(run_dir: str, rank: int, out: str, activations: bool, log_path: str) -> None:
    """A rank process's body: its output goes to its log, its report to `out` (rank.py's main)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # lazy: torch and the engines, in the rank process only (preloaded by its server); the host imports no torch
    from launcher.rehearse.rank import main

    main(["--run-dir", run_dir, "--rank", str(rank), "--out", out] + ([] if activations else ["--no-activations"]))


def _start(ctx: multiprocessing.context.BaseContext, run_dir: Path, rank: int,
           activations: bool) -> Tuple[multiprocessing.process.BaseProcess, Path, Path]:
    work = run_dir / "rehearsal"
    work.mkdir(parents=True, exist_ok=True)
    out, log_path = work / f"rank_{rank}.json", work / f"rank_{rank}.log"
    out.unlink(missing_ok=True)
    proc = ctx.Process(target=_rank_process, args=(str(run_dir), rank, str(out), activations, str(log_path)),
                       name=f"rehearse-rank-{rank}")
    proc.start()
    return proc, out, log_path


def _died(rank: int, code: Optional[int], log_path: Path) -> Dict[str, Any]:
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
    how = "was killed after the time limit" if code is None else (
        f"died with signal {-code}" if code < 0 else f"exited with code {code}")
    return {"rank": rank, "error": {
        "type": "ProcessDied", "module": "", "function": "",
        "message": f"the rehearsal process of rank {rank} {how} without a report"
                   + (f" (last line: {tail[0][:300]})" if tail else "") + f"; log: {log_path}",
        "fix": (f"rehearse.activations=false (the fake steps are the slow part), or fewer ranks at a time "
                f"(rehearse.workers); the limit is {RANK_TIMEOUT_S} s per rank" if code is None else
                "see the rank's log; a C++ abort here would abort the real rank too")}}


def launch_order(ranks: List[int], coordinates: Callable[[int], Dict[str, int]]) -> List[int]:
    """The ranks with every coordinate but the pipeline's at 0 first: a rank whose local shapes
    equal such a rank's (same pipeline rank) then usually finds that rank's fake step done and
    reuses it (launcher/rehearse/rank.py, step_signature) instead of running the same step
    again; one started beside that rank (workers > 1) runs its own, with the same bytes."""
    return sorted(ranks, key=lambda r: (any(v for k, v in coordinates(r).items() if k != "pp"), r))


def run_ranks(run_dir: Path, ranks: List[int], workers: int, activations: bool,
              order: Optional[List[int]] = None) -> List[Dict[str, Any]]:
    """Rehearse `ranks` (started in `order`, default theirs), at most `workers` processes at a time;
    one report per rank, in the order of `ranks`. Fake steps measured by an earlier rehearsal in
    this run dir are dropped first. Fake or real tensors: the run dir's config says (rehearse.tensors)."""
    shutil.rmtree(Path(run_dir) / SHARED_STEPS_DIR, ignore_errors=True)
    return _run_in(_rank_context(), run_dir, ranks, workers, activations, order)


def _run_in(ctx: multiprocessing.context.BaseContext, run_dir: Path, ranks: List[int], workers: int,
            activations: bool, order: Optional[List[int]]) -> List[Dict[str, Any]]:
    pending, running, reports = list(order or ranks), [], {}
    try:
        while pending or running:
            while pending and len(running) < max(1, workers):
                rank = pending.pop(0)
                running.append((rank, time.monotonic(), *_start(ctx, run_dir, rank, activations)))
            time.sleep(0.05)
            for item in list(running):
                rank, started, proc, out, log_path = item
                code = proc.exitcode
                if code is None and time.monotonic() - started > RANK_TIMEOUT_S:
                    proc.kill()
                    proc.join()
                    reports[rank] = _died(rank, None, log_path)
                elif code is None:
                    continue
                elif out.exists():
                    reports[rank] = json.loads(out.read_text())
                else:
                    reports[rank] = _died(rank, code, log_path)
                running.remove(item)
    except BaseException:  # interrupted: leave no rank process behind
        for item in running:
            item[2].kill()
        raise
    return [reports[r] for r in ranks]


def rehearse(spec: JobConfig, plan: Plan, run_dir: Path) -> Dict[str, Any]:
    """Rehearse the ranks `rehearse.ranks` chooses; write and return rehearsal.json's dict.
    The run dir must hold the spec's config.yaml and plan.json (save_spec, plan.save). Raises
    ConfigError when a listed rank is outside the world."""
    lay = plan.layout
    choice = rehearse_ranks_value(spec.rehearse.ranks)
    problems = rank_problems(lay, choice)
    if problems:
        raise ConfigError(problems)
    ranks = rehearsal_ranks(lay, choice)
    real = spec.rehearse.tensors == "real"
    device: Dict[str, Any] = {}
    if real:  # before anything is built: the device exists, is the plan's GPU, and each rank fits it
        device = local_device(spec.rehearse.device)
        problems = local_device_problems(spec, plan, ranks, device)
        if problems:
            raise ConfigError(problems)
    t0 = time.monotonic()
    # Real tensors: one rank at a time (each needs the device's memory, and timings must not share it).
    reports = run_ranks(Path(run_dir), ranks, 1 if real else spec.rehearse.workers, spec.rehearse.activations,
                        order=launch_order(ranks, lay.mesh.coordinates))
    shape = model_shape(spec.model)
    rows = []
    for rep in reports:
        rank = int(rep["rank"])
        predicted = predicted_for_rank(shape, lay, plan.memory, rank)
        memory = rep.get("memory")
        if memory:
            predicted["relative_error"] = relative_errors(memory, predicted)
        row = {
            "rank": rank,
            "coords": {k: lay.mesh.coordinates(rank)[k] for k in MESH_DIM_NAMES},
            "params_numel": rep.get("params_numel"),
            "memory": memory,
            "predicted": predicted,
            "error": rep.get("error"),
        }
        if rep.get("real"):
            row["real"] = real_row(rep["real"], predicted_time_for_rank(shape, lay, spec.hardware, rank),
                                   predicted_peaks_for_rank(lay, plan.memory, rank))
        rows.append(row)
        for note in rep.get("notes", []):
            log.debug("rank %d: %s", rank, note)
    result = {"world_size": lay.mesh.world_size, "ranks": rows, "ok": all(r["error"] is None for r in rows)}
    if real:
        result["real"] = real_label(spec.rehearse.device, device.get("gpu") or "cpu", spec.hardware.name)
        _write_json(Path(run_dir) / REHEARSAL_SUMMARY_FILENAME, real_summary(result, plan, spec.hardware.name))
    _write_json(Path(run_dir) / REHEARSAL_FILENAME, result)
    log.debug("rehearsed %d rank(s) of %d in %.1f s", len(rows), lay.mesh.world_size, time.monotonic() - t0)
    return result


def _write_json(path: Path, content: Dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(content, indent=1))
    tmp.replace(path)


def rehearsal_problems(result: Dict[str, Any], layout) -> List[str]:
    """One line per failed rank: the rank, its mesh coordinates, the layout, the module, a Fix."""
    mesh = layout.mesh.to_dict()
    degrees = " ".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "one rank"
    out = []
    for row in result["ranks"]:
        err = row["error"]
        if err is None:
            continue
        coords = " ".join(f"{k}={row['coords'][k]}" for k in MESH_DIM_NAMES)
        where = f" in {err['module']}" + (f".{err['function']}" if err.get("function") else "") if err.get("module") else ""
        out.append(f"rank {row['rank']} (mesh coords {coords}; layout {degrees}) cannot be built{where}: "
                   f"{err['type']}: {err['message'].rstrip('.')}. Fix: {err['fix'].rstrip('.')}.")
    return out


def fit_problems(result: Dict[str, Any], plan_memory: Dict[str, Any], hardware_name: str) -> List[str]:
    """One line per rehearsed rank that does not fit the GPU: the plan's total for that rank with
    its parameter, gradient and optimizer bytes replaced by the rehearsed ones (activations stay
    the plan's: the rehearsal's are CPU kernels', see docs/planner.md), the CUDA reserve included."""
    capacity = int(plan_memory.get("capacity", 0))
    reserved = int(plan_memory.get("detail", {}).get("reserved", 0))
    out = []
    for row in result["ranks"]:
        mem, pred = row["memory"], row["predicted"]
        if not mem or not capacity:
            continue
        states = sum(mem[k] for k in ("params", "grads", "optimizer"))
        planned_states = sum(pred[k] for k in ("params", "grads", "optimizer"))
        need = pred["peak"] + reserved - planned_states + states
        if need > capacity:
            out.append(f"rank {row['rank']} does not fit: its rehearsed parameters, gradients and optimizer "
                       f"states ({states / GiB:.1f} GiB) with the planned activations and buffers need "
                       f"{need / GiB:.1f} GiB but {hardware_name} has {capacity / GiB:.1f} GiB. Fix: "
                       f"`train ... action=search` lists layouts that fit (more parallel.tp / parallel.pp, "
                       f"parallel.zero_stage=3, activation_checkpointing=full, more nodes).")
    return out


def _size(v: Optional[int]) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1 (GiB at most)."""
    if v is None:
        return "-"
    for unit, scale in (("G", GiB), ("M", 1024**2), ("K", 1024)):
        if v >= scale:
            return f"{v / scale:.2f}{unit}"
    return f"{v}B"


def _cell(got: Optional[int], want: Optional[int], gap: Optional[float], flagged: bool) -> str:
    """`rehearsed/planned gap`, the gap marked `!` when it is over the threshold."""
    text = f"{_size(got)}/{_size(want)}"
    if gap is not None:
        text += f" {gap:+.0%}" + ("!" if flagged else "")
    return text


def render_rehearsal(result: Dict[str, Any]) -> str:
    """The console table: what each column is, per rank the rehearsed bytes next to the plan's
    figure for the same quantity with their gap, then every gap over GAP_THRESHOLD with the
    reason known for it (launcher/observe/rehearsal_table.py); `ok` only when there is none."""
    width = 22
    head = (f"{'rank':>6} {'coords (pp,dpr,dps,cp,tp)':<26} {'param count':>14} "
            + " ".join(f"{k:>{width}}" for k in CATEGORIES))
    lines = [f"rehearsal of {len(result['ranks'])} rank(s) at world size {result['world_size']}: bytes each rank "
             f"holds, rehearsed/planned (the plan's figure for the same quantity) and the gap "
             f"(rehearsed - planned) / planned, `!` over {GAP_THRESHOLD:.0%}; fake tensors on the CPU",
             *(f"  {meaning}" for meaning in COLUMN_MEANINGS), head, "-" * len(head)]
    gaps: Dict[Tuple[str, str], List[Tuple[int, float]]] = {}
    set_apart: Dict[str, int] = {}
    for row in result["ranks"]:
        c = row["coords"]
        coords = ",".join(str(c[k]) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        if row["error"] is not None:
            lines.append(f"{row['rank']:>6} {coords:<26} FAILED in {row['error'].get('module') or '?'}: "
                         f"{row['error']['message'][:120]}")
            continue
        m, p = row["memory"], row["predicted"]
        flagged = {cat: (gap, reason) for cat, gap, reason in known_gaps(row)}
        for cat, (gap, reason) in flagged.items():
            gaps.setdefault((cat, reason), []).append((row["rank"], gap))
        for part, size in p.get("peak_set_apart", {}).items():
            set_apart[part] = max(set_apart.get(part, 0), size)
        errors = p.get("relative_error", {})
        cells = [_cell(m.get(k), planned_figure(p, k), errors.get(k), k in flagged) for k in CATEGORIES]
        lines.append(f"{row['rank']:>6} {coords:<26} {row['params_numel']:>14,} " + " ".join(f"{x:>{width}}" for x in cells))
    if set_apart:
        lines.append("the plan's peak set apart above (the most on a rank): "
                     + ", ".join(f"{k} {_size(v)}" for k, v in set_apart.items()))
    for (cat, reason), where in gaps.items():
        ranks = ", ".join(str(r) for r, _ in where)
        spread = sorted({f"{g:+.0%}" for _, g in where})
        lines.append(f"gap over {GAP_THRESHOLD:.0%}: {cat} on rank(s) {ranks} ({' to '.join([spread[0], spread[-1]][:len(spread)])}): {reason}")
    if result.get("real"):
        lines.extend(render_real(result))
    if not result["ok"]:
        lines.append("FAILED: see the problems below")
    elif gaps:
        lines.append(f"every rank built; the gaps above are over {GAP_THRESHOLD:.0%} (docs/planner.md, \"Rehearsal\")")
    else:
        lines.append(f"ok: every rank built, every figure within {GAP_THRESHOLD:.0%} of the plan's")
    return "\n".join(lines)


def _secs(v: Optional[float]) -> str:
    return "-" if v is None else (f"{v * 1e3:.1f}ms" if v < 1 else f"{v:.2f}s")


def _ratio_cell(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def render_real(result: Dict[str, Any]) -> List[str]:
    """The real-tensor table: per rank, the timed parts (means per step of the micro-batches run),
    compute for the layout's micro-batches vs the plan's, optimizer, and the peaks vs the plan's."""
    label = result["real"]
    head = (f"{'rank':>6} {'mb run/layout':>13} {'forward':>9} {'backward':>9} {'compute meas/plan':>21} {'x':>5} "
            f"{'optimizer meas/plan':>21} {'peak alloc meas/plan':>21} {'peak resv meas/plan':>21}")
    lines = ["", f"real tensors ({label['label']}; rehearsal_summary.json for bench/planner_accuracy.py --fit):",
             head, "-" * len(head)]
    for row in result["ranks"]:
        real = row.get("real")
        if not real:
            continue
        t, plan = real["time_s"], real["planned"]
        fwd = _secs(t.get("forward")) if "forward" in t else "fwd+bwd"
        bwd = _secs(t.get("backward")) if "backward" in t else _secs(t.get("forward_backward"))
        lines.append(
            f"{row['rank']:>6} {str(real['microbatches_run']) + '/' + str(real['layout_microbatches']):>13} {fwd:>9} "
            f"{bwd:>9} {_secs(real['compute_s']) + '/' + _secs(plan['compute_s']):>21} "
            f"{_ratio_cell(real['ratio']['compute']):>5} "
            f"{_secs(t.get('optimizer')) + '/' + _secs(plan['optimizer_s']):>21} "
            f"{_size(real['peak_allocated']) + '/' + _size(plan['peak_allocated']):>21} "
            f"{_size(real['peak_reserved']) + '/' + _size(plan['peak_reserved']):>21}")
    first = next((r["real"] for r in result["ranks"] if r.get("real")), None)
    if first:
        lines.append(f"memory: {first['memory_source']}")
    return lines
