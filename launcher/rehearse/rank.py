"""One rank of a rehearsal: the real engine code at the real world size, on fake tensors.

    python -m launcher.rehearse.rank --run-dir DIR --rank R --out FILE [--no-activations]

or its main, started by launcher/rehearse/driver.py in one forked process per rank (a C++
abort then takes down that rank's report only). It reads the run dir's config.yaml and
plan.json like a real rank, joins a fake process group of the plan's world size as rank R
(torch's FakeStore and "fake" backend: collectives return at once, nothing is sent), and
builds the engine the Layout names with the same code a real run uses (launcher/engines:
fp8, TP/SP, EP, AC, compile wrapping, FSDP2/HSDP, the pipeline split and schedule). The
model is built on the meta device and sharded; from materialisation on every tensor is a
FakeTensor on the CPU (shapes, dtypes and sizes, no storage), so host memory stays small at
any model size.

Then, per rank: the bytes of parameters, gradients and optimizer states it holds
(launcher/observe/state_bytes.py, the same probe the real-run tests use), and with
activations the peak of a fake training step by category (torch's MemTracker /
FSDPMemTracker through launcher/observe/memtrack.py: the optimizer states are created from
zero gradients, a pipeline's stages are set up as its first step would, then one tracked
step). Ranks of one rehearsal with the same `step_signature` (pipeline rank, local shapes)
share one fake step through the run dir.
DeepSpeed layouts (ZeRO 0-3, the pipeline engine at ZeRO 0-1) run deepspeed.initialize on
the fake group and report DeepSpeed's own partition sizes (no fake step).
Without activations (or where no fake step can run) the optimizer is stepped once on
zero gradients of the parameters' shapes, which creates its states.

With `rehearse.tensors=real` in the run dir's config, main runs the rank with real tensors on
`rehearse.device` instead (launcher/rehearse/real.py); the step both run is launcher/rehearse/step.py.

Any exception becomes the rank's ``error`` (type, message, the launcher module that raised,
a Fix); the process exits 0 when it wrote its report, so only a crash is a crash.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, Replicate, zeros
from torch.testing._internal.distributed.fake_pg import FakeStore

from launcher.config.loader import load_spec
from launcher.engines import build_engine
from launcher.engines.deepspeed_config import build_deepspeed_config, data_parallel_size, validate_deepspeed_config
from launcher.plan.present.plan import Plan
from launcher.rehearse.files import SHARED_STEPS_DIR
from launcher.rehearse.step import build_rank_step, rank_report, track_rank_step
from launcher.runtime.entry import engine_options
from launcher.observe.state_bytes import StateBytesProbe, torch_optimizers

# The launcher module that refused a layout -> the keys that change what it builds.
FIX_BY_MODULE = {
    "launcher.parallel.tp": "choose parallel.tp (and parallel.sp) so that every sharded shape divides",
    "launcher.parallel.fsdp": "change parallel.dp_shard / parallel.dp_replicate / parallel.zero_stage",
    "launcher.parallel.pp": "change parallel.pp, parallel.pp_layers, parallel.pp_schedule or parallel.pp_virtual_stages",
    "launcher.parallel.ep": "choose parallel.ep among the divisors of model.n_experts and dp_shard*cp",
    "launcher.parallel.device_mesh": "make the parallel degrees multiply to cluster.nodes * cluster.gpus_per_node",
    "launcher.parallel.fp8": "use precision=bf16, or adjust precision.fp8.* for this model",
    "launcher.parallel.ac": "change activation_checkpointing.mode / activation_checkpointing.selective",
    "launcher.parallel.compile": "set trainer.compile=false",
    "launcher.parallel.cp": "set parallel.cp=1 (context parallelism needs GPUs)",
    "launcher.engines.deepspeed": "change backend.* / parallel.zero_stage (DeepSpeed refused the generated config)",
}
DEFAULT_FIX = "change the parallel.* layout this rank cannot build (`train ... action=plan` shows it)"



def error_report(err: BaseException, tb: Optional[Any] = None) -> Dict[str, Any]:
    """{type, message, module, fix} of an exception raised while rehearsing a rank: the module
    is the innermost launcher module in the traceback (the code that refused the layout)."""
    frames = traceback.extract_tb(tb if tb is not None else err.__traceback__)
    module, function = "", ""
    root = Path(__file__).resolve().parents[1]
    for fr in frames:
        try:
            rel = Path(fr.filename).resolve().relative_to(root.parent)
        except ValueError:
            continue
        if rel.parts[0] == "launcher" and rel.name != "rehearse.py":
            module, function = ".".join(rel.with_suffix("").parts), fr.name
    message = " ".join(str(err).split()) or type(err).__name__
    if "Fix:" in message:
        message, fix = message.split("Fix:", 1)
        fix = fix.strip()
    else:
        fix = FIX_BY_MODULE.get(module, DEFAULT_FIX)
    return {"type": type(err).__name__, "message": message.strip(), "module": module,
            "function": function, "fix": fix}


def _zero_grad_step(engine) -> None:
    """Create the optimizer states without a forward: zero gradients of the parameters' shapes."""


    replicated = _replicated_grad_params(getattr(engine, "model_parts", []))
    for opt in torch_optimizers(engine.optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = _replicated_zeros(p) if id(p) in replicated else torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _replicated_grad_params(parts) -> set:
    """ids of the parameters whose real gradient is replicated though the parameter is sharded:
    a tensor-parallel embedding (RowwiseParallel, Shard(0) over the vocabulary) outside FSDP.
    DTensor's embedding backward yields a Replicate gradient there (the full [vocab, dim] table on
    every TP rank), which a zero gradient shaped like the parameter would miss; under FSDP2 the
    reduce-scatter gives the gradient the parameter's own placement."""
    out = set()
    for part in parts:
        if any(type(m).__name__.startswith("FSDP") for m in part.modules()):
            continue
        for module in part.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Embedding) and hasattr(weight, "placements") and \
                    any(getattr(pl, "dim", None) == 0 for pl in weight.placements):
                out.add(id(weight))
    return out


