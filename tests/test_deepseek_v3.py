"""DeepSeek-V3's router and balancing (launcher/models/moe.py, launcher/models/deepseek_v3/).

Parity with transformers (logits, exports, the real configs on the meta device) is in
tests/test_hf_weights.py; here: group-limited routing on the routing indices (and equal to
transformers' DeepseekV3TopkRouter, biased scores below zero included), aux-loss-free balancing on
a constructed skewed router (the bias moves load toward uniform, outside the optimizer, saved with
the model; a real checkpoint and a resume in a new process are bit-identical), the sequence-wise
balance loss by hand, MLA under tensor parallelism (2 gloo ranks, with and without SP) equal
to one rank in logits and gradients, and MLA's RoPE in context parallelism's head-tail order.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.config.schema import ModelConfig, RopeScalingConfig
from launcher.models import build_model
from launcher.models.moe import MoE, update_correction_bias
from launcher.runtime.dist import exit_after_shutdown

TINY = dict(name="tiny_dsv3", family="deepseek_v3", n_layers=3, dim=32, n_heads=4, n_kv_heads=4, ffn_dim=48,
            vocab_size=96, max_seq_len=32, norm_eps=1e-6, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, n_experts=16, top_k=4, n_shared_experts=1, moe_ffn_dim=16,
            n_dense_layers=1, score_func="sigmoid", routed_scaling_factor=2.5, n_group=4, topk_group=2,
            bias_update_speed=0.01, aux_loss_alpha=0.0, aux_loss_coef=0.0,
            rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
                                           beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


def _model(seed: int = 0, **overrides):
    cfg = ModelConfig(**{**TINY, **overrides})
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model, cfg


def _router(n_experts=16, top_k=4, n_group=4, topk_group=2, seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(8, 4, n_experts, top_k, 1, score_func="sigmoid", routed_scaling_factor=2.5, n_group=n_group,
              topk_group=topk_group, correction_bias=True, aux_loss="sequence")
    with torch.no_grad():
        for p in moe.parameters():  # the experts are allocated empty
            p.normal_(0, 0.1)
        moe.router.weight.normal_()
        moe.e_score_correction_bias.uniform_(-0.2, 0.2)
    return moe


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (4, 1), (8, 3)])
def test_group_limited_routing_never_spans_more_than_topk_group_groups(n_group, topk_group):
    """On the routing indices: every token's top_k experts lie in at most topk_group groups, those
    groups are the best by their two best biased scores, and the indices are transformers'."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    moe = _router(n_experts=16, top_k=4, n_group=n_group, topk_group=topk_group)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    scores = moe.router(x).float().sigmoid()
    experts = moe.choose_experts(scores)
    size = 16 // n_group
    groups = experts // size
    spans = torch.tensor([len(set(row.tolist())) for row in groups])
    assert spans.max() <= topk_group and experts.shape == (512, 4)
    assert (spans == topk_group).any()  # the limit binds
    # The chosen groups are the best topk_group by the sum of their two best biased scores.
    biased = (scores + moe.e_score_correction_bias).view(512, n_group, size)
    best = biased.topk(2, dim=-1)[0].sum(-1).topk(topk_group, dim=-1)[1]
    for row, allowed in zip(groups, best):
        assert set(row.tolist()) <= set(allowed.tolist())
    # transformers' router: the same experts, and the same weights as our forward's.
    config = DeepseekV3Config(hidden_size=8, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                              topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    ref = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        ref.weight.copy_(moe.router.weight)
        ref.e_score_correction_bias.copy_(moe.e_score_correction_bias)
    _, ref_weights, ref_idx = ref(x)
    assert torch.equal(experts.sort(-1)[0], ref_idx.sort(-1)[0])
    ours_w = scores.gather(1, experts)
    ours_w = ours_w / (ours_w.sum(-1, keepdim=True) + 1e-20) * 2.5
    assert torch.allclose(ours_w.gather(1, experts.argsort(-1)), ref_weights.gather(1, ref_idx.argsort(-1)))


def test_group_limited_routing_with_biased_scores_below_zero_equals_transformers():
    """Large negative correction biases push every biased score below zero: the excluded groups
    must then be masked with -inf (DeepSeek's code, transformers >= 5), not 0.0 (transformers 4.x's
    DeepSeek-V2-era code), or a masked expert outranks every allowed one. Our router's selection is
    transformers' DeepseekV3TopkRouter's exactly, and the MoE layer's output (its gate weights
    through the same experts) equals transformers' DeepseekV3MoE."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    moe = _router(n_experts=16, top_k=4, n_group=4, topk_group=2)
    with torch.no_grad():
        moe.e_score_correction_bias.copy_(-torch.linspace(1.0, 4.0, 16))  # later experts: further below zero
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(3))
    scores = moe.router(x).float().sigmoid()
    biased = scores + moe.e_score_correction_bias
    assert (biased < 0).all()  # the regime where -inf and 0.0 masking disagree
    config = DeepseekV3Config(hidden_size=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True, moe_intermediate_size=4,
                              n_shared_experts=1, hidden_act="silu")
    ref = DeepseekV3MoE(config)
    with torch.no_grad():
        ref.gate.weight.copy_(moe.router.weight)
        ref.gate.e_score_correction_bias.copy_(moe.e_score_correction_bias)
        ref.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        ref.experts.down_proj.copy_(moe.experts.w2)
        ref.shared_experts.gate_proj.weight.copy_(moe.shared_experts.w1.weight)
        ref.shared_experts.up_proj.weight.copy_(moe.shared_experts.w3.weight)
        ref.shared_experts.down_proj.weight.copy_(moe.shared_experts.w2.weight)
        _, ref_weights, ref_idx = ref.gate(x)
        experts = moe.choose_experts(scores)
        assert torch.equal(experts.sort(-1)[0], ref_idx.sort(-1)[0])
        # The test can tell the conventions apart: 0.0 masking picks experts of excluded groups here.
        grouped = biased.view(256, 4, 4)
        keep = torch.zeros(256, 4).scatter_(1, grouped.topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1], 1)
        zero_masked = biased.masked_fill(~keep.repeat_interleave(4, dim=1).bool(), 0.0)
        assert not torch.equal(zero_masked.topk(4, dim=-1)[1].sort(-1)[0], ref_idx.sort(-1)[0])
        ours, theirs = moe(x), ref(x)
    assert ref_weights.sum(-1).sub(2.5).abs().max() < 1e-5  # renormalised over the chosen 4, times 2.5
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("overrides", [["model=deepseek_v3"], ["model=deepseek_v3_small"], ["+recipe=deepseek_v3"]])
def test_from_scratch_configs_pretrain_with_plain_rope(overrides):
    """DeepSeek pretrained at 4K without YaRN: the from-scratch model configs and recipe carry no
    rope_scaling (a released folder's YaRN comes with model=hf, tests/test_hf_weights.py)."""
    from launcher.config.loader import compose_spec

    spec = compose_spec(overrides)
    assert spec.model.rope_scaling.type == "none" and not spec.model.init_from


YARN_4K = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=40",
           "model.rope_scaling.original_max_position_embeddings=4096"]


def test_plan_warns_when_a_from_scratch_run_scales_rope_within_its_original_context(tmp_path):
    """`train action=plan` with YaRN set on a from-scratch run at seq_len <= its original context:
    one warning with a Fix; none past that context or when starting from a model (model.init_from)."""
    from launcher.config.loader import compose_spec
    from launcher.config.validate import rope_scaling_warnings
    from tests.conftest import TRAIN, train_env

    proc = subprocess.run([TRAIN, "+recipe=deepseek_v3", "action=plan", *YARN_4K, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=train_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hits = [line for line in proc.stdout.splitlines() if "model.rope_scaling.type=yarn on a from-scratch run" in line]
    assert len(hits) == 1 and "trainer.seq_len=4096" in hits[0] and "Fix: model.rope_scaling.type=none" in hits[0]
    assert rope_scaling_warnings(compose_spec(["+recipe=deepseek_v3"])) == []  # plain RoPE: nothing to say
    spec = compose_spec(["+recipe=deepseek_v3", *YARN_4K])
    assert len(rope_scaling_warnings(spec)) == 1
    longer = dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, seq_len=8192))
    assert rope_scaling_warnings(longer) == []  # extending the context is what YaRN is for
    loaded = dataclasses.replace(spec, model=dataclasses.replace(spec.model, init_from=str(tmp_path)))
    assert rope_scaling_warnings(loaded) == []  # a model trained with it keeps it


def test_correction_bias_chooses_experts_but_does_not_weight_them():
    moe = _router(n_group=1, topk_group=1)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        moe.e_score_correction_bias.zero_()
        moe.e_score_correction_bias[3] = 10.0  # expert 3 always chosen
        scores = moe.router(x).float().sigmoid()
        experts = moe.choose_experts(scores)
    assert (experts == 3).any(-1).all()
    # The gate of expert 3 is its plain sigmoid score (renormalised, scaled), not score + 10.
    w = scores.gather(1, experts)
    w = w / w.sum(-1, keepdim=True) * 2.5
    assert w.max() < 2.5


def _imbalance(load: torch.Tensor) -> float:
    return float(load.max() / load.float().mean())


def test_aux_loss_free_balancing_moves_a_skewed_router_toward_uniform():
    """A router built to send most tokens to experts 0-3: after each step the correction bias
    moves against each expert's load error (update_correction_bias, as the engine calls it after
    the optimizer); the load evens out, the optimizer never touches the bias, and the bias is in
    the state dict (so checkpoints save it) and survives a save/load bit for bit."""
    torch.manual_seed(0)
    moe = MoE(8, 4, 16, 2, 1, score_func="sigmoid", routed_scaling_factor=2.5, correction_bias=True,
              aux_loss="sequence", aux_loss_coef=0.0)
    holder = torch.nn.Module()  # a one-block model: update_correction_bias finds blocks by layer_id
    holder.moe, holder.layer_id = moe, 0
    with torch.no_grad():
        for p in moe.parameters():  # the experts are allocated empty
            p.normal_(0, 0.1)
        moe.router.weight.normal_(0, 0.3)
        moe.router.weight[:4, 0] += 1.0  # experts 0-3 favour what every token leans toward
        moe.router.weight[4:, 0] -= 1.0
    opt = torch.optim.AdamW(holder.parameters(), lr=1e-4)
    assert not any(p is moe.e_score_correction_bias for g in opt.param_groups for p in g["params"])
    gen = torch.Generator().manual_seed(1)
    speed, loads = 0.01, []
    for step in range(150):
        x = torch.randn(4, 32, 8, generator=gen)
        x[..., 0] += 1.5
        moe(x).pow(2).mean().backward()
        loads.append(moe.step_load.float())
        before = moe.e_score_correction_bias.clone()
        opt.step()
        opt.zero_grad()
        assert torch.equal(before, moe.e_score_correction_bias)  # never the optimizer's
        update_correction_bias([holder], speed, 1, 16)
        assert moe.step_load is None
        d = moe.e_score_correction_bias - before
        assert (((d.abs() - speed).abs() < 1e-6) | (d == 0)).all()  # +-speed (or 0 at the mean)
    first = _imbalance(loads[0])
    last = sum(_imbalance(l) for l in loads[-10:]) / 10
    assert first > 2.5, first  # skewed to begin with: experts 0-3 take most assignments
    assert last < 2.0 and last < 0.4 * first, (first, last)  # 16 assignments per expert: ~1.6 is noise
    assert moe.e_score_correction_bias[:4].max() < 0 < moe.e_score_correction_bias[4:].min()
    # A persistent buffer: in the state dict (what checkpoints save), restored bit for bit.
    model, cfg = _model()
    with torch.no_grad():
        for m in model.moe_layers():
            m.e_score_correction_bias.uniform_(-1, 1)
    state = model.state_dict()
    assert "layers.1.moe.e_score_correction_bias" in state and "layers.2.moe.e_score_correction_bias" in state
    assert not any(n.endswith("e_score_correction_bias") for n, _ in model.named_parameters())
    fresh, _ = _model(seed=5)
    fresh.load_state_dict(state)
    assert all(torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)
               for a, b in zip(fresh.moe_layers(), model.moe_layers()))


