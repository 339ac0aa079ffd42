"""optim=muon on one process: the launcher's optimizer equals torch.optim.Muon + torch.optim.AdamW,
its groups by canonical name, owner balance, resume, metrics and the checks before launch.
The distributed algorithm (FSDP2, TP, EP, PP, HSDP) is compared with these 1-rank runs in the
layout matrix (tests/parallel_harness/matrix.py, muon_layouts)."""

from __future__ import annotations

import copy
import math
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from launcher.config.schema import OptimConfig, OptimGroupConfig
from launcher.engines.muon import MuonWithAdamW, optimizer_group_lrs, update_rms_metrics, update_square_sums
from launcher.engines.optimizers import build_optimizer
from launcher.models import build_model
from launcher.plan.decide.optim_groups import assign_groups, matrices
from launcher.plan.estimate.muon import assign_owners, ns_flops, owner_loads
from tests.parallel_harness.matrix import DEEPSEEK_V3, QWEN3_MOE
from tests.parallel_harness.run_layouts import model_config

MUON = OptimConfig(name="muon", lr=3e-3, weight_decay=0.1)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the ranks run (torchrun's OMP_NUM_THREADS=1): these tiny matmuls take
    10-20x longer when threads contend on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(name: str = "debug_moe", seed: int = 0):
    model = build_model(model_config(name))
    model.init_weights(seed, buffer_device=torch.device("cpu"))
    return model


def _shapes(name: str):
    """(name, shape) of the model's parameters, built on the meta device (no memory)."""
    with torch.device("meta"):
        return [(n, tuple(p.shape)) for n, p in build_model(model_config(name)).named_parameters()]


def _grads(step: int, *models):
    g = torch.Generator().manual_seed(100 + step)
    for ps in zip(*(m.parameters() for m in models)):
        grad = torch.randn(ps[0].shape, generator=g)
        for p in ps:
            p.grad = grad.clone()


def _torch_reference(model):
    """torch's optimizers over the default split: Muon for hidden matrices (each expert's matrix a
    parameter of its own: `views`, (expert stack, index) -> view), AdamW (decay on matrices only)
    for embeddings, head, router and 1-D parameters."""
    muon, views, decay, no_decay = [], {}, [], []
    for name, p in model.named_parameters():
        if p.ndim == 3:
            views.update({(name, i): torch.nn.Parameter(p.detach()[i].clone()) for i in range(p.shape[0])})
        elif p.ndim == 2 and not any(k in name for k in ("tok_embeddings", "output", "router")):
            muon.append(p)
        else:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return (torch.optim.Muon(muon + list(views.values()), lr=MUON.muon.lr, weight_decay=MUON.muon.weight_decay),
            torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=MUON.lr, betas=(MUON.beta1, MUON.beta2), eps=MUON.eps),
            views)


def test_muon_step_equals_torch_muon_and_adamw():
    """Two steps on the MoE debug model (fp32 parameters, Newton-Schulz in bf16 with torch's own
    function): every parameter and momentum buffer is bitwise torch's (tolerance 0: the same kernels
    in the same order; the layout matrix allows 1e-4 for other summation orders of the gradients)."""
    ours, ref = _model(), _model()
    opt = build_optimizer(ours, MUON)
    assert isinstance(opt, MuonWithAdamW)
    t_muon, t_adamw, views = _torch_reference(ref)
    stacks = dict(ref.named_parameters())
    for step in range(2):
        _grads(step, ours, ref)
        for (name, i), view in views.items():  # each expert's gradient to its own matrix
            view.grad = stacks[name].grad[i].clone()
        opt.step()
        t_muon.step()
        t_adamw.step()
        with torch.no_grad():
            for (name, i), view in views.items():
                stacks[name][i] = view
    ours_named = dict(ours.named_parameters())
    for name, p in ours_named.items():
        assert torch.equal(p, stacks[name]), f"{name}: max difference {(p - stacks[name]).abs().max():.3e}"
    for name, p in ours_named.items():
        want = ([t_muon.state[views[(name, i)]]["momentum_buffer"] for i in range(p.shape[0])] if p.ndim == 3
                else [t_muon.state[stacks[name]]["momentum_buffer"]] if stacks[name] in t_muon.state else None)
        got = opt.state[p].get("momentum_buffer")
        if want is None:
            assert got is None, f"{name}: a Muon momentum buffer on an AdamW parameter"
        else:
            assert torch.equal(got, torch.stack(want) if p.ndim == 3 else want[0]), f"{name}: momentum differs"


