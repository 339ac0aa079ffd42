"""MoE experts and dispatch: grouped GEMM vs the loop, and host syncs per MoE layer.

1. ``expert_swiglu`` (launcher/models/grouped_mm.py): torch._grouped_mm (where it runs here:
   the CPU, fp32/bf16, 16-byte aligned shapes) and the per-expert loop give the outputs and
   gradients of a per-row reference, with uneven and empty expert groups and capacity padding.
2. Host syncs: operations that make the host wait for the device (``.tolist()``, ``.item()``,
   and the ops whose output size depends on values: nonzero, boolean indexing, bincount,
   repeat_interleave without output_size, ...) are counted during forward + backward of MoE
   layers. One process: none with the grouped GEMM, one per layer with the loop. Two real gloo
   processes with expert parallelism (launcher/parallel/ep.py): at most one per MoE layer, and
   the EP outputs and expert gradients equal those of the full experts on one process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.models.grouped_mm import expert_swiglu, grouped_mm_problem
from launcher.models.moe import MoE
from launcher.plan.degrees import MeshPlan
from launcher.plan.layout import MemoryPlan, NumericsPlan, RankBatchPlan
from launcher.runtime.dist import exit_after_shutdown

aten = torch.ops.aten
# Ops whose result size or value the host must read from the device (a sync on CUDA).
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.bincount.default, aten.unique_consecutive.default, aten._unique2.default,
            aten.unique_dim.default}


class SyncCounter(TorchDispatchMode):
    """Counts host syncs while active: the ops above, value-dependent indexing, .tolist()."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            self.events.append(str(func))
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.events.append(str(func))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                self.events.append(f"{func} (boolean mask)")
        return func(*args, **kwargs)

    def __enter__(self):
        # .tolist() reads the data without going through the dispatcher: count it here.
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t):
            counter.events.append("Tensor.tolist")
            return counter._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _reference(x, w1, w2, w3, sizes):
    """Row by row: the expert of each row from sizes; rows after sum(sizes) give zero."""
    experts = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    rows = []
    for i in range(x.shape[0]):
        if i >= len(experts):
            rows.append(torch.zeros(w2.shape[1], dtype=x.dtype))
            continue
        e = experts[i]
        rows.append((F.silu(w1[e] @ x[i]) * (w3[e] @ x[i])) @ w2[e].t())
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,dim,hidden", [(torch.float32, 8, 12), (torch.bfloat16, 16, 24),
                                              (torch.float32, 6, 10)])
def test_grouped_and_loop_match_reference(dtype, dim, hidden):
    torch.manual_seed(0)
    n_experts = 5
    sizes = [0, 7, 0, 3, 9]  # uneven, empty first and middle groups
    n = sum(sizes) + 4  # 4 rows of capacity padding at the end
    x = torch.randn(n, dim, dtype=dtype)
    w1 = torch.randn(n_experts, hidden, dim, dtype=dtype) * 0.3
    w2 = torch.randn(n_experts, dim, hidden, dtype=dtype) * 0.3
    w3 = torch.randn(n_experts, hidden, dim, dtype=dtype) * 0.3
    counts = torch.tensor(sizes)
    grad_out = torch.randn(n, dim, dtype=dtype)
    aligned = dim * x.element_size() % 16 == 0 and hidden * x.element_size() % 16 == 0
    problem = grouped_mm_problem(x, w1, w2)
    if aligned:
        assert problem is None, f"torch._grouped_mm should run here: {problem}"
    else:
        assert "16-byte aligned" in problem

    results = {}
    # bf16: the reference runs in fp32 on the same (bf16-representable) values.
    ref_dtype = torch.float32
    for name, fn in {
        "reference": lambda a, b, c, d: _reference(a, b, c, d, sizes),
        "auto": lambda a, b, c, d: expert_swiglu(a, b, c, d, counts),
        "loop": lambda a, b, c, d: expert_swiglu(a, b, c, d, counts, implementation="loop"),
        "loop_host_sizes": lambda a, b, c, d: expert_swiglu(a, b, c, d, counts, sizes, implementation="loop"),
    }.items():
        cast = ref_dtype if name == "reference" else dtype
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (x, w1, w2, w3)]
        out = fn(*leaves)
        (out.float() * grad_out.float()).sum().backward()
        results[name] = [out.detach()] + [t.grad for t in leaves]
    for name in ("auto", "loop", "loop_host_sizes"):
        for what, got, want in zip(("out", "x.grad", "w1.grad", "w2.grad", "w3.grad"),
                                   results[name], results["reference"]):
            assert got.dtype == dtype and torch.isfinite(got.float()).all(), f"{name} {what}"
            # bf16 keeps 8 bits of mantissa: 2 % of the largest value bounds its rounding here.
            tol = (dict(rtol=0.0, atol=0.02 * float(want.abs().max())) if dtype == torch.bfloat16
                   else dict(rtol=1e-5, atol=1e-5))
            torch.testing.assert_close(got.float(), want, **tol, msg=lambda m: f"{name} {what}: {m}")
    # Padding rows: zero output, no gradient; empty experts: zero weight gradients.
    for name in ("auto", "loop"):
        out, gx, g1 = results[name][:3]
        assert torch.all(out[sum(sizes):] == 0) and torch.all(gx[sum(sizes):] == 0), name
        assert torch.all(g1[0] == 0) and torch.all(g1[2] == 0), name