def test_update_sums_loads_through_reduce_with_one_shape_everywhere():
    """`reduce` gets one [n_layers, n_experts] tensor whatever the rank holds (a pipeline stage
    without MoE blocks too), rows at the blocks' global indices."""
    model, cfg = _model()
    seen = []
    model.layers["1"].moe.step_load = torch.arange(16)
    model.layers["2"].moe.step_load = None

    def reduce(t):
        seen.append(t.clone())
        t[2] += torch.arange(16).flip(0).float()  # "another rank" routed to layer 2

    update_correction_bias([model], 0.5, cfg.n_layers, cfg.n_experts, reduce)
    assert seen[0].shape == (3, 16) and torch.equal(seen[0][1], torch.arange(16).float()) and not seen[0][2].any()
    assert torch.equal(model.layers["1"].moe.e_score_correction_bias, torch.sign(7.5 - torch.arange(16).float()) * 0.5)
    assert torch.equal(model.layers["2"].moe.e_score_correction_bias,
                       torch.sign(7.5 - torch.arange(16).flip(0).float()) * 0.5)
    stage = torch.nn.Sequential(model.layers["0"])  # a stage with only the dense block
    seen.clear()
    update_correction_bias([stage], 0.5, cfg.n_layers, cfg.n_experts, lambda t: seen.append(t.shape))
    assert seen == [(3, 16)]


