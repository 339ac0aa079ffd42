"""Train the debug models in several parallel layouts, one after another, in one process group.

Usage (N ranks; every layout in the file must use N ranks):
    python -m torch.distributed.run --standalone --nproc_per_node=N \
        tests/parallel_harness/run_layouts.py LAYOUTS.json RESULTS.json
or, for 1-rank layouts, plain ``python tests/parallel_harness/run_layouts.py ...`` (no
process group). Rank 0 writes {name: {"losses": [...], "grad_norms": [...], "aux": [...]}}.
A layout that raises is recorded as {"error": "..."} and the next one still runs.

Layout keys: name, model (debug | debug_moe), mesh {pp, dp_replicate, dp_shard, cp, tp, ep},
sp, pp_schedule, pp_virtual_stages, pp_layers, micro_batch_size, ac, ac_selective, compile,
zero_stage, precision, offload (offload.optimizer), optim (muon), accumulate_unsharded, backend_sharding, cp_impl,
documents (packed documents: data.document_masking and data.reset_positions), steps, save_dir +
save_after (save after that many steps), load_dir + start_step (resume, then run steps
start_step..steps-1), state_digest (record a bitwise digest of every full parameter and optimizer
state tensor right after the save and right after the load: saved_state / loaded_state),
count_expert_rows (record per rank the rows routed to and computed by each
MoE expert: expert_rows_per_rank).

Each layout is resolved by the real resolver (`launcher.plan.decide.resolve.resolve`, what `train`
writes into plan.json) and the engine is built from that Layout; the result records both the
Layout and what the engine reports it built (`engine.built()`), which the test compares.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from launcher.runtime.dist import exit_after_shutdown

REPO = Path(__file__).resolve().parents[2]
# HARNESS_DEVICE=cuda runs the same layouts on GPUs (nccl, one GPU per rank).
DEVICE = torch.device(os.environ.get("HARNESS_DEVICE", "cpu"))
GLOBAL_BATCH, MICRO_BATCH, SEQ = 4, 1, 16


def model_config(name: str, overrides: dict | None = None):
    """conf/model/<name>.yaml with `overrides` merged as `train`'s model.* keys would be (nested
    ones such as rope_scaling become their typed configs)."""
    from launcher.config.schema import ModelConfig

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"),
                          overrides or {})
    return OmegaConf.to_object(cfg)


def step_batch(step: int, vocab: int):
    """The global batch of optimizer step `step`: learnable progressions, same for all layouts."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def rank_microbatches(step: int, vocab: int, dp_rank: int, dp: int, micro: int = MICRO_BATCH):
    x, y = step_batch(step, vocab)
    per = GLOBAL_BATCH // dp
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return [(x[i:i + micro], y[i:i + micro]) for i in range(0, per, micro)]


# Packed documents per row (each sums to SEQ) for layouts with "documents": boundaries that fall
# inside and across the 2*cp head-tail chunks of context parallelism.
DOC_LENGTHS = ([5, 7, 4], [16], [3, 9, 4], [8, 8])


def with_documents(microbatches, dp_rank: int, dp: int):
    """The micro-batches as Microbatches with document ids and positions restarting at each
    document (the rows' order is step_batch's, so every layout packs the same documents)."""
    from launcher.data.batch import Microbatch

    rows = GLOBAL_BATCH // dp
    out, row = [], dp_rank * rows
    for x, y in microbatches:
        ids, pos = [], []
        for r in range(row, row + x.shape[0]):
            lengths = DOC_LENGTHS[r % len(DOC_LENGTHS)]
            ids.append(torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]))
            pos.append(torch.cat([torch.arange(n) for n in lengths]))
        row += x.shape[0]
        out.append(Microbatch(inputs=x, labels=y, positions=torch.stack(pos), document_ids=torch.stack(ids)))
    return out