def _moe(capacity_factor: float, implementation: str, dim: int = 16, hidden: int = 32) -> MoE:
    torch.manual_seed(0)
    m = MoE(dim=dim, hidden=hidden, n_experts=4, top_k=2, n_shared_experts=1,
            capacity_factor=capacity_factor)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    m.experts.implementation = implementation
    return m


@pytest.mark.parametrize("cf,implementation,want", [(0.0, "auto", 0), (1.0, "auto", 0), (0.0, "loop", 1),
                                                     (1.0, "loop", 1)])
def test_host_syncs_per_moe_layer_one_process(cf, implementation, want):
    m = _moe(cf, implementation)
    x = torch.randn(2, 10, 16, requires_grad=True)
    with SyncCounter() as counter:
        m(x).sum().backward()
    assert len(counter.events) == want, counter.events


# --------------------------------------------------------------------------- two ranks, ep=2


class _Holder(nn.Module):
    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe


class _Layers(nn.Module):
    def __init__(self, moes):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Holder(m) for i, m in enumerate(moes)})


def _ep_rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from launcher.parallel.ep import apply_expert_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    report = []
    # Capacity padding through the grouped GEMM; dropless through the loop (chunk sizes from
    # the dispatch's one sync, so the loop adds none).
    for cf, implementation in ((1.0, "auto"), (0.0, "loop")):
        full = _Layers([_moe(cf, implementation) for _ in range(2)])
        ep_model = _Layers([_moe(cf, implementation) for _ in range(2)])
        ep_model.load_state_dict(full.state_dict())
        apply_expert_parallel(ep_model, mesh)
        torch.manual_seed(100 + rank)  # each rank routes its own tokens
        x, probe = torch.randn(2, 9, 16), torch.randn(2, 9, 16)

        def run(model):
            h = x
            for holder in model.layers.values():
                h = holder.moe(h)
            (h * probe).sum().backward()
            return h.detach()

        want = run(full)
        with SyncCounter() as counter:
            got = run(ep_model)
        # Relative differences. Expert gradients: each ep rank holds its experts' gradients
        # over both ranks' tokens, i.e. the sum of the full model's gradients over the ranks.
        out_diff, grad_diff = float((got - want).abs().max() / want.abs().max()), 0.0
        for f, e in zip(full.layers.values(), ep_model.layers.values()):
            for name in ("w1", "w2", "w3"):
                g = getattr(f.moe.experts, name).grad.clone()
                dist.all_reduce(g)
                g = g[rank * 2:(rank + 1) * 2]
                local = getattr(e.moe.experts, name).grad.to_local()
                grad_diff = max(grad_diff, float((local - g).abs().max() / g.abs().max()))
        dropped = sum(int(h.moe.dropped_tokens or 0) for h in ep_model.layers.values())
        report.append(f"cf={cf} {implementation} layers={len(ep_model.layers)} syncs={len(counter.events)} "
                      f"dropped={dropped} "
                      f"out_diff={out_diff:.3g} grad_diff={grad_diff:.3g} events={counter.events}")
    Path(out_dir, f"rank{rank}.txt").write_text("\n".join(report))
    # A crash during the work still fails the test: its report file is missing or incomplete.
    exit_after_shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_expert_parallel_dispatch_one_sync_per_layer_same_results(tmp_path):
    mp.spawn(_ep_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        lines = Path(tmp_path, f"rank{rank}.txt").read_text().splitlines()
        assert len(lines) == 2
        for line in lines:
            fields = dict(f.split("=", 1) for f in line.split(" ") if "=" in f and not f.startswith("events"))
            layers, syncs = int(fields["layers"]), int(fields["syncs"])
            if fields["cf"] == "1.0":
                assert int(fields["dropped"]) > 0, f"rank {rank}: capacity dropped nothing, padding untested: {line}"
            assert syncs <= layers, f"rank {rank}: more than one host sync per MoE layer: {line}"
            assert float(fields["out_diff"]) < 1e-5, f"rank {rank}: outputs differ from one process: {line}"
            assert float(fields["grad_diff"]) < 1e-5, f"rank {rank}: expert gradients differ: {line}"


# --------------------------------------------------------------------------- rehearsal fake step

# The rehearsal's MoE fake step (balanced routing, launcher/rehearse/rank.py) against the same
# step on real tensors (top-k routing), one rank: measured 1.8e-4 relative on the activation
# peak (the grouped GEMM's padding masks, which the fake fp32 step replaces by the loop; with
# the loop both are equal to the byte). docs/planner.md states this tolerance.
MOE_FAKE_STEP_RTOL = 0.01

_MEASURE = r"""
import json, sys
import torch
from launcher.config.schema import OptimConfig
from launcher.engines.base import EngineOptions
from launcher.engines.native import NativeEngine
from launcher.plan.decide.resolve import resolve
from launcher.observe.memtrack import track_step_memory
from launcher.rehearse.rank import rehearse_rank
from launcher.rehearse.step import step_runner
from tests.layout_for import job_spec
from tests.parallel_harness.run_layouts import model_config

mcfg = model_config("debug_moe")
lay = resolve(job_spec(mcfg, 1, **{"trainer.seq_len": 64, "trainer.micro_batch_size": 2,
                                   "trainer.global_batch_size": 4}))
opts, optim = EngineOptions(total_steps=10, seed=7), OptimConfig(lr=3e-3, warmup_steps=1)
eng = NativeEngine(mcfg, optim, lay, torch.device("cpu"), opts)
real = track_step_memory(eng.model_parts, eng.optimizers, step_runner(eng, lay, mcfg.vocab_size, 2))
routed = [m.routing for p in eng.model_parts for m in p.modules() if hasattr(m, "routing")]
del eng
fake = rehearse_rank(mcfg, optim, lay, opts, 0, activations=True)
print(json.dumps({"real": real["activations"], "fake": fake["memory"]["activations"], "routing": routed,
                  "notes": fake["notes"]}))
"""


@pytest.mark.multiprocess
def test_moe_rehearsal_runs_a_fake_step_close_to_the_real_one(tmp_path):
    """One rank, debug_moe: the fake step runs (it was skipped for MoE) and its activation peak is
    the real top-k step's within MOE_FAKE_STEP_RTOL. With ep=2, `action=rehearse` measures an
    activation peak (balanced routing gives the dispatch static splits)."""
    from launcher.config.loader import compose_spec, save_spec
    from launcher.rehearse.driver import rehearse
    from launcher.plan.present.plan import build_plan

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _MEASURE], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got["routing"]) == {"topk"}, "the real step must route by the router"
    assert any("routes balanced" in n for n in got["notes"]), got["notes"]
    assert got["fake"] > 0
    assert abs(got["fake"] - got["real"]) <= MOE_FAKE_STEP_RTOL * got["real"], got

    # Rank 0 of the ep=2 layout (rank 1 holds the other experts the same way; CI time).
    spec = compose_spec(["+recipe=debug", "model=debug_moe", "parallel.ep=2", "trainer.seq_len=64",
                         "rehearse.ranks=[0]"])
    plan = build_plan(spec, None)
    save_spec(spec, tmp_path)
    plan.save(tmp_path)
    result = rehearse(spec, plan, tmp_path)
    assert result["ok"], result
    assert [row["rank"] for row in result["ranks"]] == [0]
    assert plan.layout.mesh.ep == 2 and plan.layout.mesh.world_size == 2
    for row in result["ranks"]:
        assert row["error"] is None and row["memory"]["activations"] > 0, row