def test_default_groups_and_first_match_wins():
    params = _shapes("debug_moe")
    a = assign_groups(params, MUON)
    kind = {name: a.groups[g].optimizer for name, _, g in a.members}
    assert kind["tok_embeddings.weight"] == kind["output.weight"] == kind["layers.1.moe.router.weight"] == "adamw"
    assert kind["layers.0.attention_norm.weight"] == "adamw"
    assert kind["layers.0.attention.wq.weight"] == kind["layers.1.moe.experts.w1"] == "muon"
    groups = [OptimGroupConfig(match=r"\.attention\.wq\.", optimizer="adamw", lr=1e-4),
              OptimGroupConfig(match=r"\.attention\.", optimizer="muon", lr=0.01, weight_decay=0.0)]
    a = assign_groups(params, dataclasses.replace(MUON, groups=groups))
    assert not a.problems
    by_name = {name: a.groups[g] for name, _, g in a.members}
    assert (by_name["layers.0.attention.wq.weight"].optimizer, by_name["layers.0.attention.wq.weight"].lr) == ("adamw", 1e-4)
    assert (by_name["layers.0.attention.wo.weight"].lr, by_name["layers.0.attention.wo.weight"].weight_decay) == (0.01, 0.0)
    assert by_name["layers.0.feed_forward.w1.weight"].label == "default muon"
    # optim=adamw with a Muon group: only that group's matrices get Muon
    a = assign_groups(params, OptimConfig(groups=[OptimGroupConfig(match=r"feed_forward", optimizer="muon")]))
    assert {a.groups[g].optimizer for n, _, g in a.members if "feed_forward" in n} == {"muon"}
    assert {a.groups[g].optimizer for n, _, g in a.members if "feed_forward" not in n} == {"adamw"}


def test_group_problems_name_the_fix():
    params = [("layers.0.attention.wq.weight", (64, 64)), ("layers.0.attention_norm.weight", (64,))]
    bad = dataclasses.replace(MUON, groups=[OptimGroupConfig(match="attention", optimizer="muon"),
                                            OptimGroupConfig(match="^nothing$")])
    problems = assign_groups(params, bad).problems
    assert len(problems) == 2 and all("Fix:" in p for p in problems)
    assert "layers.0.attention_norm.weight" in problems[0] and "not matrices" in problems[0]
    assert "matches none" in problems[1]


def test_owners_balance_newton_schulz_on_4_ranks():
    """Every matrix of the debug models gets exactly one owner, and the busiest of 4 ranks does at
    most 1.5x the mean Newton-Schulz FLOPs (the real runs' owners: test_parallel_layouts.py)."""
    for name in ("debug", "debug_moe", "deepseek_v3_small"):
        params = _shapes(name)
        a = assign_groups(params, MUON)
        costs = [ns_flops(r, c, 5) for n, s, g in a.members if a.groups[g].optimizer == "muon" for r, c in matrices(s)]
        owners = assign_owners(costs, 4)
        assert len(owners) == len(costs) and set(owners) == {0, 1, 2, 3}
        top, mean = owner_loads(costs, owners, 4)
        assert top <= 1.5 * mean, f"{name}: busiest rank {top / mean:.2f}x the mean"
    assert ns_flops(64, 192, 5) == ns_flops(192, 64, 5) == 5 * (4 * 64 * 64 * 192 + 2 * 64 ** 3)


