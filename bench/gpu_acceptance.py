"""The single-GPU features through the real `train` command, row by row, pass/fail with numbers.

    bash bench/gpu_acceptance.sh OUTDIR [--rows a,b,c] [--cpu-smoke]

Rows run in priority order (a first); BUDGET_S (default 480) stops starting a row that would not
fit, so one loan of the GPU machine (15 minutes, its start included) keeps what ran. Each row's
runs go to OUTDIR/runs/, its verdict and figures to OUTDIR/results.md and OUTDIR/results.json;
each run's run_summary.json holds its measured vs planned tokens/s, MFU and peak memory.

--cpu-smoke runs the rows that do not need CUDA with debug models on CPU (gloo, no compile) so the
script cannot rot (tests/test_gpu_acceptance.py runs it in CI); the rows that need CUDA say so.

Rows:
  a  each family, a few layers, bf16 + compile, on an indexed corpus written here, with document
     masking: loss falls; tokens/s, MFU, peak memory vs the plan for this GPU's `hardware` entry
  b  CUDA-only runtime paths: an NCCL world of one rank, the pre-flight GPU probe, a profiler
     trace, the CUDA memory snapshot at an OOM, the hang watchdog's flight-recorder dump, straggler
     timings from CUDA events
  c  async checkpoint, kill -9 mid-run, resume: losses equal an uninterrupted run's
  d  fp8 tensorwise and rowwise + compile on the Qwen3 slice: fp8/bf16 tokens/s
  e  HF: model=hf from tiny random Qwen3-MoE and DeepSeek-V3 folders written by this machine's
     transformers: the run's first loss equals transformers' loss on the same batch (fp32, on the
     GPU), and the end-of-run export loads in transformers with the source's tensor names
  f  DeepSpeed ZeRO-1/2/3 and ZeRO-3 with CPU optimizer offload: losses vs the native engine;
     the build time of DeepSpeed's CPU Adam with this image's compilers
  g  activation checkpointing none / selective / full: peak memory ordered, each vs the plan
  h  the real-tensor rehearsal (rehearse.device=cuda rehearse.tensors=real) of rank 0 of llama70b and
     of deepseek_v3 at their full world sizes: forward, backward, optimizer time and peak memory vs the plan
  i  the harness checks (formerly gpu_checks.sh): gpu_throughput.py on llama_1b, 8 Llama-3-8B layers
     and one Mixtral layer, gpu_moe.py at 8K and 32K tokens, rehearse_gpu.py; JSON in OUTDIR/harness/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROW_ORDER = "abcdefghi"
# Rough wall seconds a row needs on an H100/H200 (compile included) and on the 2-core CPU: a row
# is started only if this much of the budget is left.
ROW_SECONDS = {"a": (300, 40), "b": (90, 0), "c": (80, 60), "d": (150, 0), "e": (60, 0), "f": (240, 0),
               "g": (120, 0), "h": (240, 0), "i": (300, 0)}
CUDA_ONLY = set("bdefghi")  # rows whose point is a CUDA path; on CPU other tests cover their logic


@dataclass
class Row:
    name: str
    title: str
    ok: Optional[bool] = None  # None: not run
    seconds: float = 0.0
    figures: Dict[str, object] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def check(self, condition: bool, what: str) -> bool:
        self.notes.append(("ok: " if condition else "FAILED: ") + what)
        if not condition:
            self.ok = False
        elif self.ok is None:
            self.ok = True
        return condition


class Acceptance:
    def __init__(self, out: Path, cpu: bool, budget_s: float):
        self.out = out
        self.cpu = cpu
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.runs = out / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.hardware, self.gpu = self._hardware()
        self._corpus: Optional[Path] = None

    # -- helpers -------------------------------------------------------------------------
    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def _hardware(self):
        if self.cpu:
            return None, "cpu"
        import torch

        from launcher.gpus import hardware_for_gpu

        name = torch.cuda.get_device_name()
        return hardware_for_gpu(name), name

    def base_args(self) -> List[str]:
        """What every run shares: no W&B, no progress bar, one log line per step."""
        args = ["logging.wandb.mode=disabled", "logging.progress=false", "trainer.log_every=1"]
        if self.cpu:
            return ["+recipe=debug", *args]
        args += ["trainer.device=cuda", "cluster.gpus_per_node=1"]
        if self.hardware:
            args.append(f"hardware={self.hardware}")
        return args

    def command(self, run_dir: Path, args: List[str], base: Optional[List[str]] = None) -> List[str]:
        """The `train` command line of one run (python -m launcher: no console script needed);
        `base` replaces base_args() (a recipe at its own world size keeps its cluster.*)."""
        return [sys.executable, "-m", "launcher", *(self.base_args() if base is None else base), *args,
                f"hydra.run.dir={run_dir}"]

    def train(self, name: str, args: List[str], timeout_s: Optional[float] = None, env: Optional[dict] = None,
              check: bool = True, base: Optional[List[str]] = None) -> "Run":
        run_dir = self.runs / name
        cmd = self.command(run_dir, args, base)
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        timeout = max(10.0, min(timeout_s or 1e9, self.left_s() + 60))
        t0 = time.monotonic()
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                      env={**os.environ, **(env or {})}).returncode
            except subprocess.TimeoutExpired:
                code = 124
        run = Run(run_dir, code, time.monotonic() - t0, log)
        if check and code != 0:
            raise RowFailure(f"{name}: train exited {code} after {run.seconds:.0f} s (log {log})")
        return run

    def corpus(self) -> Path:
        """An indexed corpus with document boundaries: each document counts up from a random start,
        so the next token is learnable and the loss must fall within a few steps."""
        if self._corpus is None:
            import numpy as np

            from launcher.data.indexed import write_indexed_dataset

            folder = self.out / "corpus"
            folder.mkdir(parents=True, exist_ok=True)
            rng = np.random.default_rng(0)
            span = 240 if self.cpu else 5000  # ids 10..span+9: within the debug models' 256-token vocabulary
            docs = [(rng.integers(0, span) + np.arange(int(rng.integers(50, 3000)))) % span + 10 for _ in range(3000)]
            tokens = write_indexed_dataset(folder / "shard_00000", [d.astype(np.uint16) for d in docs], np.uint16)
            (folder / "manifest.json").write_text(json.dumps({
                "format": "launcher-indexed", "version": 1, "dtype": "uint16",
                "tokenizer": {"path": "tokenizer.json", "sha256": "counting", "vocab_size": span + 10, "eos_id": 0,
                              "bos_id": None},
                "max_token_id": span + 9, "documents": len(docs), "tokens": tokens, "skipped": 0,
                "shards": [{"name": "shard_00000", "documents": len(docs), "tokens": tokens, "dtype": "uint16",
                            "bin_sha256": "", "idx_sha256": ""}], "sources": [], "complete": True}))
            self._corpus = folder
        return self._corpus

    # -- rows ------------------------------------------------------------------------------
    def row_a(self, row: Row) -> None:
        """Each family through `train` with document masking; CPU: the debug models, no compile."""
        if self.cpu:  # the MoE debug model: the dense path and the MoE path in one run
            cases = [("debug_moe", ["model=debug_moe"])]
            shape = ["trainer.steps=12", "trainer.seq_len=128"]
        else:
            cases = [("llama3_8b", ["model=llama3_8b", "model.n_layers=4"]),
                     ("qwen3_8b", ["model=qwen3_8b", "model.n_layers=4"]),
                     ("qwen3_30b_a3b", ["model=qwen3_30b_a3b", "model.n_layers=2"]),
                     ("deepseek_v3_small", ["model=deepseek_v3_small", "model.n_layers=4"])]
            shape = ["trainer.steps=15", "trainer.seq_len=4096", "trainer.micro_batch_size=2",
                     "trainer.global_batch_size=2", "trainer.compile=true", "precision=bf16"]
        for name, model in cases:
            if self.left_s() < 30:
                row.notes.append(f"{name}: not run (budget)")
                continue
            run = self.train(f"a_{name}", [*model, "data=indexed", f"data.path={self.corpus()}",
                                           "data.document_masking=true", "checkpoint.interval=0",
                                           "checkpoint.save_final=false", *shape])
            losses = run.losses()
            first, last = losses[0], sum(losses[-3:]) / 3
            row.check(last < first - 0.5, f"{name}: loss falls {first:.2f} -> {last:.2f} (mean of the last 3)")
            row.figures[name] = run.scored()

    def row_b(self, row: Row) -> None:
        """CUDA-only runtime paths on the llama_1b model (no compile): one NCCL rank, the GPU probe,
        a profiler trace; then the OOM snapshot and the hang watchdog's flight recorder."""
        small = ["model=llama_1b", "model.n_layers=2", "trainer.seq_len=2048", "trainer.micro_batch_size=1",
                 "trainer.global_batch_size=1", "checkpoint.interval=0", "checkpoint.save_final=false",
                 "data=indexed", f"data.path={self.corpus()}"]
        run = self.train("b_paths", [*small, "trainer.steps=8", "profile.enabled=true", "profile.steps=[4,5]",
                                     "trainer.health_check=on"])
        log = run.rank_log()
        row.check("(process group: backend nccl)" in log, "an NCCL world of one rank: " + _line_with(log, "(process group:"))
        row.check("health check" in log, "the pre-flight GPU probe ran: " + _line_with(log, "health check"))
        traces = [p for p in (run.dir / "profile").rglob("*.json") if p.stat().st_size > 1000]
        row.check(bool(traces), f"profiler trace written: {[str(p.relative_to(run.dir)) for p in traces][:2]}")
        oom = self.train("b_oom", [*small, "trainer.steps=8"], env={"LAUNCHER_DEBUG_OOM": "0:4"}, check=False)
        snap = oom.dir / "failure" / "memory_snapshot_rank_0.pickle"
        row.check(oom.code != 0 and snap.is_file() and snap.stat().st_size > 1000,
                  f"OOM at step 4: exit {oom.code}, CUDA memory snapshot {snap.stat().st_size if snap.is_file() else 0} B")
        hang = self.train("b_hang", [*small, "trainer.steps=8", "trainer.hang_timeout_s=20"],
                          env={"LAUNCHER_DEBUG_HANG": "0:4"}, check=False, timeout_s=150)
        fr = list((hang.dir / "failure").glob("fr_trace_rank_*.json"))
        summary = _json(hang.dir / "failure" / "summary.json") or {}
        row.check(hang.code != 0 and summary.get("what") == "hang" and bool(fr) and fr[0].stat().st_size > 0,
                  f"hang at step 4: exit {hang.code}, summary what={summary.get('what')}, flight recorder {len(fr)} file(s)")
        timing, figures = _in_own_process("straggler_timing_check", timeout_s=120)
        figures = figures or {}
        row.figures["straggler timing"] = figures or timing.stderr[-800:]
        row.check(bool(figures) and figures["step_time_median_s"] > 10 * figures["host_s_per_step"]
                  and figures["step_time_median_s"] >= 0.5 * figures["sleep_s"] and figures["gpu_matmul_min_ms"] > 0,
                  "straggler timings from CUDA events: a step that keeps the GPU busy while the host returns at once "
                  f"measures {figures.get('step_time_median_s', 0) * 1e3:.1f} ms on the device (host "
                  f"{figures.get('host_s_per_step', 0) * 1e3:.2f} ms); probe matmuls {figures.get('gpu_matmul_min_ms', 0):.2f} ms")

    def row_c(self, row: Row) -> None:
        """Async checkpoint, SIGKILL of every process after a checkpoint, resume: equal losses."""
        # The killed run's rank 0 sleeps before step 10 (LAUNCHER_DEBUG_HANG), so the kill lands
        # mid-run however fast the steps are, after step 8's checkpoint has been committed.
        steps = 12 if self.cpu else 40
        args = ["checkpoint.interval=4", "checkpoint.async=true", f"trainer.steps={steps}", "trainer.deterministic=true",
                "data=indexed", f"data.path={self.corpus()}"]
        if not self.cpu:
            args += ["model=llama_1b", "model.n_layers=2", "trainer.seq_len=2048", "trainer.micro_batch_size=1",
                     "trainer.global_batch_size=2", "precision=bf16"]
        reference = self.train("c_reference", args)
        killed_dir = self.runs / "c_killed"
        proc = self._start(killed_dir, args, env={"LAUNCHER_DEBUG_HANG": "0:10"})
        deadline = time.monotonic() + max(30.0, self.left_s())
        while not (killed_dir / "checkpoints" / "step_00000008").is_dir() and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in _pids_of(killed_dir):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        was = Run(killed_dir, -9, 0.0, self.out / "logs" / "c_killed.log").losses_by_step()
        row.check(max(was, default=0) < steps, f"killed after step {max(was, default=0)} of {steps} (a checkpoint at step 8, paused before step 10)")
        resumed = self.train("c_killed", args)
        a, b = reference.losses_by_step(), resumed.losses_by_step()
        worst = max(abs(a[s] - b[s]) for s in a) if set(a) == set(b) else math.inf
        # Tolerance 0: trainer.deterministic=true makes the same kernels run in the same order, and
        # the checkpoint holds model, optimizer, data position and RNG exactly.
        row.check(worst == 0.0, f"resumed losses equal the uninterrupted run's: max |diff| {worst:g} over {len(a)} steps")

    def row_d(self, row: Row) -> None:
        """fp8 + compile vs bf16 + compile on four Qwen3-8B layers."""
        common = ["model=qwen3_8b", "model.n_layers=4", "trainer.seq_len=4096", "trainer.micro_batch_size=2",
                  "trainer.global_batch_size=2", "trainer.compile=true", "trainer.steps=15", "checkpoint.interval=0",
                  "checkpoint.save_final=false", "data=indexed", f"data.path={self.corpus()}"]
        bf16 = self.train("d_bf16", [*common, "precision=bf16"]).scored()
        row.figures["bf16"] = bf16
        for recipe in ("tensorwise", "rowwise"):
            if self.left_s() < 60:
                row.notes.append(f"fp8 {recipe}: not run (budget)")
                continue
            fp8 = self.train(f"d_fp8_{recipe}", [*common, "precision=fp8", f"precision.fp8.recipe={recipe}"]).scored()
            row.figures[f"fp8_{recipe}"] = fp8
            ratio = (fp8.get("tokens_per_s") or 0) / (bf16.get("tokens_per_s") or math.inf)
            row.check(ratio > 1.0, f"fp8 {recipe} / bf16 tokens/s = {ratio:.3f}")

    def row_e(self, row: Row) -> None:
        """model=hf from tiny random Qwen3-MoE and DeepSeek-V3 folders that this machine's
        transformers writes: the run's first loss vs transformers' on the same batch, on the GPU; the
        end-of-run export read back by transformers."""
        folders = self.out / "hf"
        made, _ = _in_own_process("write_hf_folders", str(folders), timeout_s=120)
        if not row.check(made.returncode == 0, f"tiny folders written by transformers: exit {made.returncode}"):
            row.notes.append(made.stderr[-800:])
            return
        for name in ("qwen3_moe", "deepseek_v3"):
            args = ["cluster.gpus_per_node=1", "model=hf", f"model.init_from={folders / name}", "data=indexed", f"data.path={self.corpus()}",
                    "trainer.steps=3", "trainer.seq_len=256", "trainer.micro_batch_size=2", "trainer.global_batch_size=2",
                    "precision=fp32", "precision.tf32=false", "checkpoint.interval=0", "checkpoint.export=hf",
                    "checkpoint.export_dtype=fp32"]
            run = self.train(f"e_{name}", args)
            ours = run.losses()[0]
            check, theirs = _in_own_process("hf_first_loss", [*self.base_args(), *args], str(folders / name),
                                            str(run.dir / "export" / "hf"), timeout_s=180)
            if not row.check(check.returncode == 0, f"{name}: transformers on the run's first batch: exit {check.returncode}"):
                row.notes.append(check.stderr[-800:])
                continue
            rel = abs(ours - theirs["source_loss"]) / theirs["source_loss"]
            row.figures[name] = {"ours": ours, **theirs, "relative": rel}
            # fp32 weights and maths on both sides; the kernels differ (attention, the experts'
            # grouped matmuls, reduction order), so equal to ~1e-6, not bit for bit.
            row.check(rel <= 1e-4, f"{name}: first loss {ours:.6f} vs transformers {theirs['source_loss']:.6f} "
                                   f"(relative {rel:.1e}, tolerance 1e-4)")
            row.check(theirs["export_names_match"] and math.isfinite(theirs["export_loss"])
                      and theirs["export_loss"] != theirs["source_loss"],
                      f"{name}: the export loads in transformers with the source's tensor names; its loss on that batch "
                      f"{theirs['export_loss']:.6f} (it trained 3 steps)")

    def row_f(self, row: Row) -> None:
        """DeepSpeed ZeRO-1, 2, 3 and ZeRO-3 with the optimizer on the CPU: each run's losses vs the
        native engine's on the same model, data and seed; DeepSpeed's CPU Adam JIT-built first, timed."""
        shape = (["trainer.seq_len=64", "precision=fp32"] if self.cpu else  # CPU: the debug model (a local check of the row)
                 ["model=llama_1b", "model.n_layers=2", "trainer.seq_len=2048", "precision=bf16"])
        common = [*shape, "cluster.gpus_per_node=1", "trainer.micro_batch_size=1", "trainer.global_batch_size=1", "trainer.steps=6",
                  "checkpoint.interval=0", "checkpoint.save_final=false", "data=indexed", f"data.path={self.corpus()}"]
        t0 = time.monotonic()
        built = subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; "
                                "CPUAdamBuilder().load(verbose=False)"], cwd=REPO, capture_output=True, text=True, timeout=600)
        row.figures["cpu_adam_build_s"] = round(time.monotonic() - t0, 1)
        row.check(built.returncode == 0, f"DeepSpeed's CPU Adam built with this image's compilers in "
                                         f"{row.figures['cpu_adam_build_s']} s (exit {built.returncode})")
        native = self.train("f_native", [*common, "backend=native"]).losses()
        row.figures["native"] = native
        cases = [("zero1", ["parallel.zero_stage=1"]), ("zero2", ["parallel.zero_stage=2"]),
                 ("zero3", ["parallel.zero_stage=3"]), ("zero3_offload", ["parallel.zero_stage=3", "offload=cpu"])]
        for name, extra in cases:
            if self.left_s() < 40:
                row.notes.append(f"{name}: not run (budget)")
                continue
            losses = self.train(f"f_{name}", [*common, "backend=deepspeed", *extra]).losses()
            worst = max(abs(a - b) / b for a, b in zip(losses, native)) if len(losses) == len(native) else math.inf
            row.figures[name] = losses
            # bf16 compute on both engines, fp32 master weights and Adam: the same maths in other
            # kernels and reduction orders, so the losses agree to bf16's resolution, not exactly.
            row.check(worst <= 2e-2, f"{name}: losses vs native over {len(native)} steps, worst relative {worst:.1e} "
                                     f"(tolerance 2e-2)")

    def row_g(self, row: Row) -> None:
        """Activation checkpointing none / selective / full on four Llama-3-8B layers (no compile):
        peak memory ordered none > selective > full, each beside the plan."""
        shape = (["trainer.seq_len=256"] if self.cpu else  # CPU: the debug model (a local check of the row)
                 ["model=llama3_8b", "model.n_layers=4", "trainer.seq_len=4096", "precision=bf16"])
        common = [*shape, "cluster.gpus_per_node=1", "trainer.micro_batch_size=2", "trainer.global_batch_size=2", "trainer.steps=4",
                  "checkpoint.interval=0", "checkpoint.save_final=false", "data=indexed", f"data.path={self.corpus()}"]
        peaks = {}
        for policy in ("none", "selective", "full"):
            if self.left_s() < 40:
                row.notes.append(f"{policy}: not run (budget)")
                continue
            scored = self.train(f"g_{policy}", [*common, f"activation_checkpointing={policy}"]).scored()
            row.figures[policy] = scored
            peaks[policy] = scored.get("peak_bytes") or 0
            ratio = scored.get("peak_bytes_ratio")
            row.check(ratio is not None and 0.85 <= ratio <= 1.15,
                      f"{policy}: peak {peaks[policy] / 2**30:.1f} GiB, measured/plan {ratio} (within 0.85-1.15)")
        if len(peaks) == 3:
            row.check(peaks["none"] > peaks["selective"] > peaks["full"],
                      "peak memory ordered none > selective > full: "
                      + " > ".join(f"{peaks[k] / 2**30:.1f}" for k in ("none", "selective", "full")) + " GiB")

    def row_i(self, row: Row) -> None:
        """The harness measurements (no `train`): each script's exit code, its JSON kept."""
        harness = self.out / "harness"
        harness.mkdir(exist_ok=True)
        checks = [
            ("throughput_llama_1b", ["bench/gpu_throughput.py"]),
            ("throughput_8b", ["bench/gpu_throughput.py", "--model", "llama3_8b", "--seq-len", "4096",
                               "--micro-batch", "1", "--set", "model.n_layers=8"]),
            ("throughput_moe", ["bench/gpu_throughput.py", "--model", "mixtral_8x7b", "--seq-len", "4096",
                                "--micro-batch", "2", "--set", "model.n_layers=1"]),
            ("moe", ["bench/gpu_moe.py"]),
            ("moe_32k", ["bench/gpu_moe.py", "--tokens", "32768"]),
            ("rehearse_gpu", ["bench/rehearse_gpu.py"]),
        ]
        for name, cmd in checks:
            if self.left_s() < 60:
                row.notes.append(f"{name}: not run (budget)")
                continue
            json_arg = [] if name.startswith("moe") else ["--json", str(harness / f"{name}.json")]
            with open(harness / f"{name}.md", "w") as f:
                try:
                    code = subprocess.run([sys.executable, *cmd, *json_arg], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                          timeout=max(30.0, self.left_s())).returncode
                except subprocess.TimeoutExpired:
                    code = 124
            row.check(code == 0, f"{name}: exit {code} (output in harness/{name}.md)")

    def row_h(self, row: Row) -> None:
        """Rank 0 of two full-size recipes at their own world sizes (llama70b: 64 GPUs, TP 8 x FSDP 8;
        deepseek_v3: 2,048 GPUs, PP 16 x EP 64), built with real CUDA tensors on the fake process
        group: each part timed and the peaks measured, beside the plan for this GPU."""
        plan_for = [f"hardware={self.hardware}"] if self.hardware else ["rehearse.allow_other_gpu=true"]
        for recipe in ("llama70b", "deepseek_v3"):
            if self.left_s() < 60:
                row.notes.append(f"{recipe}: not run (budget)")
                continue
            run = self.train(f"h_{recipe}", [f"+recipe={recipe}", "action=rehearse", "rehearse.device=cuda",
                                             "rehearse.tensors=real", "rehearse.ranks=[0]", "rehearse.timed_steps=2",
                                             *plan_for], base=["logging.wandb.mode=disabled"], check=False)
            result = _json(run.dir / "rehearsal.json") or {}
            rank = (result.get("ranks") or [{}])[0]
            real = rank.get("real")
            if not row.check(run.code == 0 and bool(result.get("ok")) and bool(real),
                             f"{recipe} rank 0: exit {run.code}, rehearsal ok={result.get('ok')} (log {run.log})"):
                continue
            times = real["time_s"]
            row.check(bool(times) and all(v > 0 for v in times.values()),
                      f"{recipe} rank 0 ({real['microbatches_run']} of {real['layout_microbatches']} micro-batches): "
                      + ", ".join(f"{k} {v:.3f} s" for k, v in times.items())
                      + f"; compute {real['compute_s']:.2f} s vs plan {real['planned']['compute_s']:.2f} s")
            row.check(0 < real["peak_allocated"] <= real["peak_reserved"],
                      f"{recipe} rank 0: peak allocated {real['peak_allocated'] / 2**30:.1f} GiB vs plan "
                      f"{real['planned']['peak_allocated'] / 2**30:.1f}, reserved {real['peak_reserved'] / 2**30:.1f} "
                      f"GiB vs plan {real['planned']['peak_reserved'] / 2**30:.1f}")
            row.figures[recipe] = {"label": result["real"]["label"], "time_s": times, "compute_s": real["compute_s"],
                                   "planned": real["planned"], "ratio": real["ratio"],
                                   "peak_allocated": real["peak_allocated"], "peak_reserved": real["peak_reserved"]}

    # -- driver --------------------------------------------------------------------------
    def _start(self, run_dir: Path, args: List[str], env: Optional[dict] = None) -> subprocess.Popen:
        log = open(self.out / "logs" / f"{run_dir.name}.log", "a")
        cmd = self.command(run_dir, args)
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})

    def run_rows(self, names: str) -> List[Row]:
        titles = row_titles()
        rows = []
        for name in ROW_ORDER:
            if name not in names:
                continue
            row = Row(name, titles.get(name, ""))
            rows.append(row)
            need = ROW_SECONDS[name][1 if self.cpu else 0]
            method: Optional[Callable[[Row], None]] = getattr(self, f"row_{name}", None)
            if self.cpu and name in CUDA_ONLY:
                row.notes.append("needs CUDA: not run in the CPU smoke")
            elif method is None:
                row.notes.append("not built yet")
            elif self.left_s() < need:
                row.notes.append(f"not run: {self.left_s():.0f} s left of the budget, needs ~{need} s")
            else:
                t0 = time.monotonic()
                print(f"== row {name} ({self.left_s():.0f} s left)", flush=True)
                try:
                    method(row)
                except RowFailure as err:
                    row.check(False, str(err))
                except Exception as err:  # a row's bug must not cost the rows after it
                    row.check(False, f"{type(err).__name__}: {err}")
                row.seconds = time.monotonic() - t0
                print(f"   row {name}: {'pass' if row.ok else 'FAIL' if row.ok is False else 'no verdict'} "
                      f"in {row.seconds:.0f} s", flush=True)
            self.write(rows)
        return rows

    def write(self, rows: List[Row]) -> None:
        env = environment_line(self.cpu)
        lines = [f"# GPU acceptance, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "", env,
                 f"hardware entry: {self.hardware or '(none matches: figures labelled with the GPU)'}", "",
                 "| row | what | result | s |", "|---|---|---|---|"]
        for r in rows:
            verdict = {True: "pass", False: "FAIL", None: "not run"}[r.ok]
            lines.append(f"| {r.name} | {r.title} | {verdict} | {r.seconds:.0f} |")
        for r in rows:
            lines += ["", f"## {r.name}: {r.title}", *[f"- {n}" for n in r.notes]]
            for key, fig in r.figures.items():
                lines.append(f"- {key}: {json.dumps(fig)}")
        (self.out / "results.md").write_text("\n".join(lines) + "\n")
        (self.out / "results.json").write_text(json.dumps({
            "environment": env, "hardware": self.hardware, "gpu": self.gpu,
            "rows": [{"row": r.name, "title": r.title, "ok": r.ok, "seconds": round(r.seconds, 1),
                      "notes": r.notes, "figures": r.figures} for r in rows]}, indent=1))


