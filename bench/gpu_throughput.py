"""Single-GPU training throughput: tokens/s, TFLOP/s, MFU and peak memory, launcher vs plain PyTorch.

    python bench/gpu_throughput.py                      # one GPU: llama_1b, seq 4096
    python bench/gpu_throughput.py --append docs/benchmarks.md
    python bench/gpu_throughput.py --smoke              # CPU, debug model, < 1 min (CI)

Variants, all on the same model shape, the same token batches, the same AdamW hyperparameters
(constant LR, no warm-up, so the reference needs no scheduler) and the same seed and
initialisation, one after the other in one process:

    reference bf16 + compile   a hand-written loop: build_model, per-block torch.compile,
                               bf16 autocast, fused AdamW, grad clipping; no launcher code
    launcher bf16              the real native engine (launcher.runtime.entry.engine_for_rank),
    launcher bf16 + compile    driven through Engine.train_step exactly as `train` drives it
    launcher fp8 + compile

The launcher's overhead is the ratio of its bf16 + compile step time to the reference's,
measured in the same run. FLOPs per token come from launcher.plan.estimate.flops (6N + 12*L*h*s, the
one place that formula lives); MFU is against the dense BF16 peak of the GPU's
conf/hardware entry (also for fp8, so rows compare: fp8 shows up as a higher MFU). Peak
memory is torch.cuda.max_memory_allocated per variant next to the planner's prediction
(Plan.memory["total"] minus its fixed "reserved" share, which the allocator does not see).

Each variant runs `--warmup` untimed steps (compilation happens there), then `--steps` timed
steps; the step time is the median, with a device synchronisation each step (both loops
read the loss every step, as a training loop that logs does).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]



@dataclass(frozen=True)
class Variant:
    name: str
    path: str  # reference | launcher
    precision: str  # bf16 | fp8
    compile: bool


VARIANTS: Tuple[Variant, ...] = (
    Variant("reference bf16 + compile", "reference", "bf16", True),
    Variant("launcher bf16", "launcher", "bf16", False),
    Variant("launcher bf16 + compile", "launcher", "bf16", True),
    Variant("launcher fp8 + compile", "launcher", "fp8", True),
)


@dataclass
class Settings:
    device: str  # cuda | cpu
    model: str
    seq_len: int
    micro_batch: int
    warmup: int
    steps: int
    hardware: str
    compile: bool  # False: every variant runs eager (smoke mode)
    tied: bool = False  # the model's tie_embeddings, filled once composed
    seed: int = 1234
    extra: Tuple[str, ...] = ()  # --set overrides, applied after the variant's own
    profile_dir: Optional[str] = None  # --profile


@dataclass
class Result:
    variant: str
    status: str = "ok"  # ok | not wired: ... | failed: ...
    compiled: bool = False
    step_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None
    mfu: Optional[float] = None
    params: Optional[int] = None  # parameters the variant's model holds
    peak_mem_bytes: Optional[int] = None
    predicted_mem_bytes: Optional[int] = None
    losses: List[float] = field(default_factory=list)


# ----------------------------------------------------------------------------- set-up


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, debug model, a few steps: checks the harness")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--model", default=None, help="conf/model entry (default llama_1b; smoke: debug)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (smoke: 64)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 2; smoke: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default 5; smoke: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 20; smoke: 2)")
    p.add_argument("--hardware", default="auto", help="conf/hardware entry for the peak FLOP/s (auto: from GPU name)")
    p.add_argument("--variants", default="all",
                   help="comma-separated subset of: " + ", ".join(v.name for v in VARIANTS))
    p.add_argument("--no-compile", action="store_true", help="run every variant eager (default in --smoke)")
    p.add_argument("--compile", action="store_true", help="with --smoke: keep torch.compile on")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `train` override for every variant, e.g. --set model.n_layers=1 (repeatable)")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="after timing, profile 3 more steps per variant; write DIR/<variant>.txt "
                        "(kernels by device time) and print each variant's top kernels to stderr")
    p.add_argument("--append", type=Path, default=None, help="append the markdown record to this file")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    import torch

    device = args.device
    if args.smoke and device == "auto":
        device = "cpu"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device. Fix: run on a GPU node, or --smoke.")
    small = args.smoke
    compile_on = (not args.no_compile) and (args.compile or not small)
    return Settings(
        device=device,
        model=args.model or ("debug" if small else "llama_1b"),
        seq_len=args.seq_len or (64 if small else 4096),
        micro_batch=args.micro_batch or 2,
        warmup=args.warmup if args.warmup is not None else (1 if small else 5),
        steps=args.steps if args.steps is not None else (2 if small else 20),
        hardware=args.hardware,
        extra=tuple(args.set),
        profile_dir=str(args.profile) if args.profile else None,
        compile=compile_on,
    )


def select_variants(spec: str) -> List[Variant]:
    if spec == "all":
        return list(VARIANTS)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    by_name = {v.name: v for v in VARIANTS}
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(by_name)}")
    return [by_name[w] for w in wanted]


def hardware_name(requested: str, device: str) -> str:
    """conf/hardware entry: explicit, or matched from the GPU's name (h100_sxm on CPU)."""
    if requested != "auto":
        return requested
    if device == "cuda":
        import torch

        from launcher.gpus import hardware_for_gpu

        gpu = torch.cuda.get_device_name()
        name = hardware_for_gpu(gpu)
        if name and (REPO / "conf" / "hardware" / f"{name}.yaml").exists():
            if "PCIe" in gpu:
                print(f"warning: {gpu} is a PCIe card; conf/hardware/{name}.yaml may describe the SXM "
                      "part (higher peak). Pass --hardware to choose.", file=sys.stderr)
            return name
        print(f"warning: no conf/hardware entry matches GPU '{gpu}'; using h100_sxm peaks. "
              "Fix: add conf/hardware/<gpu>.yaml and pass --hardware <gpu>.", file=sys.stderr)
    return "h100_sxm"