def test_resume_from_state_dict_is_bit_identical():
    """Momentum buffers and AdamW moments travel in the state dict: 1 step, save, load into a new
    optimizer, 1 step equals 2 uninterrupted steps bitwise; after the load the LR schedule's writes
    still reach AdamW's groups (they are the same dicts)."""
    a, b = _model(), _model()
    opt_a = build_optimizer(a, MUON)
    for step in range(2):
        _grads(step, a)
        opt_a.step()
    opt_b = build_optimizer(b, MUON)
    _grads(0, b)
    opt_b.step()
    saved = copy.deepcopy(opt_b.state_dict())
    b2 = copy.deepcopy(b)
    opt_b2 = build_optimizer(b2, MUON)
    opt_b2.load_state_dict(saved)
    assert all(any(g is h for h in opt_b2.param_groups) for g in opt_b2._adamw.param_groups)
    assert opt_b2._adamw.state is opt_b2.state
    _grads(1, b2)
    opt_b2.step()
    for p, q in zip(a.parameters(), b2.parameters()):
        assert torch.equal(p, q)


def test_update_rms_and_group_lrs():
    """optim/muon/update_rms is the RMS of the step Muon applied (weight decay aside), optim/adamw/update_rms
    AdamW's; the per-group learning rates are reported under their group's name."""
    model = _model("debug")
    groups = [OptimGroupConfig(match=r"^output\.", optimizer="adamw", lr=1e-4)]
    opt = build_optimizer(model, dataclasses.replace(MUON, groups=groups))
    before = {p: p.detach().clone() for p in model.parameters()}
    _grads(0, model)
    opt.step()
    metrics = update_rms_metrics(update_square_sums([opt], torch.device("cpu")))
    for kind in ("muon", "adamw"):
        sq = n = 0.0
        for g in opt.param_groups:
            if g["optimizer"] != kind:
                continue
            for p in g["params"]:
                applied = before[p] * (1 - g["lr"] * g["weight_decay"]) - p.detach()
                sq, n = sq + applied.double().square().sum().item(), n + p.numel()
        assert float(metrics[f"optim/{kind}/update_rms"]) == pytest.approx((sq / n) ** 0.5, rel=1e-4)
    assert optimizer_group_lrs([opt]) == {"optim/groups.0/lr": 1e-4, "optim/adamw/lr": MUON.lr,
                                          "optim/muon/lr": MUON.muon.lr}


def test_deepspeed_refuses_muon_before_launch():
    """DeepSpeed's Muon is not torch.optim.Muon (Gram Newton-Schulz, no match_rms_adamw): optim=muon
    with DeepSpeed owning the model states is an exit-2 problem with a Fix; native is served."""
    from launcher.config.errors import ConfigError
    from launcher.config.loader import compose_spec
    from launcher.launch.preflight import check_optimizer
    from launcher.plan.decide.resolve import resolve

    spec = compose_spec(["+recipe=debug", "optim=muon", "backend=deepspeed"])
    layout = resolve(spec)
    assert layout.owners.sharding_backend == "deepspeed"
    with pytest.raises(ConfigError) as err:
        check_optimizer(spec, SimpleNamespace(layout=layout))
    assert len(err.value.problems) == 1 and "Fix: backend=native" in err.value.problems[0]
    spec = compose_spec(["+recipe=debug", "optim=muon", "backend=native"])
    check_optimizer(spec, SimpleNamespace(layout=resolve(spec)))