def check_cp_sharding(spec: dict) -> dict:
    """Shard position buffers with torch's context_parallel on this world (works on CPU: the
    sharding itself needs no attention kernel) and return what this rank kept."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    cp, seq = dist.get_world_size(), spec["seq"]
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    tokens = torch.arange(seq).repeat(2, 1)  # [b, s]
    table = torch.arange(seq * 3).view(seq, 3)  # like the RoPE table: sequence on dim 0
    with context_parallel(mesh, buffers=[tokens, table], buffer_seq_dims=[1, 0],
                          no_restore_buffers={tokens}):
        kept_table = table.clone()
    gathered = [None] * cp
    dist.all_gather_object(gathered, {"tokens": tokens[0].tolist(), "table": kept_table[:, 0].div(3).tolist()})
    return {"per_rank": gathered}


def run_layout(spec: dict) -> dict:
    if spec.get("kind") == "cp_shard":
        return check_cp_sharding(spec)
    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from tests.layout_for import job_spec
    from launcher.plan.decide.resolve import resolve

    mcfg = model_config(spec.get("model", "debug"), spec.get("model_overrides"))
    if spec.get("tie"):
        mcfg = replace(mcfg, tie_embeddings=True)
    mesh = {k: 1 for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")} | spec.get("mesh", {})
    world = mesh["pp"] * mesh["dp_replicate"] * mesh["dp_shard"] * mesh["cp"] * mesh["tp"]
    dotted = {f"parallel.{k}": v for k, v in mesh.items()}
    dotted.update({
        "parallel.sp": spec.get("sp", False),
        "parallel.pp_schedule": spec.get("pp_schedule", "1f1b"),
        "parallel.pp_virtual_stages": spec.get("pp_virtual_stages", 1),
        "parallel.pp_layers": spec.get("pp_layers", []),
        "parallel.zero_stage": spec.get("zero_stage", 3),
        "trainer.global_batch_size": GLOBAL_BATCH,
        "trainer.micro_batch_size": spec.get("micro_batch_size", MICRO_BATCH),
        "trainer.seq_len": SEQ,
        "precision.name": spec.get("precision", "fp32"),
        "activation_checkpointing.mode": spec.get("ac", "none"),
        "activation_checkpointing.selective": spec.get("ac_selective", "op"),
    })
    if spec.get("offload"):
        dotted["offload.optimizer"] = spec["offload"]
    if "accumulate_unsharded" in spec:
        dotted["parallel.accumulate_unsharded"] = spec["accumulate_unsharded"]
    if spec.get("backend_sharding"):
        dotted["backend.sharding"] = spec["backend_sharding"]
    if spec.get("cp_impl"):
        dotted["backend.cp_impl"] = spec["cp_impl"]
    if spec.get("documents"):
        dotted.update({"data.document_masking": True, "data.reset_positions": True})
    job = job_spec(mcfg, world, **dotted)
    layout = resolve(job)  # what `train` would write into plan.json's "layout"
    steps = spec.get("steps", 3)
    t_build = time.time()
    optim = OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1)
    if spec.get("optim") == "muon":  # Muon's own lr (optim.muon.lr) stays its default
        optim = replace(optim, name="muon")
    options = EngineOptions(total_steps=10, grad_clip=1.0, seed=7, compile=spec.get("compile", False),
                            export_dtype="fp32")
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE
    engine = NativeEngine(mcfg, optim, layout, device, options)
    dp = layout.mesh.dp
    if dist.is_initialized():
        c = layout.mesh.coordinates(dist.get_rank())
        dp_rank = c["dp_replicate"] * layout.mesh.dp_shard + c["dp_shard"]
    else:
        dp_rank = 0
    out = {"losses": [], "grad_norms": [], "aux": [], "lr": [], "build_seconds": time.time() - t_build,
           "layout": layout.to_dict(), "built": engine.built()}
    # Bytes of params / grads / optimizer states each rank holds, for the rehearsal comparison
    # (tests/test_parallel_layouts.py::test_rehearsal_holds_what_the_real_ranks_hold).
    from launcher.observe.state_bytes import StateBytesProbe

    probe = StateBytesProbe(engine.optimizers)
    rows = expert_row_counters(engine.model_parts) if spec.get("count_expert_rows") else None
    start = spec.get("start_step", 0)
    if spec.get("load_dir"):
        engine.load(Path(spec["load_dir"]))
        if spec.get("state_digest"):
            out["loaded_state"] = state_digest(engine)
    t0 = time.time()
    for step in range(start, steps):
        mbs = rank_microbatches(step, mcfg.vocab_size, dp_rank, dp, layout.batch.micro_batch_size)
        stats = engine.train_step(with_documents(mbs, dp_rank, dp) if spec.get("documents") else mbs)
        out["losses"].append(stats.loss)
        out["grad_norms"].append(stats.grad_norm)
        out["lr"].append(stats.lr)
        out["aux"].append(stats.extra.get("moe_aux_loss", 0.0))
        if "mtp/loss" in stats.extra:  # model.mtp_layers > 0: the multi-token-prediction loss
            out.setdefault("mtp", []).append(stats.extra["mtp/loss"])
        if spec.get("save_dir") and step + 1 == spec.get("save_after"):
            engine.save(Path(spec["save_dir"]))
            if spec.get("state_digest"):
                out["saved_state"] = state_digest(engine)
        if spec.get("export") and step + 1 == spec.get("export_after", steps):
            engine.export(Path(spec["export"]), spec.get("export_format", "fp32"))  # "hf": in <export>/hf
    out["seconds"] = time.time() - t0
    if spec.get("eval_rows"):  # downstream evaluation's scoring on this layout's trained model
        out["eval_rows"] = eval_row_scores(engine, layout, dp_rank, mcfg.vocab_size)
    if spec.get("eval_greedy"):  # is_greedy over every candidate token
        t_eval = time.time()
        out["eval_candidates"] = eval_candidate_scores(engine, layout, dp_rank, mcfg.vocab_size)
        out["eval_candidates_s"] = time.time() - t_eval
        if layout.mesh.tp > 1:
            out["greedy_ties"] = greedy_tie_check(engine)
    if spec.get("optim") == "muon":  # who orthogonalised what, the last step (work-balance test)
        costs = [w for o in engine.optimizers for w in getattr(o, "ns_work", [])]
        per_rank = [None] * dist.get_world_size() if dist.is_initialized() else [costs]
        if dist.is_initialized():
            dist.all_gather_object(per_rank, costs)
        out["ns_work_per_rank"] = per_rank
    held = probe.result()
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, held)
    else:
        per_rank = [held]
    out["held_per_rank"] = per_rank
    if rows is not None:
        counted = {k: [int(v) for v in t.tolist()] for k, t in rows.items()}
        per_rank = [None] * dist.get_world_size() if dist.is_initialized() else [counted]
        if dist.is_initialized():
            dist.all_gather_object(per_rank, counted)
        out["expert_rows_per_rank"] = per_rank
    if spec.get("track_rehearsal_step"):
        tracked = rehearsal_step_memory(engine, layout, mcfg.vocab_size)
        per_rank = [None] * dist.get_world_size() if dist.is_initialized() else [tracked]
        if dist.is_initialized():
            dist.all_gather_object(per_rank, tracked)
        out["tracked_per_rank"] = per_rank
    return out


def state_digest(engine) -> dict:
    """{"<parameter>" or "<parameter>/<state key>": digest} over every rank's model parts: each full
    tensor (DTensors gathered) read as its raw bits, summed with position weights in int64, so any
    changed bit or moved element changes it (the layouts hold the same values whatever the sharding)."""
    from torch.distributed.tensor import DTensor

    from launcher.models.init import canonical_name

    def digest(t: torch.Tensor) -> str:
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu").contiguous().reshape(-1)
        bits = full.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[full.element_size()])
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
        return f"{full.dtype}:{bits.numel()}:{int((bits.to(torch.int64) * weights).sum())}"

    out = {}
    states = {}
    for opt in engine.optimizers:
        states.update(opt.state)
    for part in engine.model_parts:
        for name, p in part.named_parameters():
            key = canonical_name(name)
            out[key] = digest(p)
            for k, v in sorted(states.get(p, {}).items()):
                out[f"{key}/{k}"] = digest(v) if isinstance(v, torch.Tensor) else repr(v)
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, out)
        out = {k: v for d in per_rank for k, v in d.items()}
    return out


def eval_row_scores(engine, layout, dp_rank: int, vocab: int) -> list:
    """Summed log-likelihoods of fixed rows (launcher/eval/rows.py, what eval.tasks scores with),
    the same rows on every rank and layout: longest (seq_len + 1 tokens) to shortest."""
    from launcher.eval.rows import RowScorer, RowShape

    g = torch.Generator().manual_seed(99)
    rows = [(torch.randint(0, vocab, (n,), generator=g).tolist(), k) for n, k in ((SEQ + 1, 4), (6, 1), (12, 11), (3, 2), (9, 5))]
    shape = RowShape(seq_len=SEQ, micro_batch_size=layout.batch.micro_batch_size, microbatches=layout.batch.microbatches,
                     dp_rank=dp_rank, dp_size=layout.mesh.dp)
    return RowScorer(engine, shape, pad_id=0).score(rows)


# Contexts whose every single-token continuation is scored (eval_candidate_scores): their argmax
# tokens on the trained debug model (ref_dense: 199 and 73, each ahead of the runner-up by 0.15
# or more in logit; ref_docs, trained on packed documents: the same, by 0.10 or more) fall in both
# halves of the vocabulary, so under tp=2 both shards hold a winner (tests/test_parallel_layouts.py
# checks it).
GREEDY_CONTEXTS = ([5, 9, 13, 17, 21], [87, 174, 88, 81, 165, 25, 77, 72])


def eval_candidate_scores(engine, layout, dp_rank: int, vocab: int) -> list:
    """[(log p, is_greedy)] of every token of the vocabulary after each GREEDY_CONTEXTS context,
    through RowScorer (lm-eval's loglikelihood requests), in calls of 64-row micro-batches (the
    layout's own under pipelining): exactly one candidate per context is greedy, the one with the
    largest log p."""
    from launcher.eval.rows import RowScorer, RowShape

    rows = [(context + [token], 1) for context in GREEDY_CONTEXTS for token in range(vocab)]
    # A pipeline's stages were built for the layout's micro-batch shape; elsewhere fewer, larger calls.
    mbs, n_micro = ((layout.batch.micro_batch_size, layout.batch.microbatches) if layout.mesh.pp > 1 else (64, 2))
    shape = RowShape(seq_len=SEQ, micro_batch_size=mbs, microbatches=n_micro, dp_rank=dp_rank, dp_size=layout.mesh.dp)
    return RowScorer(engine, shape, pad_id=0).score(rows)


def greedy_tie_check(engine) -> dict:
    """launcher/engines/greedy.py on vocabulary-sharded logits whose maxima tie within and across
    the tp=2 shards (vocab 9: shards of 5 and 4): torch.argmax's lowest-index rule on the full logits."""
    from torch.distributed.tensor import DTensor, Shard

    from launcher.engines.greedy import greedy_hits

    mesh = engine.world["tp"]
    full = torch.zeros(1, 4, 9)
    full[0, 0, [2, 7]] = 1.0  # one maximum in each shard: 2
    full[0, 1, 7] = 1.0  # the second shard alone: 7
    full[0, 2, [5, 8]] = 1.0  # two in the second shard: 5
    # row 3: all equal: 0
    chunk, rank = 5, mesh.get_local_rank()
    local = full[..., rank * chunk:(rank + 1) * chunk].contiguous()
    logits = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=full.shape, stride=full.stride())
    return {"want": full.argmax(-1)[0].tolist(),
            "hits_of_argmax": greedy_hits(logits, full.argmax(-1))[0].tolist(),
            "hits_of_last_max": greedy_hits(logits, torch.tensor([[7, 7, 8, 8]]))[0].tolist()}


