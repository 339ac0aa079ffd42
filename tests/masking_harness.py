"""Packed micro-batches with document masking, and the multi-rank runs of tests/test_document_masking.py.

Usage (2 ranks, gloo; every layout in the file uses 2 ranks):
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/masking_harness.py LAYOUTS.json OUT.json

Per layout (keys: name, model, overrides {model.* keys}, mesh {parallel.* degrees}, sp, pp_schedule, dotted
{other config keys}) the native engine is built from the
real resolver's Layout and given the same packed batch as the 1-rank reference in the test:
- `logits_max_diff`: the engine's logits of the packed rows (document masking, positions reset at
  each document) vs each document run alone through a plain 1-rank model with the same weights;
- `eval`: eval_stats (loss, per-source loss); `train`: one train_step (loss, grad norm, per-source
  loss), compared by the test with a 1-rank engine on the same batch.
A layout that raises is recorded as {"error": ...} and the next one still runs.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import List, Tuple

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROWS, SEQ, SEED = 4, 16, 7
# Document lengths of each packed row (each sums to SEQ): short, long and single-document rows.
DOC_LENGTHS = ([5, 7, 4], [16], [1, 9, 6], [8, 8])
SOURCES = (0, 2, 1, 0)  # mixture source of each row (source 1 and 2 once each, 0 twice)


def packed_rows(vocab: int, seed: int = 0):
    """(documents per row, Microbatch per row): each row packs its documents back to back with
    document ids 0, 1, ... and positions restarting at 0 at each document; labels are the next
    token in the packed row (the first token of the next document after a boundary)."""
    from launcher.data.batch import Microbatch

    g = torch.Generator().manual_seed(seed)
    docs, mbs = [], []
    for row, lengths in enumerate(DOC_LENGTHS):
        row_docs = [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]
        stream = torch.cat(row_docs + [torch.randint(0, vocab, (1, 1), generator=g)], dim=1)
        ids = torch.cat([torch.full((1, n), i, dtype=torch.int32) for i, n in enumerate(lengths)], dim=1)
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        docs.append(row_docs)
        mbs.append(Microbatch(inputs=stream[:, :-1], labels=stream[:, 1:], positions=pos, document_ids=ids,
                              sources=torch.tensor([SOURCES[row]])))
    return docs, mbs


def reference_logits(model, docs: List[List[torch.Tensor]]) -> torch.Tensor:
    """[ROWS, SEQ, vocab]: every document run alone (plain causal attention, positions 0..n-1)."""
    with torch.no_grad():
        return torch.cat([torch.cat([model(d) for d in row], dim=1) for row in docs], dim=0)


def plain_model(cfg, seed: int = SEED):
    """The 1-rank model with the engine's layout-independent initial weights."""
    from launcher.models import build_model

    with torch.device("meta"):
        m = build_model(cfg)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m


def native_engine(cfg, world: int, **dotted):
    """The native engine on this harness's layout (`dotted`: config overrides layout_for applies)."""
    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from tests.layout_for import layout_for

    layout = layout_for(cfg, world, **dotted)
    options = EngineOptions(total_steps=10, grad_clip=1.0, seed=SEED, n_sources=3, compile=layout.compile)
    return NativeEngine(cfg, OptimConfig(lr=3e-3, warmup_steps=1), layout, torch.device("cpu"), options)


def engine_logits(engine, mbs) -> Tuple[bool, torch.Tensor]:
    """(holds logits, logits [ROWS, SEQ, vocab]) of the engine's model parts on the packed rows."""
    with torch.no_grad():
        if engine.pp_schedule is not None:
            engine._token_norm = 1.0
            _, out = engine._run_pipeline("eval", mbs)
            return engine.has_last, out
        outs = []
        for mb in mbs:
            if engine.mesh_plan.cp > 1:
                outs.append(_context_parallel_logits(engine, mb))
                continue
            y = engine.parts[0](mb.inputs, positions=mb.positions, document_ids=mb.document_ids)
            outs.append(y.full_tensor() if hasattr(y, "full_tensor") else y)
        return True, torch.cat(outs)


def _context_parallel_logits(engine, mb) -> torch.Tensor:
    """The whole row's logits under all-gather context parallelism: each cp rank computes its
    balanced slice (as the engine's forward does: per document when the row has documents), the
    slices are gathered and put back in sequence order."""
    from launcher.engines.base import model_kwargs
    from launcher.parallel.cp import to_sequence_order

    cp = engine.world["cp"]
    inputs, labels, kwargs = engine.context_parallel_slice(mb.inputs, mb.labels, model_kwargs(mb, torch.device("cpu")),
                                                           mb.document_ids)
    y = engine.parts[0](inputs, **kwargs)
    y = (y.full_tensor() if hasattr(y, "full_tensor") else y).contiguous()
    parts = [torch.empty_like(y) for _ in range(cp.size())]
    dist.all_gather(parts, y, group=cp.get_group())
    return to_sequence_order(torch.cat(parts, dim=1), kwargs["keys"].key_index)