def test_muon_values_checked_before_launch():
    from launcher.config.loader import compose_spec
    from launcher.config.validate import validate as validate_config

    spec = compose_spec(["+recipe=debug", "optim=muon", "optim.muon.momentum=1.5", "optim.muon.adjust_lr=rms",
                         "optim.muon.ns_coefficients=[1,2]",
                         "optim.groups=[{match: '(', optimizer: sgd}]"])
    problems = "\n".join(validate_config(spec))
    for key in ("optim.muon.momentum=1.5", "optim.muon.adjust_lr='rms'", "optim.muon.ns_coefficients",
                "optim.groups[0].match", "optim.groups[0].optimizer='sgd'"):
        assert key in problems, f"{key} not reported:\n{problems}"
    # The resolver (every action: plan, search, a launch) reports a group that matches nothing, and
    # a pattern that is no regular expression stays validate's problem (no traceback).
    from launcher.plan.decide.resolve import resolve_all

    for match, want in (("^nothing$", "matches none"), ("(", "is not a regular expression")):
        spec = compose_spec(["+recipe=debug", "optim=muon", f"optim.groups=[{{match: '{match}', optimizer: muon}}]"])
        layout, found = resolve_all(spec)
        assert layout is None and any(want in p and "Fix:" in p for p in found), found


def test_plan_counts_one_momentum_buffer_per_muon_matrix():
    """The plan's optimizer bytes (memory, checkpoint size, the search's state check) drop by 4 B per
    Muon parameter (one momentum buffer instead of AdamW's two moments), for the parameters the
    groups give Muon: optim=muon's defaults (the embedding and the head keep AdamW's 8 B), or an
    optim.groups entry under optim=adamw (only its matches)."""
    from launcher.config.loader import compose_spec
    from launcher.plan.decide.resolve import resolve
    from launcher.plan.estimate.checkpoint_time import checkpoint_bytes_per_rank
    from launcher.plan.estimate.memory import model_state_memory
    from launcher.plan.estimate.params import model_shape, stage_params

    ffn_group = "optim.groups=[{match: '\\.feed_forward\\.', optimizer: muon}]"
    mem, ckpt = {}, {}
    for case, overrides in (("adamw", ["optim=adamw"]), ("muon", ["optim=muon"]), ("groups", ["optim=adamw", ffn_group])):
        spec = compose_spec(["+recipe=debug", "backend=native", *overrides])
        lay = resolve(spec)
        shape = model_shape(spec.model)
        stage = stage_params(shape, 1)[0]
        mem[case] = model_state_memory(stage, lay, shape)["optimizer"]
        ckpt[case] = checkpoint_bytes_per_rank(shape, lay)
    shards = lay.fsdp_degree
    muon_params = _numel_by_kind("debug")["muon"]
    ffn_params = sum(math.prod(s) for n, s in _shapes("debug") if ".feed_forward." in n)
    assert mem["adamw"] - mem["muon"] == ckpt["adamw"] - ckpt["muon"] == pytest.approx(4 * muon_params / shards, abs=1)
    assert mem["adamw"] - mem["groups"] == ckpt["adamw"] - ckpt["groups"] == pytest.approx(4 * ffn_params / shards, abs=1)


def test_planner_lists_the_parameters_the_model_builds():
    """The planner assigns groups on a torch-free parameter list (launcher/models/param_list.py):
    the names, shapes and order of the module the engine steps, for every family's debug model
    (shared experts, the DeepSeek-V3 router's correction bias left out as a buffer, MTP, tied tables)."""
    from launcher.models.param_list import trainable_parameters

    cases = [("debug", None), ("debug_moe", None), ("debug_moe", {**DEEPSEEK_V3, "mtp_layers": 1}),
             ("debug", {"tie_embeddings": True}), ("debug_moe", QWEN3_MOE)]
    for name, overrides in cases:
        cfg = model_config(name, overrides)
        with torch.device("meta"):
            built = [(n, tuple(p.shape)) for n, p in build_model(cfg).named_parameters()]
        assert trainable_parameters(cfg) == built, (name, overrides)