def test_plan_counts_tp_replicated_experts_in_unsharded_copies():
    """TP replicates the experts (no expert-TP): the planner's unsharded working copies hold every
    local expert on each TP rank, as its sharded states already did."""
    from launcher.config.loader import compose_spec
    from launcher.plan.layout import Layout
    from launcher.plan.estimate.memory import working_state_memory
    from launcher.plan.estimate.params import model_shape, stage_params

    shape = model_shape(compose_spec(["model=mixtral_8x7b"]).model)
    st = stage_params(shape, 2)[0]
    assert st.routed > 0
    lay = Layout(
        nodes=1,
        gpus_per_node=8,
        mesh=MeshPlan(pp=2, dp_shard=2, tp=2),
        batch=RankBatchPlan(micro_batch_size=1, seq_len=4096),
        memory=MemoryPlan(zero_stage=3),
        numerics=NumericsPlan(precision="bf16"),
    )
    assert lay.fsdp_holds_unsharded  # the pipeline keeps units unsharded across micro-batches
    want = (st.shared - st.tp_replicated) / 2 + st.tp_replicated + st.routed / lay.mesh.ep
    assert working_state_memory(st, lay)["unsharded_params"] == int(want * 2)


def test_fp8_keeps_routed_experts_bf16_and_says_so(caplog):
    """precision=fp8 on an MoE model: the routed experts stay bf16 and the log says why; the
    shared expert's linears go fp8, the router stays bf16."""
    import logging

    from launcher.config.schema import Fp8Config
    from launcher.parallel.fp8 import convert_to_float8

    m = _moe(0.0, "auto")
    with caplog.at_level(logging.INFO, logger="launcher.parallel.fp8"):
        convert_to_float8(m, Fp8Config(emulate=True, min_features=16), device_type="cpu", fsdp_enabled=False)
    assert "routed experts of 1 MoE layers stay bf16" in caplog.text
    assert "_scaled_grouped_mm" in caplog.text
    kinds = {n: type(mod).__name__ for n, mod in m.named_modules()}
    assert kinds["shared_experts.w1"] == "Float8Linear" and kinds["router"] == "Linear"
    assert all(isinstance(p, torch.nn.Parameter) and type(p.data) is torch.Tensor for p in m.experts.parameters())