def test_sequence_wise_balance_loss_by_hand():
    moe = _router(n_group=1, topk_group=1)
    moe.aux_loss_coef = 0.3
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))
    moe(x)
    scores = moe.router(x.reshape(-1, 8)).float().sigmoid()
    experts = moe.choose_experts(scores)
    want = 0.0
    for b in range(2):
        s, e = scores[5 * b:5 * b + 5], experts[5 * b:5 * b + 5]
        f = torch.zeros(16).index_add_(0, e.flatten(), torch.ones(e.numel())) * 16 / (4 * 5)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        want += 0.3 * float((f * p).sum()) / 2
    assert abs(float(moe.last_aux_loss) - want) < 1e-6


def test_declared_fp32_buffers_survive_an_engine_casting_the_model_to_bf16():
    """An engine that casts the whole module (DeepSpeed's bf16 mode: older releases call
    module.bfloat16()) inside fp32_buffers_kept: the parameters are bf16, the buffers the model
    declared float32 (RoPE table, every router's correction bias) keep dtype and values, so a 0.001
    step still moves a bias of 0.5 (in bf16, 0.5 + 0.001 rounds back to 0.5)."""
    from launcher.models.fp32_buffers import fp32_buffers, fp32_buffers_kept

    model, cfg = _model()
    declared = sorted(f"{type(m).__name__}.{n}" for m, n in fp32_buffers(model))
    assert declared == ["DeepseekV3Transformer.rope"] + ["MoE.e_score_correction_bias"] * 2, declared
    with torch.no_grad():
        for m in model.moe_layers():
            m.e_score_correction_bias.fill_(0.5)
    rope = model.rope.clone()
    with fp32_buffers_kept(model):
        model.bfloat16()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.dtype == torch.float32 and torch.equal(model.rope, rope)
    for m in model.moe_layers():
        m.step_load = torch.arange(cfg.n_experts)  # experts 0-7 under the mean load, 8-15 over it
    update_correction_bias([model], 0.001, cfg.n_layers, cfg.n_experts)
    want = 0.5 + 0.001 * torch.sign(7.5 - torch.arange(cfg.n_experts, dtype=torch.float32))
    for m in model.moe_layers():
        assert m.e_score_correction_bias.dtype == torch.float32 and torch.equal(m.e_score_correction_bias, want)
    assert torch.equal(torch.tensor(0.5, dtype=torch.bfloat16) + 0.001, torch.tensor(0.5, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- tensor parallelism


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, port: int, sequence_parallel: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from launcher.parallel.device_mesh import build_device_mesh
        from launcher.parallel.ep import apply_moe_parallel
        from launcher.parallel.tp import apply_tensor_parallel
        from launcher.plan.degrees import MeshPlan

        torch.manual_seed(0)
        model, cfg = _model()
        with torch.no_grad():  # routing that matters, as in a loaded checkpoint
            for m in model.moe_layers():
                m.e_score_correction_bias.uniform_(-0.2, 0.2)
        ref = _model()[0]
        ref.load_state_dict(model.state_dict())
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
        world = build_device_mesh(MeshPlan(tp=2), "cpu")
        apply_tensor_parallel(model, world["tp"], sequence_parallel=sequence_parallel, loss_parallel=False)
        # The experts folded over TP as the engine folds them (each rank routes half the tokens).
        apply_moe_parallel(model, world, ep=1, folded=True, fsdp=False)
        logits = model(tokens)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        logits.float().pow(2).mean().backward()
        want = ref(tokens)
        want.pow(2).mean().backward()
        grads = {}
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = float((g - q.grad).abs().max())
        if rank == 0:
            out["logits"] = float((logits - want).abs().max())
            out["grads"] = grads
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_after_shutdown()


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mla_under_tensor_parallelism_equals_one_rank(sequence_parallel):
    """Heads sharded over 2 ranks (wq_b, wkv_b column-wise, wo row-wise; the down-projections, their
    norms and the shared RoPE key replicated, its gradient summed), the MoE's experts folded over
    TP (each rank routing half the tokens, the sequence-wise balance loss summed over both): logits
    and every gradient equal one rank's."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_tp_worker, args=(_free_port(), sequence_parallel, out), nprocs=2, join=True)
        out = dict(out)
    assert out["logits"] <= 1e-5, out
    bad = {k: v for k, v in out["grads"].items() if v > 1e-5}
    assert not bad, bad


# ----------------------------------------------------------------------------- the `train` command


def _tiny_deepseek_v3_folder_and_corpus(tmp_path, mtp: bool = False):
    """A tiny DeepSeek-V3 saved by transformers (random norms and correction biases) and a text corpus;
    `mtp`: with the released multi-token-prediction layer (tests/test_mtp.py mtp_folder)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.test_hf_weights import DEEPSEEK_V3, WORDS, _randomize_norms, _save_tokenizer
    from tests.test_mtp import mtp_folder

    torch.manual_seed(0)
    src = tmp_path / "src"
    if mtp:
        mtp_folder(src)
    else:
        _randomize_norms(DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_V3, q_lora_rank=16))).save_pretrained(src)
    _save_tokenizer(src)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(3000)))
    return src, text