def expert_row_counters(model_parts) -> dict:
    """{"routed": [n_experts], "computed": [local experts]}, filled during training: the
    assignments this rank's router sent to each expert, and the rows its own experts computed,
    summed over every MoE layer. Read with forward pre-hooks on the experts module, one before
    the expert-parallel dispatch (prepend: the rank's routing) and one after it (what reaches the
    local experts)."""
    totals = {}

    def counter(key):
        def hook(module, args):
            counts = args[1].detach().to("cpu", torch.int64)
            totals[key] = counts if key not in totals else totals[key] + counts
        return hook

    for part in model_parts:
        for m in part.modules():
            if hasattr(m, "router") and hasattr(m, "experts"):
                m.experts.register_forward_pre_hook(counter("routed"), prepend=True)
                m.experts.register_forward_pre_hook(counter("computed"))
    return totals


def rehearsal_step_memory(engine, layout, vocab_size: int) -> dict:
    """The rehearsal's tracked step (launcher/rehearse/rank.py: rehearse_rank) on this real
    rank: the same step function, micro-batch count and warm-up, on real tensors; {activations,
    peak} for tests/test_parallel_layouts.py::test_rehearsal_activation_peak_is_the_real_ones."""
    from launcher.observe.memtrack import track_step_memory
    from launcher.rehearse.step import pipeline_step_runner, step_runner

    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same token batch on every rank (the runners draw it)
        # A real rank runs a real first step untracked; the rehearsal only sets the stages up
        # (rehearse.set_up_pipeline_stages): the test holds the two equal.
        if layout.mesh.pp > 1:
            step, warmup = pipeline_step_runner(engine, layout, vocab_size), 1
        else:  # at most 2 micro-batches, as rehearse_rank; the optimizer states exist already
            step, warmup = step_runner(engine, layout, vocab_size, max(1, min(layout.batch.microbatches, 2))), 0
    on_enter = None
    if layout.mesh.pp > 1:  # the stages' receive buffers counted from the step's start, as rehearse_rank does
        from launcher.parallel.pp import schedule_stages
        from launcher.rehearse.step import register_recv_buffers

        on_enter = register_recv_buffers(schedule_stages(engine.pp_schedule))
    measured = track_step_memory(engine.model_parts, engine.optimizers, step, warmup_steps=warmup,
                                 on_enter=on_enter)
    # Loss parallel (tp > 1) all-reduces one fp32 value per token of the micro-batch (the logits'
    # max, the sum of exponentials). Gloo's worker thread drops its reference to such a buffer a
    # moment after the waiting rank has resumed, so on a loaded machine the real peak may still
    # include one of them (seen once in CI: tp2_sp_dense rank 1, +64 B = 1 x 16 tokens x 4 B).
    # Sequence parallelism's collectives (all-gather, reduce-scatter of the [micro-batch, seq, dim]
    # residual stream) leave gloo buffers of at most that size the same way (seen once in CI,
    # 2026-11-28: tp2_sp_dense rank 0, activations +1,980 B, under its 4,096 B).
    tokens = layout.batch.micro_batch_size * layout.batch.seq_len
    sp = layout.mesh.tp > 1 and layout.sp
    return {"activations": int(measured["activations"]), "peak": int(measured["total"]),
            "gloo_reduce_scatter_copy": largest_reduce_scatter_input_bytes(engine.model_parts, 4),
            "gloo_loss_parallel_buffer": 4 * tokens if layout.mesh.tp > 1 else 0,
            "gloo_sequence_parallel_buffer": 4 * tokens * engine.model_cfg.dim if sp else 0}