def _in_own_process(function: str, *args, timeout_s: float):
    """Call `function` of this module with JSON-able `args` in a new interpreter (so the driver holds
    no CUDA context and imports neither transformers nor DeepSpeed): (the finished process, the JSON
    its last line printed, or None). PYTHONPATH keeps what bench/gpu_acceptance.sh set (the carried
    wheels) behind the repo."""
    code = ("import json, sys; import bench.gpu_acceptance as g; "
            f"print(json.dumps(g.{function}(*json.loads(sys.argv[1]))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(list(args))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    return proc, json.loads(lines[-1]) if proc.returncode == 0 and lines else None


def write_hf_folders(root: str) -> None:
    """Row e's tiny random Qwen3-MoE and DeepSeek-V3 folders, written by this machine's
    transformers (its own config classes and save_pretrained), with the corpus's vocabulary."""
    import torch
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    small = dict(vocab_size=5120, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 max_position_embeddings=512, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**small, num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
                                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                       mlp_only_layers=[0], norm_topk_prob=True)).save_pretrained(Path(root) / "qwen3_moe")
    DeepseekV3ForCausalLM(DeepseekV3Config(**small, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32,
                                           n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                           topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                           initializer_range=0.1)).save_pretrained(Path(root) / "deepseek_v3")


def hf_first_loss(overrides: List[str], source: str, export: str) -> Dict[str, object]:
    """Row e: transformers' loss, on the GPU in fp32, on the first batch the run with these
    overrides trained (the launcher's own data pipeline gives it), for the source folder and for
    the run's export; and whether the export has the source's tensor names."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from launcher.config.loader import compose_spec
    from launcher.hf.format import weight_files
    from launcher.plan.present.plan import build_plan
    from launcher.runtime.entry import build_batches

    spec = compose_spec(overrides)
    batch = build_batches(spec, build_plan(spec), 0, Path(tempfile.mkdtemp()))
    first = batch.for_step(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # as the run's precision.tf32=false
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def loss_of(folder: str) -> float:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        total = count = 0.0
        with torch.no_grad():
            for mb in first:
                logits = model(mb.inputs.to(device)).logits.float()
                labels = mb.labels.to(device)
                total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                                 ignore_index=-100, reduction="sum"))
                count += float((labels != -100).sum())
        return total / count

    return {"source_loss": loss_of(source), "export_loss": loss_of(export),
            "export_names_match": sorted(weight_files(source)) == sorted(weight_files(export))}


def straggler_timing_check() -> Dict[str, float]:
    """Row b's straggler timing (run in its own process, so the driver holds no CUDA context):
    launcher/resilience/stragglers.py on one GPU, three steps that only sleep on the device
    (torch.cuda._sleep: the host returns at once). Their device time must show the sleep, which
    host wall time without a sync would miss. Returns the figures row b checks."""
    import torch

    from launcher.resilience.stragglers import StragglerMonitor

    device = torch.device("cuda", 0)
    cycles = 200_000_000  # about 0.1 s at a 2 GHz SM clock
    torch.cuda._sleep(cycles)  # warm-up, and the sleep's own length, timed with a sync
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    sleep_s = time.perf_counter() - t0
    monitor = StragglerMonitor(0, ["this host"], 1.5, device, checks=3)
    host = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        monitor.step_started()
        torch.cuda._sleep(cycles)
        monitor.step_finished()
        host += time.perf_counter() - t0
    figures = monitor.observe(3)
    return {"sleep_s": sleep_s, "host_s_per_step": host / 3,
            **{k: figures[k] for k in ("step_time_median_s", "gpu_matmul_min_ms")}}


def row_titles() -> Dict[str, str]:
    """Each row's description, from this module's docstring (its "Rows:" list)."""
    titles: Dict[str, str] = {}
    current = ""
    for line in __doc__.split("Rows:")[1].splitlines():
        text = line.strip()
        if line.startswith("  ") and not line.startswith("   ") and text[:1] in ROW_ORDER and text[1:3] == "  ":
            current = text[0]
            titles[current] = text[3:].strip()
        elif current and text:
            titles[current] += " " + text
    return titles


class RowFailure(RuntimeError):
    pass


@dataclass
class Run:
    dir: Path
    code: int
    seconds: float
    log: Path

    def metrics(self) -> List[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []

    def losses_by_step(self) -> Dict[int, float]:
        return {r["step"]: r["loss"] for r in self.metrics() if "loss" in r}

    def losses(self) -> List[float]:
        by_step = self.losses_by_step()
        if not by_step:
            raise RowFailure(f"{self.dir.name}: no losses in metrics.jsonl (log {self.log})")
        return [by_step[s] for s in sorted(by_step)]

    def rank_log(self) -> str:
        path = self.dir / "logs" / "rank_0.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def scored(self) -> Dict[str, object]:
        """Measured vs planned from run_summary.json, plus the run's own last-steps tokens/s."""
        summary = _json(self.dir / "run_summary.json") or {}
        figs = summary.get("figures", {})
        out: Dict[str, object] = {"seconds": round(self.seconds, 1)}
        for key, name in (("tokens_per_s_per_gpu", "tokens_per_s"), ("mfu", "mfu"), ("peak_memory_bytes", "peak_bytes")):
            fig = figs.get(key) or {}
            out[name] = fig.get("measured")
            out[f"{name}_planned"] = fig.get("predicted")
            out[f"{name}_ratio"] = None if fig.get("ratio") is None else round(fig["ratio"], 3)
        return out


