"""Export a model far larger than its largest tensor from 2 ranks, measuring each rank's peak
host memory during the export (tests/test_export_stream.py).

Usage: python -m torch.distributed.run --standalone --nproc_per_node=2 \
    tests/export_harness/run_export.py OUT_DIR RESULTS.json

For each layout (dp_shard=2, pp=2) and format (fp32, safetensors): the peak resident memory
(VmHWM, reset through /proc/self/clear_refs just before the export) minus the resident memory
before it, per rank; and whether every rank's own shard equals the file's values exactly.
"""

from __future__ import annotations

import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.runtime.dist import exit_after_shutdown

# A model whose fp32 state (about 200 MB) is 50x its largest tensor (4 MB: a 2048x512 matrix).
OVERRIDES = dict(dim=512, n_heads=8, n_kv_heads=8, ffn_dim=2048, vocab_size=2048, n_layers=12)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _engine(mesh: dict):
    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from tests.layout_for import layout_for
    from tests.parallel_harness.run_layouts import model_config

    cfg = replace(model_config("debug"), **OVERRIDES)
    layout = layout_for(cfg, 2, **{f"parallel.{k}": v for k, v in mesh.items()})
    return NativeEngine(cfg, OptimConfig(lr=1e-3, warmup_steps=0), layout, torch.device("cpu"),
                        EngineOptions(total_steps=1, seed=11))


def _check_file(parts, path: Path, fmt: str) -> dict:
    """Every tensor this rank holds equals the file's values at its box (no gather needed)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from launcher.models.init import local_box

    if fmt == "fp32":
        sd = torch.load(path, mmap=True)
        read = lambda name, box: sd[name][tuple(slice(a, b) for a, b in box)]  # noqa: E731
        names = set(sd)
    else:
        from safetensors import safe_open

        fh = safe_open(str(path), framework="pt")
        read = lambda name, box: fh.get_slice(name)[tuple(slice(a, b) for a, b in box)]  # noqa: E731
        names = set(fh.keys())
    mine, bad = set(), []
    for part in parts:
        for name, t in get_model_state_dict(part).items():
            mine.add(name)
            local, box = local_box(t)
            if name not in names or not torch.equal(read(name, box), local.detach().cpu()):
                bad.append(name)
    return {"names_in_file": sorted(names), "names_held": sorted(mine), "mismatched": bad}


def main() -> int:
    out_dir, results_path = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Warm-up: the writers' first use imports modules (fake tensors, safetensors): not the export's cost.
    from launcher.hf.export import write_state_dict

    write_state_dict({"w": torch.zeros(4)}, out_dir / f"warmup{rank}.pt", "fp32")
    write_state_dict({"w": torch.zeros(4)}, out_dir / f"warmup{rank}.safetensors", "safetensors")
    results = {}
    for lname, mesh in (("fsdp2", {"dp_shard": 2}), ("pp2", {"pp": 2})):
        engine = _engine(mesh)
        sd = {n: t for part in engine.model_parts for n, t in part.state_dict().items()}
        held = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * 4 for t in sd.values())
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, {n: t.numel() * 4 for n, t in sd.items()})  # full sizes
        full_bytes = {n: b for d in stages for n, b in d.items()}
        del sd
        for fmt in ("fp32", "safetensors"):
            path = out_dir / f"{lname}.{'pt' if fmt == 'fp32' else 'safetensors'}"
            gc.collect()
            dist.barrier()
            before = _kib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
            engine.export(path, fmt)
            growth = (_kib("VmHWM") - before) * 1024
            check = _check_file(engine.model_parts, path, fmt)
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, {"peak_growth_bytes": growth, "held_bytes": held, **check})
            results[f"{lname}_{fmt}"] = {"per_rank": per_rank, "model_bytes": sum(full_bytes.values()),
                                         "largest_tensor_bytes": max(full_bytes.values()),
                                         "tmp_left": sorted(p.name for p in out_dir.glob("*.tmp"))}
        del engine
        gc.collect()
    if rank == 0:
        results_path.write_text(json.dumps(results, indent=1))
    exit_after_shutdown()


if __name__ == "__main__":
    sys.exit(main())