def layout_model_cfg(spec: dict):
    """The model of a layout entry: conf/model/<model>.yaml (or "deepseek_v3_tiny", the DeepSeek-V3
    test model with one dense and one MoE block) with the entry's "overrides"."""
    from dataclasses import replace

    from launcher.config.schema import ModelConfig
    from tests.test_models import model_cfg

    if spec["model"] == "deepseek_v3_tiny":
        from tests.test_deepseek_v3 import TINY

        cfg = ModelConfig(**{**TINY, "n_layers": 2})
    else:
        cfg = model_cfg(spec["model"])
    return replace(cfg, **spec.get("overrides", {}))


def rank_rows(layout, items: list) -> list:
    """This rank's share of the batch's rows (or of any per-row list): data-parallel rank r of dp
    takes the r-th contiguous slice; TP, PP and CP ranks of one replica take the same rows."""
    c = layout.mesh.coordinates(dist.get_rank())
    dp_rank = c["dp_replicate"] * layout.mesh.dp_shard + c["dp_shard"]
    per = len(items) // layout.mesh.dp
    return items[dp_rank * per:(dp_rank + 1) * per]


def run_deepspeed(spec: dict, cfg) -> dict:
    """The DeepSpeed engine on the packed batch: rank r of dp ranks takes its share of the rows.
    spec["masking"] false: the rows without positions/ids (sources only). A step the engine
    refuses is recorded as {"refused": message}."""
    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.deepspeed import DeepSpeedEngine
    from tests.layout_for import layout_for

    layout = layout_for(cfg, dist.get_world_size(), **spec["dotted"])
    options = EngineOptions(total_steps=10, grad_clip=1.0, seed=SEED, n_sources=3)
    engine = DeepSpeedEngine(cfg, OptimConfig(lr=3e-3, warmup_steps=1), layout, torch.device("cpu"), options)
    _, mbs = packed_rows(cfg.vocab_size)
    if not spec.get("masking", True):
        mbs = [mb._replace(positions=None, document_ids=None) for mb in mbs]
    mine = rank_rows(layout, mbs)
    out = {"layout": {"sharding": layout.owners.sharding_backend, "pp": layout.owners.pp_backend, "ac": layout.owners.ac_backend}}
    try:
        ev = engine.eval_stats(mine)
        st = engine.train_step(mine)
    except RuntimeError as e:
        return {**out, "refused": str(e)}
    return {**out, "eval": {"loss": ev.loss, "tokens": ev.tokens, "source_loss": ev.source_loss},
            "train": {"loss": st.loss, "grad_norm": st.grad_norm, "source_loss": st.source_loss}}


def run_layout(spec: dict) -> dict:
    cfg = layout_model_cfg(spec)
    if spec.get("kind") == "deepspeed":
        return run_deepspeed(spec, cfg)
    dotted = {f"parallel.{k}": v for k, v in spec["mesh"].items()}
    dotted.update({"parallel.sp": spec.get("sp", False), "parallel.pp_schedule": spec.get("pp_schedule", "1f1b")})
    dotted.update(spec.get("dotted", {}))
    engine = native_engine(cfg, dist.get_world_size(), **dotted)
    docs, mbs = packed_rows(cfg.vocab_size)
    docs, mbs = rank_rows(engine.layout, docs), rank_rows(engine.layout, mbs)
    holds, logits = engine_logits(engine, mbs)
    diff = float((logits - reference_logits(plain_model(cfg), docs)).abs().max()) if holds else None
    diffs = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    ev = engine.eval_stats(mbs)
    st = engine.train_step(mbs)
    return {"logits_max_diff": [d for d in diffs if d is not None],
            "eval": {"loss": ev.loss, "tokens": ev.tokens, "source_loss": ev.source_loss},
            "train": {"loss": st.loss, "grad_norm": st.grad_norm, "source_loss": st.source_loss}}


def main() -> int:
    specs = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    results = {}
    for spec in specs:
        try:
            results[spec["name"]] = run_layout(spec)
        except Exception as e:  # record, keep going: one broken layout must not hide the rest
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
    from launcher.runtime.dist import exit_after_shutdown

    exit_after_shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