def _json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _line_with(text: str, needle: str) -> str:
    return next((l.strip()[-160:] for l in text.splitlines() if needle in l), "(no such line)")


def _pids_of(run_dir: Path) -> List[int]:
    found = subprocess.run(["pgrep", "-f", "--", f"--run-dir {run_dir}"], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def environment_line(cpu: bool) -> str:
    import torch

    from launcher.compat import in_process

    caps = in_process()
    gpu = "cpu" if cpu else f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    return (f"device {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); Python {sys.version.split()[0]}; "
            f"capabilities beyond the floor: {sorted(caps.present) or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", default=ROW_ORDER, help="which rows, e.g. a,c (default: all, in priority order)")
    parser.add_argument("--cpu-smoke", action="store_true", help="debug models on CPU; the CUDA rows say so")
    args = parser.parse_args()
    rows_wanted = args.rows.replace(",", "")
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device is visible. Fix: run on a GPU machine, or pass --cpu-smoke", file=sys.stderr)
            return 2
    out = args.out.resolve()
    shutil.rmtree(out / "runs", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    acceptance = Acceptance(out, args.cpu_smoke, float(os.environ.get("BUDGET_S", "480")))
    rows = acceptance.run_rows(rows_wanted)
    print((out / "results.md").read_text())
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