def _replicated_zeros(p):
    """A zero DTensor of p's global shape, replicated where p is sharded on dim 0."""
    placements = [Replicate() if getattr(pl, "dim", None) == 0 else pl for pl in p.placements]
    return zeros(p.shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=placements)


def fake_step_skip_reason(layout, model_cfg) -> str:
    """Why no fake training step runs for this layout ("" when one runs)."""
    if layout.owners.sharding_backend == "deepspeed":
        return "DeepSpeed's forward does not run on a fake process group"
    return ""


def check_deepspeed_rank(layout, options) -> None:
    """What the rehearsal checks of a DeepSpeed layout before building it.

    The generated DeepSpeed JSON goes through DeepSpeed's own config classes (as the launch
    preflight does); a refusal names DeepSpeed's reason. The layout is then built with
    deepspeed.initialize on the fake group (_rehearse_deepspeed_rank)."""
    # lazy: launcher.engines.deepspeed (~0.09 s more on a rehearsal rank) only for a DeepSpeed layout
    from launcher.engines.deepspeed import prepare_deepspeed_environment

    prepare_deepspeed_environment("cpu")
    cfg = build_deepspeed_config(layout, grad_clip=options.grad_clip, seed=options.seed)
    try:
        validate_deepspeed_config(cfg, data_parallel_size(layout))
    except Exception as err:  # DeepSpeed raises pydantic, assertion and value errors alike
        raise ValueError(
            f"DeepSpeed refused the generated config (ZeRO-{layout.memory.zero_stage}): {type(err).__name__}: "
            f"{' '.join(str(err).split())[:300]}. Fix: change the keys it names, or backend.sharding=native"
        ) from err


def deepspeed_zero3_bytes(ds_optimizer) -> Dict[str, int]:
    """This rank's ZeRO-3 partitions as DeepSpeed built them (padding included): the flat
    working-precision partition of its parameters (`params`), the flat fp32 master partition
    with AdamW's two states of its shape (`optimizer`), and the fp32 gradient partition the
    step reads (`grads`, DeepSpeed's fp32 copy of the partition's gradients). The
    optimizer states are the master partition's shape by construction (AdamW's zeros_like);
    DeepSpeed creates them in its first step, which does not run on a fake group."""

    def nbytes(ts, dtype=None):
        return sum(t.numel() * (torch.empty((), dtype=dtype).element_size() if dtype else t.element_size())
                   for t in ts if t is not None)

    master = list(ds_optimizer.fp32_partitioned_groups_flat)
    working = list(ds_optimizer.fp16_partitioned_groups_flat)
    return {"params_numel": sum(t.numel() for t in working if t is not None),
            "params": nbytes(working), "grads": nbytes(master, torch.float32), "optimizer": 3 * nbytes(master)}