def _train_args(src, text):
    """`train` from that folder with the bias moving 0.01 per step, fp32, an fp32 HF export at the end."""
    return ["model=hf", f"model.init_from={src}", "model.bias_update_speed=0.01", "data=text", f"data.path={text}",
            "trainer.seq_len=16", "trainer.global_batch_size=2", "precision=fp32", "checkpoint.export=hf",
            "checkpoint.export_dtype=fp32", "cluster.gpus_per_node=1", "logging.progress=false", "plan.plots=false",
            "logging.wandb.mode=disabled"]


@pytest.mark.multiprocess
def test_train_moves_the_bias_each_step_and_exports_it_for_transformers(tmp_path):
    """`train model=hf model.init_from=<tiny DeepSeek-V3> model.bias_update_speed=0.01`, 3 steps, fp32
    export: every correction bias moved by whole steps of 0.01 (at most 3), and transformers reads the
    export as our model does (logits within 1e-5). metrics.jsonl has each MoE layer's load and bias
    spread (launcher/observe/moe_load.py) on every log step. The folder carries DeepSeek-V3's
    multi-token-prediction layer (num_nextn_predict_layers 1): it trains (`mtp/loss` on every log
    step, not under loss/), its router's bias moves too, and the export has it."""
    from launcher.config.hf_model import hf_model_fields
    from launcher.hf.format import read_hf_config
    from launcher.hf.weights import load_hf_weights
    from tests.conftest import run_train
    from tests.test_hf_weights import _hf_logits, _hf_tensors

    src, text = _tiny_deepseek_v3_folder_and_corpus(tmp_path, mtp=True)
    run = tmp_path / "run"
    run_train([*_train_args(src, text), "trainer.steps=3"], run, check=True, timeout=600)
    # Per-layer metrics: MoE layers 1 and 2 (first_k_dense_replace=1); 8 experts, top-2.
    from tests.conftest import read_metrics
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["mtp/loss"] < 20 and not any(k.startswith("loss/") for k in r) for r in rows), rows
    for r in rows:
        ratios = [r[f"moe/layer{i}/tokens_per_expert_max_over_mean"] for i in (1, 2)]
        assert all(1.0 <= x <= 8 / 2 for x in ratios), r
        assert r["moe/tokens_per_expert_max_over_mean"] == pytest.approx(sum(ratios) / 2), r
        assert "moe/layer0/tokens_per_expert_max_over_mean" not in r and "moe/layer0/bias_spread" not in r  # dense
    export = run / "export" / "hf"
    before, after = _hf_tensors(src), _hf_tensors(export)
    keys = [k for k in before if k.endswith("e_score_correction_bias")]
    assert len(keys) == 3  # layers 1, 2 and the MTP layer 3
    assert sorted(after) == sorted(before)
    # The biases start random (_randomize_norms): the logged spread (max - min) is the exported
    # bias's after the last step, and n updates of +-0.01 change it by at most 2 * 0.01 * n.
    layer_of = {i: next(k for k in keys if f"layers.{i}." in k) for i in (1, 2)}
    for r in rows:
        spreads = [r[f"moe/layer{i}/bias_spread"] for i in (1, 2)]
        start = [float(before[layer_of[i]].max() - before[layer_of[i]].min()) for i in (1, 2)]
        assert all(abs(x - x0) <= 0.02 * r["step"] + 1e-6 for x, x0 in zip(spreads, start)), (r, start)
        assert r["moe/bias_spread"] == pytest.approx(sum(spreads) / 2), r
    for i in (1, 2):
        bias = after[layer_of[i]]
        assert rows[-1][f"moe/layer{i}/bias_spread"] == pytest.approx(float(bias.max() - bias.min()), abs=1e-6)
    for k in keys:
        steps = (after[k] - before[k]) / 0.01
        assert (steps - steps.round()).abs().max() < 1e-3 and steps.abs().max() <= 3 + 1e-3, (k, steps)
        assert steps.abs().max() > 0.5, k  # it moved
    cfg = ModelConfig(name="hf", init_from=str(export), **hf_model_fields(read_hf_config(export)))
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    load_hf_weights([model], str(export), cfg)
    toks = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(toks)
    assert (ours - _hf_logits(export, toks)).abs().max() <= 1e-5