def test_plan_prices_newton_schulz_on_the_owners_and_the_gathers_to_them():
    """optim=muon's optimizer step in the plan: Newton-Schulz FLOPs of the matrices the busiest
    owner holds (the engine's assignment, estimate/muon.py), their imbalance, and the bytes each
    rank moves gathering matrices to their owners and scattering the results back: with 2 FSDP
    ranks, half of every Muon matrix (bf16) per rank. AdamW has none of it; the step and the
    search rank with it."""
    from launcher.config.loader import compose_spec
    from launcher.plan.present.plan import build_plan
    from launcher.plan.present.search import candidate_spec, search_layouts

    plans = {o: build_plan(compose_spec(["+recipe=debug", "backend=native", f"optim={o}"])) for o in ("adamw", "muon")}
    assert plans["adamw"].time["muon"] is None
    m = plans["muon"].time["muon"]
    a = assign_groups(_shapes("debug"), MUON)
    mats = [rc for _, s, g in a.members if a.groups[g].optimizer == "muon" for rc in matrices(s)]
    costs = [ns_flops(r, c, 5) for r, c in mats]
    top, mean = owner_loads(costs, assign_owners(costs, 2), 2)
    assert m["matrices"] == len(mats) and m["ns_tflops"] * 1e12 == pytest.approx(top)
    assert m["ns_imbalance"] == pytest.approx(top / mean) and m["ns_s"] > 0
    assert m["gather_scatter_bytes"] == pytest.approx(sum(2 * r * c / 2 for r, c in mats))  # bf16 on the wire
    assert plans["muon"].time["optimizer_s"] > plans["adamw"].time["optimizer_s"] + m["ns_s"] + m["gather_scatter_s"] / 2
    spec = compose_spec(["+recipe=debug", "optim=muon", "action=search"])
    cands = search_layouts(spec, limit=3)
    assert cands
    for c in cands:  # native layouts only (DeepSpeed's Muon is refused), timed and sized with Muon
        plan = build_plan(candidate_spec(spec, c.layout))
        assert plan.layout.owners.sharding_backend == "native" and plan.time["muon"]["ns_s"] > 0
        assert c.step_s == pytest.approx(plan.time["step_s"]) and c.memory["optimizer"] == plan.memory["optimizer"]


def _numel_by_kind(name: str):
    """{optimizer: parameters} of the model's default optim=muon groups."""
    a = assign_groups(_shapes(name), MUON)
    out = {}
    for _, shape, g in a.members:
        kind = a.groups[g].optimizer
        n = 1
        for d in shape:
            n *= d
        out[kind] = out.get(kind, 0) + n
    return out


def test_exchange_routes_are_strided_blocks():
    """Muon's exchange keeps each route (the flat positions a shard sends to an owner) as strided
    blocks: taking and putting through them equals indexing with the positions, and a column slice
    of a matrix (TP's Shard(1)) or a row block (FSDP's Shard(0)) is one block, not one int per element."""
    from launcher.engines.muon_exchange import _put, _take, to_blocks

    full = torch.arange(2 * 8 * 6, dtype=torch.float32)
    stack = full.view(2, 8, 6)
    cases = [stack[:, :, 3:], stack[:, 2:5, :], stack[1, 4:, :2], stack[:, ::3, 1:]]
    g = torch.Generator().manual_seed(0)
    cases += [torch.sort(torch.randperm(full.numel(), generator=g)[:k]).values.to(torch.float32) for k in (0, 1, 7, 40)]
    for pick in cases:
        index = pick.reshape(-1).long()
        blocks = to_blocks(index)
        got = torch.cat(_take(full, blocks)) if blocks else full[:0]
        assert torch.equal(got, full[index])
        put = torch.zeros_like(full)
        _put(put, blocks, full[index])
        want = torch.zeros_like(full)
        want[index] = full[index]
        assert torch.equal(put, want)
    assert len(to_blocks(stack[0, :, 3:].reshape(-1).long())) == 1
    assert len(to_blocks(stack[:, 2:5, :].reshape(-1).long())) == 1
