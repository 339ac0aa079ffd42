"""Load tiny Hugging Face models into the native engine in several layouts, in one process group.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=N tests/hf_harness.py JOBS.json OUT.json

Each job: {"name", "folder" (a save_pretrained folder), "mesh" {dp_shard, tp, pp, ep}, "train_steps",
"export_dtype", "export_dir", optional "reference" (the folder transformers loads instead, e.g. the
dequantized weights of an FP8 folder), "model" (ModelConfig fields on top of the folder's), and for
DeepSpeed "backend": "deepspeed", "zero_stage", "precision" (see deepspeed_job)}. Per job the engine is built from the resolver's Layout with
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


def global_batch(vocab: int, step: int) -> torch.Tensor:
    """The step's 4 sequences of SEQ + 1 tokens (inputs and shifted labels)."""
    return torch.randint(0, vocab, (4, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def microbatches(vocab: int, step: int, dp_rank: int, dp: int):
    seq = global_batch(vocab, step)
    per = 4 // dp
    mine = seq[dp_rank * per:(dp_rank + 1) * per]
    return [(mine[i:i + 1, :-1], mine[i:i + 1, 1:]) for i in range(per)]


def hf_step_loss(folder: str, vocab: int, step: int) -> float:
    """transformers' mean token loss over the step's global batch."""
    from transformers import AutoModelForCausalLM

    seq = global_batch(vocab, step)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(seq[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), seq[:, 1:].reshape(-1)))


def correction_biases(module) -> list:
    """(our name, HF name, buffer) of DeepSeek-V3's router correction biases in `module`: our
    layers.<i>.moe.e_score_correction_bias is transformers' model.layers.<i>.mlp.gate.e_score_correction_bias."""
    out = []
    for name, b in module.named_buffers():
        if name.endswith("moe.e_score_correction_bias"):
            layer = name.split("layers.")[1].split(".")[0]
            out.append((f"layers.{layer}.moe.e_score_correction_bias",
                        f"model.layers.{layer}.mlp.gate.e_score_correction_bias", b))
    return out


def deepspeed_job(job: dict, cfg, layout, options, toks) -> dict:
    """A DeepSpeed engine loaded from job["folder"]: logits vs transformers, the router correction
    biases vs the folder's (value and float32), and with train_steps the first step's loss vs
    transformers', then a safetensors export whose biases are the trained ones."""
    from launcher.config.schema import OptimConfig
    from launcher.engines import build_engine

    folder = job["folder"]
    engine = build_engine(cfg, OptimConfig(lr=1e-2, warmup_steps=0), layout, torch.device("cpu"), options)
    module = engine.model_parts[0]
    with torch.no_grad():
        ours = module(toks)  # ZeRO-3 gathers each block's parameters in forward
    result = {"built": engine.built()}
    source = _source_tensors(folder)
    biases = correction_biases(module)
    # Every rank's copy (buffers are whole on each rank): the folder's values, bit for bit, in float32.
    result["bias_names_match"] = sorted(h for _, h, _ in biases) == sorted(
        n for n in source if n.endswith("e_score_correction_bias"))
    result["bias_exact_fp32"] = all(b.dtype == torch.float32 and torch.equal(b, source[h]) for _, h, b in biases)
    flags = torch.tensor([result["bias_names_match"] and result["bias_exact_fp32"]], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    result["bias_loaded_on_every_rank"] = bool(flags)
    if dist.get_rank() == 0 and job.get("precision", "fp32") == "fp32":
        result["load_max_diff"] = float((ours - hf_logits(folder, toks)).abs().max())
    steps = job.get("train_steps", 0)
    if steps:
        losses = [engine.train_step(microbatches(cfg.vocab_size, step, dist.get_rank(), dist.get_world_size())).loss
                  for step in range(steps)]
        result["losses"] = [float(x) for x in losses]
        export = Path(job["export_dir"]) / "model.safetensors"
        engine.export(export, "safetensors")
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            result["first_loss_hf"] = hf_step_loss(folder, cfg.vocab_size, 0)
            written = load_file(str(export))
            result["bias_moved"] = max((float((b - source[h]).abs().max()) for _, h, b in biases), default=0.0)
            # The names the native engine's export writes (get_model_state_dict): parameters and persistent buffers.
            result["export_names_are_the_state_dicts"] = sorted(written) == sorted(module.state_dict())
            result["export_has_biases"] = all(n in written for n, _, _ in biases)
            result["export_bias_max_diff"] = max((float((written[n] - b).abs().max()) for n, _, b in biases
                                                  if n in written), default=0.0)
    return result


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
    cfg = ModelConfig(name="hf", init_from=folder, **hf_model_fields(read_hf_config(folder)),
                      **job.get("model", {}))
    mesh = {"dp_shard": 1, "tp": 1, "pp": 1, "ep": 1} | job["mesh"]
    dotted = {f"parallel.{k}": v for k, v in mesh.items()}
    dotted["optim.warmup_steps"] = 0
    if job.get("backend") == "deepspeed":
        dotted.update({"backend.default": "deepspeed", "parallel.zero_stage": job.get("zero_stage", 3),
                       "precision.name": job.get("precision", "fp32")})
    layout = resolve(job_spec(cfg, dist.get_world_size(), **dotted))
    steps = job.get("train_steps", 0)
    options = EngineOptions(total_steps=max(steps, 1), export_dtype=job["export_dtype"])
    toks = tokens(cfg.vocab_size)
    if job.get("backend") == "deepspeed":
        return deepspeed_job(job, cfg, layout, options, toks)
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