@pytest.mark.multiprocess
def test_router_bias_survives_a_checkpoint_on_disk_and_a_resume_in_a_new_process(tmp_path):
    """4 steps in one `train`, saving at step 2; a second `train` process resumes from that step-2
    checkpoint on disk and runs steps 3-4: its correction biases (and every other tensor) at the end
    are bit-identical to the uninterrupted run's. A bias not saved, or not restored, would restart
    from the folder's values and end elsewhere."""
    from tests.conftest import losses_by_step, run_train
    from tests.test_hf_weights import _hf_tensors

    src, text = _tiny_deepseek_v3_folder_and_corpus(tmp_path)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_train([*_train_args(src, text), "trainer.steps=4", "checkpoint.interval=2"], whole, check=True, timeout=600)
    step2 = whole / "checkpoints" / "step_00000002"
    assert step2.is_dir()
    run_train([*_train_args(src, text), "trainer.steps=4", "checkpoint.interval=2", f"checkpoint.resume={step2}"],
              resumed, check=True, timeout=600)
    assert sorted(losses_by_step(resumed)) == [3, 4]  # it resumed: steps 1-2 were not run again
    source, a, b = _hf_tensors(src), _hf_tensors(whole / "export" / "hf"), _hf_tensors(resumed / "export" / "hf")
    biases = [k for k in a if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(b[k].dtype == torch.float32 for k in biases)
    assert any(not torch.equal(a[k], source[k]) for k in biases)  # the biases moved
    assert all(torch.equal(a[k], b[k]) for k in biases), [(a[k] - b[k]).abs().max() for k in biases]
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert losses_by_step(resumed) == {s: l for s, l in losses_by_step(whole).items() if s > 2}


def test_multi_token_prediction_weights_are_skipped_with_one_log_line(tmp_path, caplog):
    """The released folder holds the multi-token-prediction block at model.layers.{n_layers}; we build
    none: the folder passes the check, the load skips those tensors with one log line."""
    import logging

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from launcher.config.hf_model import hf_model_fields
    from launcher.hf.format import folder_problems, read_hf_config
    from launcher.hf.weights import load_hf_weights
    from tests.test_hf_weights import DEEPSEEK_V3

    torch.manual_seed(0)
    folder = tmp_path / "mtp"
    DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_V3, q_lora_rank=16)).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.update({"model.layers.3.eh_proj.weight": torch.zeros(32, 64), "model.layers.3.enorm.weight": torch.ones(32),
                    "model.layers.3.shared_head.head.weight": torch.zeros(96, 32)})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = ModelConfig(name="hf", init_from=str(folder), **hf_model_fields(read_hf_config(folder)))
    assert folder_problems(cfg, str(folder)) == []
    model = build_model(cfg)
    with caplog.at_level(logging.INFO, logger="launcher.hf.weights"):
        load_hf_weights([model], str(folder), cfg)
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "3 tensor(s)" in lines[0] and "model.layers.3" in lines[0], lines