def deepspeed_zero12_bytes(ds_optimizer) -> Dict[str, int]:
    """This rank's ZeRO-1/2 state as DeepSpeed built it (padding included).

    DeepSpeedZeroOptimizer (stage_1_and_2.py): `params` = the flat working-precision copy of the
    whole model (``bit16_groups_flat``, every parameter a view into it); `optimizer` = the flat
    fp32 master partition (``single_partition_of_fp32_groups``) and AdamW's two states of its
    shape; `grads` = ZeRO-2: the fp32 gradient partition the step reads (master-partition
    shape), ZeRO-1: the whole model's gradients in working precision (each rank accumulates all
    of them; reduced at the step). BF16_Optimizer (bf16 at ZeRO-1, fp32 gradient accumulation):
    `params` = ``bf16_groups_flat``, `optimizer` = 3 x ``fp32_groups_flat_partition``, `grads` =
    the fp32 accumulation buffer ``fp32_groups_gradients_flat`` plus the bf16 gradients the
    backward produces (2 bytes per element of the flat model). With the optimizer offloaded
    (``cpu_offload``) the gradient partition and the optimizer states live on the host: `host`.
    The optimizer states are the master partition's shape by construction (AdamW's
    zeros_like); DeepSpeed creates them in its first step, which does not run on a fake group.
    """

    def nbytes(ts, dtype=None):
        return sum(t.numel() * (torch.empty((), dtype=dtype).element_size() if dtype else t.element_size())
                   for t in ts if t is not None)

    if hasattr(ds_optimizer, "bf16_groups_flat"):  # deepspeed.runtime.bf16_optimizer.BF16_Optimizer
        working = list(ds_optimizer.bf16_groups_flat)
        master = list(ds_optimizer.fp32_groups_flat_partition)
        grads = nbytes(ds_optimizer.fp32_groups_gradients_flat) + nbytes(working)
        offload = False
    else:  # deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer
        working = list(ds_optimizer.bit16_groups_flat)
        master = list(ds_optimizer.single_partition_of_fp32_groups)
        grads = nbytes(master, torch.float32) if ds_optimizer.partition_gradients else nbytes(working)
        offload = bool(ds_optimizer.cpu_offload)
    held = {"params_numel": sum(t.numel() for t in working), "params": nbytes(working), "grads": grads,
            "optimizer": 3 * nbytes(master), "host": 0}
    if offload:
        # ZeRO-Offload: the fp32 gradient partition and master/m/v are on the host (the plan's `host`).
        held["host"] = nbytes(master, torch.float32) + held["optimizer"]
        held["grads"] = 0 if ds_optimizer.partition_gradients else held["grads"]
        held["optimizer"] = 0
    return held


def deepspeed_held_bytes(ds_optimizer, zero_stage: int) -> Dict[str, int]:
    """What a DeepSpeed rank holds, read from the optimizer deepspeed.initialize returned:
    ZeRO-3 and ZeRO-1/2 partitions (deepspeed_zero3_bytes, deepspeed_zero12_bytes)."""
    if zero_stage == 3:
        return deepspeed_zero3_bytes(ds_optimizer)
    return deepspeed_zero12_bytes(ds_optimizer)


