"""How fast `action=plan` and `action=search` answer, measured through the real `train` command.

    .venv/bin/python bench/planner_speed.py            # 3 repeats each, prints wall times
    .venv/bin/python bench/planner_speed.py --repeat 5

Targets (issues 6 and 13), wall time including interpreter start on our 2-core machines:
  train +recipe=llama405b action=plan cluster.nodes=1024 trainer.global_batch_size=2048 plan.format=json  < 2 s
  train +recipe=llama405b action=plan cluster.nodes=1024: text tables printed   < 2 s
      (the PNG charts are written after the tables: the line "tables printed" times the first
      output, "exit" the whole command with the charts)
  train +recipe=llama405b action=search cluster.nodes=256                   < 10 s
Also times the planner alone (in-process build_plan and search_layouts, no Hydra, no
interpreter start), which is what the search's budget mostly goes to.
Not a test: timings depend on the machine's load; it prints numbers and exits 0. The "cpu s"
column (user + system time of the command, interpreter included) is what the command costs on
an idle machine: on a loaded one the wall time is longer by the time spent waiting for a core.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TRAIN = str(Path(sys.executable).with_name("train"))

COMMANDS = [
    # 8,192 GPUs need a global batch of at least 2,048 for the recipe's 8-stage interleaved pipeline.
    ("plan 405b, 8192 GPUs, json", ["+recipe=llama405b", "action=plan", "cluster.nodes=1024",
                                    "trainer.global_batch_size=2048", "plan.format=json", "plan.plots=false"]),
    ("plan 405b, 8192 GPUs, text + plots", ["+recipe=llama405b", "action=plan", "cluster.nodes=1024",
                                            "trainer.global_batch_size=2048"]),
    ("search 405b, 2048 GPUs", ["+recipe=llama405b", "action=search", "cluster.nodes=256"]),
    ("search 405b, 1024+2048 GPUs, objective=time", ["+recipe=llama405b", "action=search", "plan.objective=time",
                                                     "plan.search_nodes=[128,256]"]),
    ("search 70b, 256 GPUs", ["+recipe=llama70b", "action=search", "cluster.nodes=32"]),
    ("search mixtral, 64 GPUs", ["+recipe=mixtral8x7b", "action=search", "cluster.nodes=8"]),
]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_command(args, repeat: int):
    """(wall seconds, CPU seconds) per repeat of `train ARGS`, or (None, None, stderr) on failure."""
    times, cpu = [], []
    with tempfile.TemporaryDirectory(prefix="planspeed_") as tmp:
        for i in range(repeat):
            c0, t0 = _children_cpu_s(), time.perf_counter()
            proc = subprocess.run([TRAIN, *args, f"hydra.run.dir={tmp}/r{i}"], cwd=tmp, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            cpu.append(_children_cpu_s() - c0)
            if proc.returncode != 0:
                return None, None, proc.stderr[-1500:]
    return times, cpu, ""


def time_first_output(args, repeat: int):
    """(seconds until the command's first stdout line, seconds until it exits) per repeat.

    `train action=plan` prints its tables in one flushed write before it writes the charts, so
    the first line's arrival is when the tables are on the console."""
    first, total = [], []
    with tempfile.TemporaryDirectory(prefix="planspeed_") as tmp:
        for i in range(repeat):
            t0 = time.perf_counter()
            proc = subprocess.Popen([TRAIN, *args, f"hydra.run.dir={tmp}/r{i}"], cwd=tmp, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            line = proc.stdout.readline()
            first.append(time.perf_counter() - t0)
            _, err = proc.communicate()
            total.append(time.perf_counter() - t0)
            if proc.returncode != 0 or not line:
                return None, None, err[-1500:]
    return first, total, ""


FIRST_OUTPUT = [
    ("plan 405b, 8192 GPUs, text (charts after)", ["+recipe=llama405b", "action=plan", "cluster.nodes=1024"]),
    ("plan 405b, 8192 GPUs, json", ["+recipe=llama405b", "action=plan", "cluster.nodes=1024", "plan.format=json"]),
]


def time_in_process(repeat: int):
    from launcher.config.loader import compose_spec
    from launcher.plan.present.plan import build_plan
    from launcher.plan.present.search import search_layouts

    rows = []
    spec = compose_spec(["+recipe=llama405b", "cluster.nodes=1024", "trainer.global_batch_size=2048", "action=plan"])
    t = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        build_plan(spec)
        t.append(time.perf_counter() - t0)
    rows.append(("build_plan 405b, 8192 GPUs (in process)", t, ""))
    spec = compose_spec(["+recipe=llama405b", "cluster.nodes=256", "action=search"])
    t = []
    stats = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        search_layouts(spec, stats=stats)
        t.append(time.perf_counter() - t0)
    info = (f"{stats['meshes']} meshes, {stats['layouts']} layouts sized, {stats['states_too_big']} dropped on "
            f"model states, {stats['timed']} timed, {stats['validated']} validated")
    rows.append(("search_layouts 405b, 2048 GPUs (in process)", t, info))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{'what':<48} {'median s':>9} {'min s':>7} {'max s':>7} {'cpu s':>7}")
    for name, cmd in COMMANDS:
        times, cpu, err = time_command(cmd, args.repeat)
        if times is None:
            print(f"{name:<48} failed: {err}")
            continue
        print(f"{name:<48} {statistics.median(times):>9.2f} {min(times):>7.2f} {max(times):>7.2f} "
              f"{statistics.median(cpu):>7.2f}", flush=True)
    for name, cmd in FIRST_OUTPUT:
        first, total, err = time_first_output(cmd, args.repeat)
        if first is None:
            print(f"{name:<48} failed: {err}")
            continue
        print(f"{name + ': tables printed':<48} {statistics.median(first):>9.2f} {min(first):>7.2f} {max(first):>7.2f}")
        print(f"{name + ': exit':<48} {statistics.median(total):>9.2f} {min(total):>7.2f} {max(total):>7.2f}",
              flush=True)
    for name, times, info in time_in_process(args.repeat):
        print(f"{name:<48} {statistics.median(times):>9.3f} {min(times):>7.3f} {max(times):>7.3f}  {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