def largest_reduce_scatter_input_bytes(model_parts, reduce_bytes: int) -> int:
    """Bytes of this rank's largest FSDP2 reduce-scatter input (0 without FSDP): one FSDP unit's
    gradients unsharded over its data-parallel shards (local shard numel x shard-mesh size, even
    shards), in `reduce_bytes`-byte elements (the harness's layouts reduce in fp32). Gloo's
    reduce-scatter copies its input into a buffer of this size inside the collective (NCCL's
    does not): the one allocation a real CPU run makes that the rehearsal does not model."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    def dp_shards(p) -> int:  # mesh dimensions other than tp that shard p (FSDP's)
        if not isinstance(p, DTensor):
            return 1
        names = p.device_mesh.mesh_dim_names or ()
        n = 1
        for i, pl in enumerate(p.placements):
            if (pl.is_shard() or isinstance(pl, _StridedShard)) and names[i] != "tp":
                n *= p.device_mesh.size(i)
        return n

    best = 0
    for part in model_parts:
        for unit in (m for m in part.modules() if isinstance(m, FSDPModule)):
            inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)
                     for p in m.parameters()}
            numel = sum(p.to_local().numel() * dp_shards(p) for p in unit.parameters() if id(p) not in inner)
            best = max(best, numel * reduce_bytes)
    return best


def main() -> int:
    layouts = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    if "RANK" in os.environ:
        if DEVICE.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    for spec in layouts:
        if "expect_error" in spec and rank == 0:
            print(f"[harness] {spec['name']}: an error is expected here", flush=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[spec["name"]] = run_layout(spec)
            results[spec["name"]]["warnings"] = sorted({str(w.message) for w in caught
                                                        if "launcher" in (w.filename or "")})
        except Exception as e:  # record, keep going: one broken layout must not hide the rest
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()[-3000:]}
            if rank == 0:
                traceback.print_exc()
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
    if rank == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
    exit_after_shutdown()


if __name__ == "__main__":
    sys.exit(main())