def test_document_masking_keeps_mla_attention_inside_each_document():
    """Two packed documents (positions restarting) give each document's logits alone (SDPA mask
    path; MLA's value heads are smaller than its query/key heads)."""
    model, cfg = _model()
    model.eval()
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, cfg.vocab_size, (1, 6), generator=gen), torch.randint(0, cfg.vocab_size, (1, 10), generator=gen)
    packed = torch.cat([a, b], dim=1)
    docs = torch.tensor([[0] * 6 + [1] * 10])
    positions = torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0)
    model.attention_kernel = "sdpa"
    with torch.no_grad():
        together = model(packed, positions=positions, document_ids=docs)
        alone = torch.cat([model(a), model(b)], dim=1)
    assert (together - alone).abs().max() <= 1e-5


def test_mla_rotates_by_the_table_rows_it_is_given_as_context_parallelism_shards_them():
    """Context parallelism hands each rank the head-tail chunks of the sequence and the RoPE table's
    rows for those global positions (launcher/parallel/cp.py): MLA must rotate its queries and its
    decoupled RoPE key by the rows it is given, never by local indices. The sequence in the cp=2
    ranks' order with the table rows in that order and attention causal by global position gives
    every token the output of the plain sequence."""
    from launcher.parallel.cp import shard_positions

    model, cfg = _model()
    attn = model.layers["1"].attention
    s = 16
    order = torch.tensor(shard_positions(s, 2, 0) + shard_positions(s, 2, 1))  # [0..3, 12..15, 4..11]
    x = torch.randn(2, s, cfg.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = attn(x, model.rope[:s])
        sharded = attn(x[:, order], model.rope[order], mask=order[:, None] >= order[None, :])
        # Rotated by local indices instead (what a wrong MLA would do): other outputs.
        local = attn(x[:, order], model.rope[:s], mask=order[:, None] >= order[None, :])
    # Relative to the outputs' size (small at init: measured 4e-3): same to rounding (measured
    # 5e-8), while the local-index rotation differs by 7e-3 of it.
    want = plain[:, order]
    size = want.abs().max()
    assert (sharded - want).abs().max() <= 1e-5 * size
    assert (local - want).abs().max() > 1e-3 * size
