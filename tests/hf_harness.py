"""Load tiny Hugging Face models into the native engine in several layouts, in one process group.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=N tests/hf_harness.py JOBS.json OUT.json

Each job: {"name", "folder" (a save_pretrained folder), "mesh" {dp_shard, tp, pp, ep}, "train_steps",
"export_dtype", "export_dir", optional "reference" (the folder transformers loads instead, e.g. the
dequantized weights of an FP8 folder)}. Per job the engine is built from the resolver's Layout with
model.init_from=folder; rank 0 records the largest |our logits - transformers' logits| right after
loading, and (train_steps > 0) after training: the same difference against the model transformers
loads from our checkpoint.export=hf folder. Every job also exports, so the test can compare the
files with the source byte for byte.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQ = 16


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))


def hf_logits(folder: str, toks: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(toks).logits


def our_logits(engine, toks: torch.Tensor) -> torch.Tensor:
    """Full logits on every rank of the engine's model (plain forward, pipeline by hand)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if engine.pp_schedule is None:
            out = engine.parts[0](toks)
            return out.full_tensor() if isinstance(out, DTensor) else out
        pp = engine.world["pp"]
        group, me = pp.get_group(), pp.get_local_rank()
        h = toks
        if me > 0:
            h = torch.empty(2, SEQ, engine.model_cfg.dim)
            dist.recv(h, src=dist.get_global_rank(group, me - 1), group=group)
        h = engine.parts[0](h)
        if me < pp.size() - 1:
            dist.send(h.contiguous(), dst=dist.get_global_rank(group, me + 1), group=group)
            logits = torch.empty(2, SEQ, engine.model_cfg.vocab_size)
        else:
            logits = h.full_tensor() if isinstance(h, DTensor) else h
        dist.broadcast(logits, src=dist.get_global_rank(group, pp.size() - 1), group=group)
        return logits


def microbatches(vocab: int, step: int, dp_rank: int, dp: int):
    g = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(0, vocab, (4, SEQ + 1), generator=g)
    per = 4 // dp
    mine = seq[dp_rank * per:(dp_rank + 1) * per]
    return [(mine[i:i + 1, :-1], mine[i:i + 1, 1:]) for i in range(per)]


def _source_tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def run_job(job: dict) -> dict:
    from launcher.config.hf_model import hf_model_fields
    from launcher.hf.format import read_hf_config
    from launcher.config.schema import ModelConfig, OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from launcher.plan.decide.resolve import resolve
    from tests.layout_for import job_spec

    folder = job["folder"]
    reference = job.get("reference", folder)
    cfg = ModelConfig(name="hf", init_from=folder, **hf_model_fields(read_hf_config(folder)))
    mesh = {"dp_shard": 1, "tp": 1, "pp": 1, "ep": 1} | job["mesh"]
    dotted = {f"parallel.{k}": v for k, v in mesh.items()}
    dotted["optim.warmup_steps"] = 0
    if job.get("backend") == "deepspeed":
        dotted.update({"backend.default": "deepspeed", "parallel.zero_stage": job.get("zero_stage", 3)})
    layout = resolve(job_spec(cfg, dist.get_world_size(), **dotted))
    steps = job.get("train_steps", 0)
    options = EngineOptions(total_steps=max(steps, 1), export_dtype=job["export_dtype"])
    toks = tokens(cfg.vocab_size)
    if job.get("backend") == "deepspeed":
        from launcher.engines import build_engine

        engine = build_engine(cfg, OptimConfig(lr=1e-2, warmup_steps=0), layout, torch.device("cpu"), options)
        with torch.no_grad():
            ours = engine.model_parts[0](toks)  # ZeRO-3 gathers each block's parameters in forward
        result = {"built": engine.built()}
        if dist.get_rank() == 0:
            result["load_max_diff"] = float((ours - hf_logits(reference, toks)).abs().max())
        return result
    engine = NativeEngine(cfg, OptimConfig(lr=1e-2, warmup_steps=0), layout, torch.device("cpu"), options)
    result = {"built": engine.built()}
    # Loading again (same values) to count what each rank fetched from disk.
    from launcher.hf.weights import load_hf_weights

    read = [None] * dist.get_world_size()
    dist.all_gather_object(read, load_hf_weights(engine.parts, folder, cfg))
    result["elements_read"] = read
    result["model_elements"] = sum(v.numel() for v in _source_tensors(folder).values())
    ours = our_logits(engine, toks)
    if dist.get_rank() == 0:
        result["load_max_diff"] = float((ours - hf_logits(reference, toks)).abs().max())
    if steps:
        dp_rank = engine.world["dp_shard"].get_local_rank()
        dp = engine.world["dp_shard"].size()
        for step in range(steps):
            result.setdefault("losses", []).append(engine.train_step(microbatches(cfg.vocab_size, step, dp_rank, dp)).loss)
        ours = our_logits(engine, toks)
    engine.export(Path(job["export_dir"]), "hf")
    if steps and dist.get_rank() == 0:
        result["export_max_diff"] = float((ours - hf_logits(str(Path(job["export_dir"]) / "hf"), toks)).abs().max())
        result["weights_moved"] = float((ours - hf_logits(reference, toks)).abs().max())
    return result


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    results = {}
    for job in jobs:
        try:
            results[job["name"]] = run_job(job)
        except Exception:
            results[job["name"]] = {"error": traceback.format_exc()[-3000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
    from launcher.runtime.dist import exit_after_shutdown

    exit_after_shutdown()  # gloo's abort at exit: PLATFORM.md "Gotchas seen"


if __name__ == "__main__":
    main()