def test_fp8_experts_wired_to_torchao_grouped_gemm_where_it_runs(monkeypatch, caplog):
    """CUDA >= 8.9 with the grouped path: exactly the routed experts' w1/w2/w3 get torchao's fp8
    grouped-GEMM wrapper (not the router, shared experts or dense layers), it survives
    to_empty/init, and a forward and backward reach torchao's scaled grouped mm with the expert
    weights and 16-row aligned groups. That kernel has no CPU version, so a recorder computes
    it in high precision; CPU / older GPUs / the loop keep the experts bf16 and say why."""
    import logging
    import re
    from pathlib import Path

    from omegaconf import OmegaConf

    import torchao.prototype.moe_training.tensor as ao_tensor
    from launcher.config.schema import ModelConfig
    from launcher.models import build_model
    from launcher.parallel.fp8 import convert_experts_to_float8

    yaml = Path(__file__).resolve().parents[1] / "conf" / "model" / "debug_moe.yaml"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(yaml)))

    def model(convert_cc=None):
        with torch.device("meta"):
            m = build_model(cfg)
        if convert_cc:
            assert convert_experts_to_float8(m, device_type="cuda", compute_capability=convert_cc)
        m.to_empty(device="cpu")
        m.init_weights(0)
        return m

    def wrapped(m):
        return {n for n, p in m.named_parameters() if type(p).__name__ == "Float8TrainingWeightWrapperTensor"}

    ref = model()
    with caplog.at_level(logging.INFO, logger="launcher.parallel.fp8"):
        m = model(convert_cc=(9, 0))
    assert "torchao's rowwise fp8 grouped GEMM" in caplog.text
    routed = {n for n, _ in m.named_parameters() if re.search(r"\.moe\.experts\.w[123]$", n)}
    assert len(routed) == 3 * (cfg.n_layers - cfg.n_dense_layers)
    assert wrapped(m) == routed
    # transpose (how the grouped path passes B) keeps the wrapper, so torch._grouped_mm reaches it.
    assert type(m.layers["1"].moe.experts.w1.transpose(-2, -1)).__name__ == "Float8TrainingWeightWrapperTensor"
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p._data if n in routed else p, q), n

    calls = []

    def recorder(A, B_t, config, offs=None, bias=None):
        calls.append((B_t.data_ptr(), offs.clone(), A.shape[0]))
        return torch._grouped_mm(A, B_t, offs=offs)  # what the fp8 kernel approximates

    monkeypatch.setattr(ao_tensor, "_quantize_then_scaled_grouped_mm", recorder)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    out, want = m(tokens), ref(tokens)
    assert len(calls) == len(routed)
    assert {ptr for ptr, _, _ in calls} == {p._data.data_ptr() for n, p in m.named_parameters() if n in routed}
    assert all(bool((offs % 16 == 0).all()) for _, offs, _ in calls), "fp8 groups must be 16-row aligned"
    # The token rows as a whole too: the weight gradient (grad_out^T @ A) takes them as its leading
    # stride, and an H100 refused 16504 rows ("strides should be multiple of 16 bytes").
    assert all(rows % 16 == 0 for _, _, rows in calls), [rows for _, _, rows in calls]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # the alignment changes no result
    out.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        if n in routed:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)

    # Everywhere else the experts stay bf16, with the reason in the log.
    for device_type, cc, loop, why in [("cpu", None, False, "no CPU kernel"), ("cuda", (8, 0), False, "< 8.9"),
                                       ("cuda", (9, 0), True, "per-expert loop")]:
        with torch.device("meta"):
            plain = build_model(cfg)
        if loop:
            for mod in plain.modules():
                if type(mod).__name__ == "GroupedExperts":
                    mod.implementation = "loop"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="launcher.parallel.fp8"):
            assert convert_experts_to_float8(plain, device_type=device_type, compute_capability=cc) == []
        assert "stay bf16" in caplog.text and why in caplog.text, caplog.text
        assert not wrapped(plain)