def _rehearse_deepspeed_rank(model_cfg, optim_cfg, layout, options, rank: int) -> Dict[str, Any]:
    """deepspeed.initialize on the fake group: the real DeepSpeedEngine constructor on fake
    tensors (ZeRO-3: zero.Init partitioning every parameter as it is built; ZeRO 0-2: the whole
    module materialised as fake tensors, then DeepSpeed's flat buffers and partitions).
    The bytes are read from the optimizer DeepSpeed built (deepspeed_held_bytes); a plain torch
    optimizer (ZeRO-0 in fp32) is stepped once on zero gradients to create its states."""
    # lazy: launcher.engines.deepspeed (~0.09 s more on a rehearsal rank) only for a DeepSpeed layout
    from launcher.engines.deepspeed import DeepSpeedEngine

    os.environ.setdefault("LOCAL_RANK", "0")  # zero.Init reads it (one CPU "device" per process)
    notes = [f"DeepSpeed: deepspeed.initialize ran on the fake group (ZeRO-{layout.memory.zero_stage}); no fake step "
             f"(DeepSpeed's forward does not run on a fake process group)"]
    with FakeTensorMode(allow_non_fake_inputs=True):
        engine = DeepSpeedEngine(model_cfg, optim_cfg, layout, torch.device("cpu"), options)
        ds_optimizer = engine.optimizers[0]
        if isinstance(ds_optimizer, torch.optim.Optimizer):
            probe = StateBytesProbe([ds_optimizer])
            _zero_grad_step(engine)
            held = probe.result()
            notes.append("states of DeepSpeed's plain torch optimizer, created by one step on zero gradients")
        else:
            held = deepspeed_held_bytes(ds_optimizer, layout.memory.zero_stage)
            notes.append(f"partitions read from DeepSpeed's {type(ds_optimizer).__name__}")
    if held.get("host"):
        notes.append(f"optimizer offload: {held['host']} bytes of gradient partition and optimizer states on the host")
    return {
        "rank": rank,
        "coords": layout.mesh.coordinates(rank),
        "params_numel": held["params_numel"],
        "memory": {"params": held["params"], "grads": held["grads"], "optimizer": held["optimizer"],
                   "activations": None, "peak": None},
        "error": None,
        "notes": notes,
    }


def step_signature(engine, pp_rank: int) -> str:
    """What a rank's fake step depends on beyond the run's config, which every rank shares: its
    pipeline rank (stages, schedule position) and the local shape, stride and dtype of every
    parameter and buffer (with the global shape). Two ranks with the same signature run the same
    ops on the same shapes, so the same bytes (e.g. every tensor-parallel rank when TP divides
    every sharded dimension; not the last FSDP shard when a dimension does not divide)."""


    items: List[Any] = [("pp", pp_rank)]
    for i, part in enumerate(engine.model_parts):
        for name, t in itertools.chain(part.named_parameters(), part.named_buffers()):
            local = t.to_local() if isinstance(t, DTensor) else t
            items.append((i, name, tuple(t.shape), tuple(local.shape), tuple(local.stride()), str(local.dtype)))
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def _shared_step(shared_steps: Optional[Path], signature: str) -> Optional[Dict[str, Any]]:
    """The fake step another rank of this rehearsal measured with the same signature, or None."""
    path = shared_steps / f"{signature}.json" if shared_steps is not None else None
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())


def _save_shared_step(shared_steps: Optional[Path], signature: str, rank: int, memory: Dict[str, Any],
                      notes: List[str]) -> None:
    """Keep this rank's fake step for the ranks of the same signature (written atomically)."""
    if shared_steps is None:
        return
    shared_steps.mkdir(parents=True, exist_ok=True)
    path = shared_steps / f"{signature}.json"
    tmp = path.with_suffix(f".{rank}.tmp")
    tmp.write_text(json.dumps({"rank": rank, "memory": {k: memory[k] for k in ("activations", "peak", "other")},
                               "notes": notes}))
    tmp.replace(path)


def _measure_fake_step(engine, layout, model_cfg, notes: List[str], fake_microbatches: int,
                       reduce_pipeline: bool) -> Dict[str, int]:
    """Run the rank's tracked fake training step; {activations, peak, other} in bytes. Creates the
    optimizer states first (zero-gradient step) and, for a pipeline, the stages' buffers."""
    step = build_rank_step(engine, layout, model_cfg, notes, fake_microbatches, reduce_pipeline)
    # No untracked first step: it would only create the optimizer states (AdamW makes them
    # in its first step()) and the pipeline's buffers (build_rank_step); zero gradients of the
    # parameters' shapes create the states without a forward and backward, which halves
    # the fake step time. Same measured numbers as after a real first step
    # (bench/rehearse_activations.py, tests/test_parallel_layouts.py).
    _zero_grad_step(engine)
    tracked = track_rank_step(engine, layout, step)
    return {k: tracked[k] for k in ("activations", "peak", "other")}