def load_hardware(name: str):
    """The HardwareConfig of conf/hardware/NAME.yaml (typed by the schema)."""
    from omegaconf import OmegaConf

    from launcher.config.schema import HardwareConfig
    from launcher.paths import config_dir

    path = config_dir() / "hardware" / f"{name}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in (config_dir() / "hardware").glob("*.yaml"))
        raise SystemExit(f"--hardware {name}: no {path}. Choose one of {choices}.")
    merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def compose_job(s: Settings, precision: str, compile: bool):
    """The JobConfig `train` would build for this variant (one rank, one micro-batch per step)."""
    from launcher.config.loader import compose_spec

    overrides = [
        f"model={s.model}",
        f"precision={precision}",
        f"hardware={s.hardware}",
        f"trainer.device={s.device}",
        f"trainer.seq_len={s.seq_len}",
        f"trainer.micro_batch_size={s.micro_batch}",
        f"trainer.global_batch_size={s.micro_batch}",
        f"trainer.steps={s.warmup + s.steps}",
        f"trainer.compile={str(compile).lower()}",
        f"trainer.seed={s.seed}",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        # A constant LR so the reference loop needs no scheduler to run the same optimizer.
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "checkpoint.enabled=false",
        "logging.wandb.mode=disabled",
    ]
    if precision == "fp8" and s.device != "cuda":
        overrides.append("precision.fp8.emulate=true")  # numerics only on CPU
    overrides.extend(s.extra)
    spec = compose_spec(overrides)
    if spec.model.max_seq_len < s.seq_len:
        raise SystemExit(f"--seq-len {s.seq_len} exceeds model.max_seq_len={spec.model.max_seq_len} of {s.model}")
    return spec


