"""MoE experts on one GPU: grouped GEMM vs the per-expert loop, and fp8 experts vs bf16.

    python bench/gpu_moe.py                 # CUDA; Mixtral-8x7B expert shapes, 8192 tokens
    python bench/gpu_moe.py --smoke         # CPU, small shapes (checks the harness; no fp8)

One MoE layer of the launcher (launcher.models.moe.MoE: router, top-k, GroupedExperts) under
bf16 autocast, fed the same tokens and the same output gradient in every variant:

    loop       GroupedExperts.implementation = "loop" (one matmul pair per expert)
    grouped    torch._grouped_mm (the default where it runs; launcher/models/grouped_mm.py)
    fp8        grouped, after launcher.parallel.fp8.convert_experts_to_float8 (torchao's rowwise
               fp8 grouped GEMM; CUDA compute capability >= 8.9 only)

Reports, per variant, the relative error of the layer's output and of the expert weights'
gradients against the loop (bf16 rounding and fp8 quantisation are expected to show), and the
median forward+backward time over --steps after --warmup; the ratios (loop / grouped,
grouped / fp8) are the comparison, measured in one run.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import statistics
import sys
import time
from pathlib import Path
from typing import Dict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run(device: str, dim: int, hidden: int, experts: int, top_k: int, tokens: int, warmup: int,
        steps: int) -> Dict[str, Dict]:
    import torch

    from launcher.models.moe import MoE
    from launcher.parallel.fp8 import convert_experts_to_float8, device_compute_capability, fp8_experts_skip_reason

    torch.manual_seed(0)
    dev = torch.device(device)
    base = MoE(dim, hidden, experts, top_k).to(dev)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0.0, 0.02)
    x = torch.randn(tokens, dim, device=dev)
    grad_out = torch.randn(tokens, dim, device=dev)

    variants = {"loop": "loop", "grouped": "auto"}
    cc = device_compute_capability(dev.type)
    fp8_skip = fp8_experts_skip_reason(base.experts, dev.type, cc)
    if fp8_skip is None:
        variants["fp8"] = "auto"
    results: Dict[str, Dict] = {}
    ref = None
    for name, impl in variants.items():
        layer = copy.deepcopy(base)
        layer.experts.implementation = impl
        if name == "fp8":
            converted = convert_experts_to_float8(layer, device_type=dev.type, compute_capability=cc)
            assert converted, "convert_experts_to_float8 converted nothing"
        xin = x.clone().requires_grad_(True)

        def step():
            layer.zero_grad(set_to_none=True)
            xin.grad = None
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = layer(xin.unsqueeze(0)).squeeze(0)
            out.backward(grad_out.to(out.dtype))
            return out

        out = step()
        got = {"out": out.detach().float(), "x_grad": xin.grad.float()}
        for w in ("w1", "w2", "w3"):
            got[w] = getattr(layer.experts, w).grad.float()
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if ref is None:
            ref = got
        results[name] = {"ms": 1e3 * statistics.median(times),
                         **{f"err_{k}": _rel(v, ref[k]) for k, v in got.items()}}
        del layer
    if fp8_skip is not None:
        results["fp8"] = {"skipped": fp8_skip}
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    import torch

    if args.smoke:
        device, shape = "cpu", dict(dim=64, hidden=96, experts=4, top_k=2, tokens=256)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device. Fix: run on a GPU machine, or --smoke on the CPU.")
        # Mixtral-8x7B's expert shapes (conf/model/mixtral_8x7b.yaml), one layer.
        device, shape = "cuda", dict(dim=4096, hidden=14336, experts=8, top_k=2, tokens=args.tokens)
    res = run(device, warmup=args.warmup if not args.smoke else 1, steps=args.steps if not args.smoke else 2, **shape)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    print(f"### gpu_moe: {_dt.date.today().isoformat()}, {where}, torch {torch.__version__}")
    print(f"- one MoE layer, {shape}, bf16 autocast; errors relative to the loop")
    print("\n| variant | fwd+bwd ms | out err | x grad err | w1 grad err | w2 grad err | w3 grad err |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in res.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} ||||||")
            continue
        print(f"| {name} | {r['ms']:.2f} | {r['err_out']:.2e} | {r['err_x_grad']:.2e} | {r['err_w1']:.2e} | "
              f"{r['err_w2']:.2e} | {r['err_w3']:.2e} |")
    if "ms" in res.get("grouped", {}):
        print(f"\n- loop / grouped time: {res['loop']['ms'] / res['grouped']['ms']:.2f}")
        if "ms" in res.get("fp8", {}):
            print(f"- grouped bf16 / fp8 time: {res['grouped']['ms'] / res['fp8']['ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
