"""What one real block keeps for its backward, eager vs torch.compile, per activation-checkpointing mode.

    PYTHONPATH=$PWD .venv/bin/python bench/compiled_block_activations.py [--model llama_1b] [--seq 512]

One block of the model (its real weights' shapes, bf16 parameters and input as under FSDP's mixed
precision, bf16 autocast on; `--precision fp32`: fp32, no autocast), wrapped and compiled by the
runtime's own functions in the runtime's order (launcher/engines/native.py:
apply_activation_checkpointing, then apply_compile, which compiles the checkpoint-wrapped block).
Modes: none, full, op, op_alternate_mm; each eager and compiled, each in a fresh process (after a
forward and backward of warm-up, so compilation and the first gradients are done; the
parameters' .grad stay allocated, as in training).

Measured with the CPU allocator's own accounting (torch.profiler, profile_memory: every allocation
and free, inductor's buffers included, whatever holds them: autograd's saved tensors,
checkpoint's selective-AC cache, a compiled graph's saved outputs):
- saved: bytes allocated after the forward returns, minus before it, minus the block's output
  (what stays alive between the block's forward and its backward);
- backward peak: the highest allocation during the backward over the level before it (the
  recomputed tensors, the activation gradients, and the weight gradients before they are
  accumulated into .grad: a constant, so per token it shrinks with the tokens; compare lengths).
Both are printed per token (batch x seq). Prints a markdown table; not a test itself:
tests/test_plan_memory.py holds the planner's compile term to `measure` on the debug block, and
docs/planner.md ("Activations") quotes llama_1b's numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("none", "full", "op", "op_alternate_mm")


def _block_model(model_name: str, dtype):
    """The model with one block (its own config otherwise), parameters in `dtype`, on CPU."""
    import dataclasses as dc

    import torch

    from launcher.config.loader import compose_spec
    from launcher.models import build_model

    cfg = dc.replace(compose_spec([f"model={model_name}"]).model, n_layers=1, vocab_size=256)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return cfg, model


def _allocation_curve(prof) -> list:
    """(time, bytes allocated since the profile began) after every allocation or free."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    level, curve = 0, []
    for start, nbytes in events:
        level += nbytes
        curve.append((start, level))
    return curve


def measure(model_name: str, mode: str, compiled: bool, batch: int, seq: int, precision: str = "bf16") -> dict:
    """Saved bytes and backward peak of one block (see the module docstring), in this process."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from launcher.parallel.ac import apply_activation_checkpointing
    from launcher.parallel.compile import apply_compile

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    cfg, model = _block_model(model_name, dtype)
    if mode == "full":
        apply_activation_checkpointing(model, "full")
    elif mode != "none":
        apply_activation_checkpointing(model, "selective", mode)
    if compiled:
        apply_compile(model)
    block, rope = model.layers["0"], model.rope
    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = block(x, rope)
        return out

    for _ in range(2):  # compile, allocate .grad
        step().backward(torch.ones(batch, seq, cfg.dim, dtype=dtype))
    x.grad = None
    grad_out = torch.ones(batch, seq, cfg.dim, dtype=dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("block_forward"):
            out = step()
        with record_function("block_backward"):
            out.backward(grad_out)
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
              if e.name() in ("block_forward", "block_backward")}
    curve = _allocation_curve(prof)
    fwd_end, (bwd_start, bwd_end) = ranges["block_forward"][1], ranges["block_backward"]
    after_fwd = ([0] + [lvl for t, lvl in curve if t <= fwd_end])[-1]
    in_bwd = [lvl for t, lvl in curve if bwd_start <= t <= bwd_end]
    out_bytes = out.untyped_storage().nbytes()
    tokens = batch * seq
    return {"model": model_name, "precision": precision, "mode": mode, "compiled": compiled, "tokens": tokens,
            "saved_per_token": (after_fwd - out_bytes) / tokens,
            "backward_peak_per_token": (max(in_bwd, default=after_fwd) - after_fwd) / tokens,
            "dim": cfg.dim, "ffn_dim": cfg.ffn_dim}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama_1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: bf16 parameters and input under bf16 autocast; fp32: fp32, no autocast")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "COMPILED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        mode, compiled = args.one[0], args.one[1] == "1"
        print(json.dumps(measure(args.model, mode, compiled, args.batch, args.seq, args.precision)))
        return
    rows = []
    for mode in args.modes.split(","):
        for compiled in (False, True):
            cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--precision", args.precision, "--one", mode, "1" if compiled else "0"]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if res.returncode != 0:
                raise SystemExit(f"{mode} compiled={compiled} failed:\n{res.stderr[-3000:]}")
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    numerics = "bf16 parameters, bf16 autocast" if args.precision == "bf16" else "fp32, no autocast"
    print(f"\n{args.model} block, batch {args.batch} x seq {args.seq}, {numerics}, CPU "
          f"(h {rows[0]['dim']}, f {rows[0]['ffn_dim']}); bytes per token")
    print("| AC mode | eager saved | compiled saved | eager backward peak | compiled backward peak |")
    print("|---|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        e, c = [r for r in rows if r["mode"] == mode]
        print(f"| {mode} | {e['saved_per_token']:,.0f} | {c['saved_per_token']:,.0f} | "
              f"{e['backward_peak_per_token']:,.0f} | {c['backward_peak_per_token']:,.0f} |")


if __name__ == "__main__":
    main()