def make_batches(s: Settings, vocab_size: int, n: int):
    """`n` (inputs, labels) pairs of random tokens on the CPU, the same for every variant.

    They stay on the CPU like the trainer's batches; each loop copies them to the device.
    """
    import torch

    g = torch.Generator().manual_seed(s.seed)
    out = []
    for _ in range(n):
        seq = torch.randint(0, vocab_size, (s.micro_batch, s.seq_len + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def ensure_process_group(device: str) -> None:
    """A one-rank process group, as torchrun would give `train` (the engine needs one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from launcher.runtime.dist import init_distributed

    init_distributed(device)


# ----------------------------------------------------------------------------- the two loops


def reference_step_fn(spec, device) -> Callable:
    """A plain PyTorch training step on the same model: no launcher code after build_model."""
    import torch
    import torch.nn.functional as F

    from launcher.models import build_model

    with torch.device("meta"):
        model = build_model(spec.model)
    model.to_empty(device=device)  # Transformer.to_empty keeps tied embeddings tied
    model.init_weights(seed=spec.trainer.seed, buffer_device=device)
    model.train()
    if spec.trainer.compile:
        for block in model.layers.values():
            block.compile()
    o = spec.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=device.type == "cuda",
    )
    params = list(model.parameters())

    def step(batch) -> float:
        inputs = batch[0].to(device, non_blocking=True)
        labels = batch[1].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.trainer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step.params = _unique_params([model])  # type: ignore[attr-defined]
    return step


def _unique_params(parts) -> int:
    """Parameters the model really holds (shared tensors once; DTensors at their global size)."""
    seen, total = set(), 0
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def launcher_step_fn(spec, device, run_dir: Path) -> Callable:
    """The real launcher path: validate -> plan -> entry.engine_for_rank -> Engine.train_step."""
    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime.dist import RankInfo
    from launcher.runtime.entry import engine_for_rank

    plan = build_plan(spec, check(spec))
    engine = engine_for_rank(spec, plan, RankInfo(rank=0, world_size=1, local_rank=0, device=device), run_dir)

    def step(batch) -> float:
        return engine.train_step([batch]).loss

    step.engine = engine  # type: ignore[attr-defined]  # keeps it alive while timing
    parts = getattr(engine, "model_parts", None)
    step.params = _unique_params(parts) if parts else None  # type: ignore[attr-defined]
    return step


def launcher_wired() -> Optional[str]:
    """None when the native engine can be imported, else why the launcher rows cannot run."""
    try:
        import launcher.runtime.entry  # noqa: F401
        import launcher.engines.native  # noqa: F401
    except ImportError as err:
        return f"not wired: {err}"
    return None


def predicted_peak_bytes(spec) -> Optional[int]:
    """The planner's per-GPU peak for this job as the caching allocator sees it.

    Plan.memory["total"] minus its fixed `reserved` share (CUDA context, NCCL buffers), which
    torch.cuda.max_memory_allocated does not count; None when the planner gives no total.
    """
    try:
        from launcher.plan.present.plan import build_plan

        memory = build_plan(spec).memory
    except Exception as err:  # a planner gap must not hide the measurement
        print(f"warning: planner memory estimate unavailable: {err}", file=sys.stderr)
        return None
    total = memory.get("total")
    if not total:
        return None
    detail = memory.get("detail") or {}
    # max_memory_allocated sees neither the CUDA reserve nor the allocator's fragmentation.
    reserved = (detail.get("reserved", 0) or 0) + (detail.get("allocator_fragmentation", 0) or 0)
    return int(total) - int(reserved)


# ----------------------------------------------------------------------------- timing


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable, batches, warmup: int, device) -> Tuple[List[float], List[float]]:
    """Run warm-up then timed steps; returns (per-step seconds of the timed steps, all losses)."""
    losses, times = [], []
    for i, batch in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step(batch))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, losses


def profile_steps(step: Callable, batches, device, out_dir: Path, variant: str) -> None:
    """Run `batches` under torch.profiler; write the op/kernel table sorted by device time to
    out_dir/<variant>.txt and print its first rows to stderr (where the step time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for batch in batches:
            step(batch)
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / (variant.replace(" ", "_").replace("+", "plus") + ".txt")).write_text(table)
    print(f"   profile of {len(batches)} steps, by {key}:\n" + "\n".join(table.splitlines()[:20]),
          file=sys.stderr, flush=True)


def run_variant(v: Variant, s: Settings, batches, flops_per_token: float, peak_tflops: float) -> Result:
    import torch

    device = torch.device(s.device)
    compile_on = v.compile and s.compile
    res = Result(variant=v.name, compiled=compile_on)
    if v.path == "launcher":
        why = launcher_wired()
        if why:
            res.status = why
            return res
    spec = compose_job(s, v.precision, compile_on)
    res.predicted_mem_bytes = predicted_peak_bytes(spec)
    torch._dynamo.reset()  # each variant compiles its own model; no cache reuse across variants
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(s.seed)
    step = None
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as run_dir:
            if v.path == "reference":
                step = reference_step_fn(spec, device)
            else:
                step = launcher_step_fn(spec, device, Path(run_dir))
            res.params = getattr(step, "params", None)
            times, res.losses = time_steps(step, batches, s.warmup, device)
            if s.profile_dir:
                profile_steps(step, batches[-3:], device, Path(s.profile_dir), v.name)
    except Exception as err:  # one failing variant (OOM, no fp8 support) must not lose the others
        traceback.print_exc(file=sys.stderr)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        res.status = f"failed: {type(err).__name__}: {first_line[:200]}"
        return res
    finally:
        del step
        gc.collect()
    if device.type == "cuda":
        res.peak_mem_bytes = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.empty_cache()
    from launcher.plan.estimate.flops import achieved_tflops, mfu

    res.step_s = statistics.median(times)
    res.tokens_per_s = s.micro_batch * s.seq_len / res.step_s
    res.tflops = achieved_tflops(res.tokens_per_s, flops_per_token)
    if device.type == "cuda":  # a GPU peak means nothing for a CPU run
        res.mfu = mfu(res.tokens_per_s, flops_per_token, peak_tflops)
    return res


# ----------------------------------------------------------------------------- report


def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _gib(b: Optional[int]) -> str:
    return "n/a" if b is None else f"{b / 2**30:.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def ratios(results: List[Result]) -> Dict[str, Optional[float]]:
    """Launcher overhead (step-time ratio, bf16 + compile vs reference) and fp8 speed-up."""
    by = {r.variant: r for r in results if r.status == "ok"}
    ref, lb, lf = (by.get(n) for n in ("reference bf16 + compile", "launcher bf16 + compile", "launcher fp8 + compile"))
    return {
        "launcher_over_reference": lb.step_s / ref.step_s if lb and ref else None,
        "fp8_over_bf16_tokens": lf.tokens_per_s / lb.tokens_per_s if lf and lb else None,
    }


def environment() -> Dict[str, str]:
    import torch

    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = "not installed"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "torchao": torchao_version,
    }


def render_markdown(s: Settings, env: Dict[str, str], hw, params: int, flops_per_token: float,
                    results: List[Result]) -> str:
    mode = "smoke (CPU harness check, numbers are not GPU results)" if s.device != "cuda" else "GPU"
    lines = [
        f"### gpu_throughput: {env['date']}, {env['gpu']}",
        "",
        f"- mode: {mode}; torch {env['torch']} (CUDA {env['cuda']}), torchao {env['torchao']}",
        f"- model `{s.model}` ({_count(params)} params), seq {s.seq_len}, micro-batch {s.micro_batch}, "
        f"{s.steps} timed steps after {s.warmup} warm-up; FLOPs/token {flops_per_token / 1e9:.3f} G "
        f"(launcher.plan.estimate.flops: 6N + 12·L·h·s)",
        *([f"- overrides: `{' '.join(s.extra)}`"] if s.extra else []),
        f"- MFU against the dense BF16 peak of conf/hardware/{hw.name}.yaml: {hw.bf16_tflops:g} TFLOP/s "
        f"(fp8 rows too; the FP8 peak is {hw.fp8_tflops:g})",
        "",
        "| variant | compile | tokens/s | step ms | TFLOP/s | MFU | peak mem GiB | planner GiB | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.variant} | {'yes' if r.compiled else 'no'} | {_fmt(r.tokens_per_s, ',.0f')} | "
            f"{_fmt(None if r.step_s is None else r.step_s * 1e3, '.1f')} | {_fmt(r.tflops, '.1f')} | "
            f"{_fmt(None if r.mfu is None else 100 * r.mfu, '.1f')}{'%' if r.mfu is not None else ''} | "
            f"{_gib(r.peak_mem_bytes)} | {_gib(r.predicted_mem_bytes)} | {r.status} |"
        )
    for r in results:
        if r.params is not None and r.params != params:
            lines.append(f"\n**warning**: {r.variant} trains {_count(r.params)} parameters; the model shape "
                         f"has {_count(params)} (tie_embeddings={s.tied}): its numbers are not comparable.")
    rt = ratios(results)
    lines += [
        "",
        f"- launcher / reference step time (bf16 + compile): {_fmt(rt['launcher_over_reference'], '.3f')} (target <= 1.03)",
        f"- fp8 / bf16 tokens/s (launcher, compiled): {_fmt(rt['fp8_over_bf16_tokens'], '.2f')} (target >= 1.25)",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    s = settings_from_args(args)
    s.hardware = hardware_name(args.hardware, s.device)
    hw = load_hardware(s.hardware)
    variants = select_variants(args.variants)

    import torch

    from launcher.plan.estimate.flops import param_counts, training_flops_per_token

    base = compose_job(s, "bf16", False)
    s.tied = bool(base.model.tie_embeddings)
    flops_per_token = training_flops_per_token(base.model, s.seq_len)
    params = param_counts(base.model).total
    batches = make_batches(s, base.model.vocab_size, s.warmup + s.steps)
    if any(v.path == "launcher" for v in variants) and launcher_wired() is None:
        ensure_process_group(s.device)

    results = []
    for v in variants:
        t0 = time.perf_counter()
        print(f"== {v.name} ...", file=sys.stderr, flush=True)
        results.append(run_variant(v, s, batches, flops_per_token, hw.bf16_tflops))
        r = results[-1]
        print(f"   {r.status} in {time.perf_counter() - t0:.1f} s: tokens/s {_fmt(r.tokens_per_s, ',.0f')}, "
              f"peak {_gib(r.peak_mem_bytes)} GiB", file=sys.stderr, flush=True)

    text = render_markdown(s, environment(), hw, params, flops_per_token, results)
    print(text)
    if args.append:
        args.append.parent.mkdir(parents=True, exist_ok=True)
        with args.append.open("a") as f:
            f.write("\n" + text)
    if args.json:
        payload = {"settings": asdict(s), "environment": environment(), "flops_per_token": flops_per_token,
                   "params": params, "results": [asdict(r) for r in results], "ratios": ratios(results)}
        args.json.write_text(json.dumps(payload, indent=2))
    if torch.distributed.is_initialized():
        from launcher.runtime.dist import shutdown_distributed

        shutdown_distributed()
    return 0 if all(r.status == "ok" or r.status.startswith("not wired") for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # run as a script from a checkout
    sys.exit(main())