def rehearse_rank(model_cfg, optim_cfg, layout, options, rank: int, *, activations: bool = True,
                  fake_microbatches: int = 2, reduce_pipeline: bool = True,
                  shared_steps: Optional[Path] = None) -> Dict[str, Any]:
    """Build rank `rank`'s engine on a fake process group of layout.mesh.world_size ranks and
    measure it. Returns {rank, coords, params_numel, memory: {params, grads, optimizer,
    activations, peak}, error: None, notes}. Raises what the engine raises (the caller turns
    it into the rank's error). Initialises torch.distributed: one call per process.
    reduce_pipeline=False runs a pipeline schedule with all of the layout's micro-batches
    (the reference tests/test_pp_states.py compares the reduced count with). shared_steps: a
    directory where the ranks of one rehearsal keep their fake steps by `step_signature`; a rank
    whose signature is there reports that step instead of running the same one again."""


    world = layout.mesh.world_size
    if layout.owners.sharding_backend == "deepspeed":
        check_deepspeed_rank(layout, options)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    if layout.owners.sharding_backend == "deepspeed":
        return _rehearse_deepspeed_rank(model_cfg, optim_cfg, layout, options, rank)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    options = dataclasses.replace(options, fake_mode=fake)
    notes = []
    try:
        engine = build_engine(model_cfg, optim_cfg, layout, torch.device("cpu"), options)
        probe = StateBytesProbe(engine.optimizers)
        memory: Dict[str, Optional[int]] = {"activations": None, "peak": None}
        skip = fake_step_skip_reason(layout, model_cfg)
        if activations and not skip:
            signature = step_signature(engine, layout.mesh.coordinates(rank)["pp"])
            shared = _shared_step(shared_steps, signature)
            if shared is not None:
                # Same pipeline rank, same local shapes: the same ops on the same shapes.
                _zero_grad_step(engine)
                memory.update(shared["memory"])
                notes.extend(shared["notes"])
                notes.append(f"fake step shared with rank {shared['rank']}: the same pipeline rank and the same "
                             f"local shape, stride and dtype for every parameter and buffer, so the same ops on "
                             f"the same shapes (step signature {signature})")
            else:
                step_notes: List[str] = []
                memory.update(_measure_fake_step(engine, layout, model_cfg, step_notes, fake_microbatches,
                                                 reduce_pipeline))
                notes.extend(step_notes)
                _save_shared_step(shared_steps, signature, rank, memory, step_notes)
        else:
            if activations:
                notes.append(f"no fake step: {skip}")
            _zero_grad_step(engine)
        held = probe.result()
    finally:
        # Entered by the engine once the model was sharded (EngineOptions.fake_mode).
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is fake:
            fake.__exit__(None, None, None)
    return rank_report(rank, layout, held, memory, notes)



def _rank_from_run_dir(run_dir: Path, rank: int, activations: bool) -> Dict[str, Any]:
    """The rank's report for the run dir's config.yaml and plan.json (`rehearse.tensors` picks
    fake tensors here or real ones on `rehearse.device`: launcher/rehearse/real.py)."""
    spec = load_spec(run_dir)
    plan = Plan.load(run_dir)
    options = engine_options(spec, run_dir)
    if spec.rehearse.tensors == "real":
        # lazy: the real-tensor rank only when asked (it shares this module's step code)
        from launcher.rehearse.real import rehearse_real_rank

        return rehearse_real_rank(spec.model, spec.optim, plan.layout, options, rank, device=spec.rehearse.device,
                                  warmup_steps=spec.rehearse.warmup_steps, timed_steps=spec.rehearse.timed_steps,
                                  track=activations)
    return rehearse_rank(spec.model, spec.optim, plan.layout, options, rank,
                         activations=activations, shared_steps=run_dir / SHARED_STEPS_DIR)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="rehearse one rank on a fake process group")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--no-activations", action="store_true")
    args = parser.parse_args(argv)
    try:
        report = _rank_from_run_dir(args.run_dir, args.rank, not args.no_activations)
    except Exception as err:  # the rank's problem, reported by the driver; never a traceback
        report = {"rank": args.rank, "error": error_report(err), "traceback": traceback.format_exc()[-4000:]}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
