"""Document masking (data.document_masking, data.reset_positions) and per-source loss.

A packed row with a block-causal mask and positions restarting at each document must give the
logits of each document run alone (fp32, 1e-5): in one process for dense GQA, MHA, MoE and
Qwen3-MoE models, and under tp=2 (with and without SP), pp=2 and FSDP2 + EP (one 2-rank gloo launch for all
of them, tests/masking_harness.py; DeepSpeed in a second one). Without ids/positions the
path is bit for bit today's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launcher.data.batch import Microbatch
from launcher.models.layers import document_attention_mask, grouped_attention
from tests.masking_harness import SOURCES, layout_model_cfg, native_engine, packed_rows, plain_model, reference_logits
from tests.test_models import model_cfg

REPO = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-5, atol=1e-5)

CONFIGS = {
    "dense_gqa": ("debug", {}),  # 4 query heads over 2 kv heads
    "dense_mha": ("debug", {"n_kv_heads": 4}),
    "moe": ("debug_moe", {}),  # dropless (capacity_factor 0): routing is per token
    # Qwen3-MoE's block: q/k norms, head_dim (24) wider than dim / n_heads (16), no shared expert.
    "qwen3_moe": ("debug_moe", {"family": "qwen3", "qk_norm": True, "head_dim": 24, "n_shared_experts": 0,
                                "n_dense_layers": 0, "mlp_only_layers": [1]}),
}


def _cfg(key: str):
    name, overrides = CONFIGS[key]
    return replace(model_cfg(name), **overrides)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_packed_logits_equal_documents_alone(key):
    cfg = _cfg(key)
    model = plain_model(cfg)
    docs, mbs = packed_rows(cfg.vocab_size)
    want = reference_logits(model, docs)
    with torch.no_grad():
        got = torch.cat([model(mb.inputs, positions=mb.positions, document_ids=mb.document_ids) for mb in mbs])
        torch.testing.assert_close(got, want, **TOL)
        # RoPE scores depend on relative positions only, so inside a document the mask alone
        # already gives the same logits; without the mask the documents see each other.
        unreset = torch.cat([model(mb.inputs, document_ids=mb.document_ids) for mb in mbs])
        torch.testing.assert_close(unreset, want, **TOL)
        unmasked = torch.cat([model(mb.inputs, positions=mb.positions) for mb in mbs])
    assert (unmasked - want).abs().max() > 1e-3


def test_expanded_kv_and_flex_masks_give_the_same_attention():
    """The SDPA mask with enable_gqa, with K/V copied per head (the context-parallel path), and
    FlexAttention's block mask (CUDA's kernel; its forward runs on CPU too) agree."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g)
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16], dtype=torch.int32)
    sdpa = grouped_attention(q, k, v, mask=document_attention_mask(ids, "sdpa"))
    torch.testing.assert_close(grouped_attention(q, k, v, expand_kv=True, mask=document_attention_mask(ids, "sdpa")),
                               sdpa, **TOL)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bm = create_block_mask(lambda b, h, qi, ki: (ids[b, qi] == ids[b, ki]) & (ki <= qi), 2, None, 16, 16, device="cpu")
    with pytest.warns(UserWarning):  # uncompiled flex on CPU says it is slow; numbers are what count
        flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(flex, sdpa, **TOL)
    # A single-document row with the mask is plain causal attention.
    torch.testing.assert_close(sdpa[1:], grouped_attention(q[1:], k[1:], v[1:]), **TOL)


def test_backward_through_the_mask_equals_documents_alone():
    """CPU SDPA with a boolean mask: the packed loss's gradients are those of the documents' losses."""
    cfg = _cfg("dense_gqa")
    docs, mbs = packed_rows(cfg.vocab_size)
    packed, alone = plain_model(cfg), plain_model(cfg)
    loss_p = sum(F.cross_entropy(packed(mb.inputs, positions=mb.positions, document_ids=mb.document_ids)[0],
                                 mb.labels[0], reduction="sum") for mb in mbs)
    loss_a = 0
    for row, mb in zip(docs, mbs):
        logits = torch.cat([alone(d) for d in row], dim=1)[0]
        loss_a = loss_a + F.cross_entropy(logits, mb.labels[0], reduction="sum")
    loss_p.backward()
    loss_a.backward()
    torch.testing.assert_close(loss_p, loss_a, **TOL)
    for (name, a), b in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("key", ["dense_gqa", "moe"])
def test_no_ids_is_bitwise_todays_path(key):
    """document_ids=None, positions=None: the model computes exactly the plain causal forward, and an
    engine given Microbatch records without them trains bit for bit as with plain (inputs, labels)."""
    cfg = _cfg(key)
    model = plain_model(cfg)
    x = packed_rows(cfg.vocab_size)[1][0].inputs
    with torch.no_grad():
        assert torch.equal(model(x, positions=None, document_ids=None), model(x))
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    assert torch.equal(grouped_attention(q, k, v, mask=None),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    _, mbs = packed_rows(cfg.vocab_size)
    plain = [(mb.inputs, mb.labels) for mb in mbs]
    records = [Microbatch(mb.inputs, mb.labels) for mb in mbs]
    a, b = native_engine(cfg, 1), native_engine(cfg, 1)
    for _ in range(2):
        sa, sb = a.train_step(plain), b.train_step(records)
        assert (sa.loss, sa.grad_norm) == (sb.loss, sb.grad_norm)
        assert sa.source_loss == sb.source_loss == {}
    assert a.eval_step(plain) == b.eval_step(records)


def _reference_losses(cfg):
    """Mean token loss and per-source loss of the packed batch from the documents run alone."""
    docs, mbs = packed_rows(cfg.vocab_size)
    logits = reference_logits(plain_model(cfg), docs)
    per = F.cross_entropy(logits.flatten(0, 1), torch.cat([mb.labels for mb in mbs]).flatten(),
                          reduction="none").view(len(mbs), -1)
    by_source = {}
    for row, s in enumerate(SOURCES):
        tot, n = by_source.get(s, (0.0, 0))
        by_source[s] = (tot + float(per[row].sum()), n + per.shape[1])
    return float(per.mean()), {s: t / n for s, (t, n) in by_source.items()}


@pytest.mark.parametrize("key", ["dense_gqa", "moe"])
def test_engine_loss_and_source_loss_on_one_rank(key):
    cfg = _cfg(key)
    loss, by_source = _reference_losses(cfg)
    engine = native_engine(cfg, 1)
    _, mbs = packed_rows(cfg.vocab_size)
    ev = engine.eval_stats(mbs)
    assert ev.loss == pytest.approx(loss, rel=1e-5)
    assert ev.tokens == len(mbs) * mbs[0].labels.shape[1]
    assert ev.source_loss.keys() == by_source.keys()
    for s, want in by_source.items():
        assert ev.source_loss[s] == pytest.approx(want, rel=1e-5)
    assert ev.source_tokens == {0: 32.0, 1: 16.0, 2: 16.0}
    st = engine.train_step(mbs)
    assert st.loss == pytest.approx(loss, rel=1e-5)
    assert st.source_loss == pytest.approx(ev.source_loss, rel=1e-6)


def test_engine_masking_with_activation_checkpointing():
    """Selective (op) and full checkpointing recompute the blocks with the same mask: same loss and grads."""
    cfg = _cfg("dense_gqa")
    loss, _ = _reference_losses(cfg)
    _, mbs = packed_rows(cfg.vocab_size)
    ac = native_engine(cfg, 1, **{"activation_checkpointing.mode": "selective"}).train_step(mbs)
    assert ac.loss == pytest.approx(loss, rel=1e-5)
    full = native_engine(cfg, 1, **{"activation_checkpointing.mode": "full"}).train_step(mbs)
    assert full.grad_norm == pytest.approx(ac.grad_norm, rel=1e-5)


def _tiny_deepseek_v3():
    """DeepSeek-V3's block (MLA, YaRN, sigmoid group-limited router with a correction bias)."""
    from launcher.config.schema import ModelConfig
    from tests.test_deepseek_v3 import TINY

    return ModelConfig(**{**TINY, "n_layers": 2})  # one dense block, one MoE block


@pytest.mark.parametrize("key", ["dense_gqa", "qwen3_moe", "deepseek_v3"])
def test_engine_masking_with_compile(key):
    """Compiled blocks take the mask and the per-row RoPE table as inputs, for each family's block:
    Llama (GQA), Qwen3 (QK-norm, wide head_dim; MoE partly compiled) and DeepSeek-V3 (MLA with its
    YaRN table; a dense block compiled whole, MoE blocks partly). 10-20 s of compiling each."""
    cfg = _tiny_deepseek_v3() if key == "deepseek_v3" else _cfg(key)
    _, mbs = packed_rows(cfg.vocab_size)
    eager = native_engine(cfg, 1).train_step(mbs)
    from torch._dynamo.utils import counters  # dynamo's own count of the graphs it compiled

    graphs = counters["stats"]["unique_graphs"]
    compiled = native_engine(cfg, 1, **{"trainer.compile": True}).train_step(mbs)
    assert counters["stats"]["unique_graphs"] > graphs, "trainer.compile=true compiled no graph"
    assert compiled.loss == pytest.approx(eager.loss, rel=1e-5)
    assert compiled.grad_norm == pytest.approx(eager.grad_norm, rel=1e-5)


def test_deepspeed_pipeline_with_document_masking_is_refused_before_launch():
    from launcher.config.errors import ConfigError
    from tests.layout_for import layout_for

    cfg = _cfg("dense_gqa")
    # ZeRO-1 over dp=2 exists only in DeepSpeed, whose pipeline engine would then run the stages.
    with pytest.raises(ConfigError, match="takes no per-token document ids or positions.*Fix:"):
        layout_for(cfg, 4, **{"parallel.pp": 2, "parallel.zero_stage": 1, "data.document_masking": True})
    with pytest.raises(ConfigError, match="data.document_masking=false data.reset_positions=false"):
        layout_for(cfg, 2, **{"parallel.pp": 2, "parallel.zero_stage": 1, "backend.pp": "deepspeed",
                              "data.reset_positions": True})
    # Without masking the same layout rides on DeepSpeed's pipeline; with it the native one serves.
    assert layout_for(cfg, 4, **{"parallel.pp": 2, "parallel.zero_stage": 1}).owners.pp_backend == "deepspeed"
    assert layout_for(cfg, 4, **{"parallel.pp": 2, "data.document_masking": True}).owners.pp_backend == "native"


# ----------------------------------------------------------------------------- tp=2 and pp=2

LAYOUTS = [
    {"name": "tp2_dense", "model": "debug", "mesh": {"tp": 2}},
    {"name": "tp2_sp_moe", "model": "debug_moe", "mesh": {"tp": 2}, "sp": True},
    {"name": "pp2_dense", "model": "debug", "mesh": {"pp": 2}, "pp_schedule": "1f1b"},
    {"name": "pp2_moe", "model": "debug_moe", "mesh": {"pp": 2}, "pp_schedule": "gpipe"},
    # FSDP2 over 2 data-parallel ranks, experts split over ep=2 (each rank its own rows).
    {"name": "fsdp2_ep2_moe", "model": "debug_moe", "mesh": {"dp_shard": 2, "ep": 2}},
    # All-gather context parallelism (cp=2, each packed row split per document): GQA Llama,
    # Qwen3's QK-norm with a wide head_dim, DeepSeek-V3's MLA (gathered latent + RoPE key) and MoE.
    {"name": "cp2_dense", "model": "debug", "mesh": {"cp": 2}},
    {"name": "cp2_qk_norm", "model": "debug", "mesh": {"cp": 2},
     "overrides": {"family": "qwen3", "qk_norm": True, "head_dim": 24}},
    {"name": "cp2_mla", "model": "deepseek_v3_tiny", "mesh": {"cp": 2}},
    # Full activation checkpointing recomputes each block's forward, its K/V all-gather included.
    {"name": "cp2_ac_dense", "model": "debug", "mesh": {"cp": 2}, "dotted": {"activation_checkpointing.mode": "full"}},
]


# DeepSpeed in the same launch: ZeRO-1 over dp=2 with its own checkpointing (positions and ids
# through deepspeed.checkpointing); its pipeline engine with sources only (masking is refused).
DEEPSPEED = [
    {"name": "ds_zero1_ac_dense", "kind": "deepspeed", "model": "debug",
     "dotted": {"parallel.zero_stage": 1, "activation_checkpointing.mode": "full"}},
    {"name": "ds_pp2_sources_dense", "kind": "deepspeed", "model": "debug", "masking": False,
     "dotted": {"parallel.pp": 2, "parallel.zero_stage": 1, "backend.pp": "deepspeed"}},
    {"name": "ds_pp2_masking_refused", "kind": "deepspeed", "model": "debug",
     "dotted": {"parallel.pp": 2, "parallel.zero_stage": 1, "backend.pp": "deepspeed"}},
]


def _launch(specs: list, work: Path) -> dict:
    """One 2-rank torchrun of tests/masking_harness.py over `specs`; its results by layout name."""
    layouts, out = work / "layouts.json", work / "results.json"
    layouts.write_text(json.dumps(specs))
    env = dict(os.environ, TMPDIR=str(work))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "masking_harness.py"), str(layouts), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"2-rank launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(LAYOUTS, tmp_path_factory.mktemp("masking"))


@pytest.fixture(scope="module")
def deepspeed_two_ranks(tmp_path_factory):
    # Its own launch: DeepSpeed's import and initialisation cost more than the native layouts.
    return _launch(DEEPSPEED, tmp_path_factory.mktemp("masking_deepspeed"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", LAYOUTS, ids=[s["name"] for s in LAYOUTS])
def test_parallel_layouts_mask_like_one_rank(two_ranks, spec):
    got = two_ranks[spec["name"]]
    assert "error" not in got, got.get("traceback", got.get("error"))
    assert got["logits_max_diff"] and max(got["logits_max_diff"]) < 1e-5, got["logits_max_diff"]
    cfg = layout_model_cfg(spec)
    loss, by_source = _reference_losses(cfg)
    assert got["eval"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert {int(s): v for s, v in got["eval"]["source_loss"].items()} == pytest.approx(by_source, rel=1e-5)
    one = native_engine(cfg, 1).train_step(packed_rows(cfg.vocab_size)[1])
    assert got["train"]["loss"] == pytest.approx(one.loss, rel=1e-5)
    assert got["train"]["grad_norm"] == pytest.approx(one.grad_norm, rel=1e-4)
    assert {int(s): v for s, v in got["train"]["source_loss"].items()} == pytest.approx(one.source_loss, rel=1e-5)


# ----------------------------------------------------------------------------- the planner


def test_planner_costs_the_mask_the_model_saves():
    """The plan's mask bytes are the one tensor every layer's attention saves for backward, and the
    mask adds exactly that per micro-batch in flight to the activations (and time to the step)."""
    from dataclasses import replace as dc_replace

    from launcher.plan.estimate.memory import document_mask_bytes, estimate_memory
    from launcher.plan.estimate.params import model_shape
    from launcher.config.loader import compose_spec
    from launcher.plan.estimate.params import stage_params
    from launcher.plan.estimate.perf import document_mask_s, microbatch_compute_s
    from tests.layout_for import layout_for

    cfg = _cfg("dense_gqa")
    lay = layout_for(cfg, 1, **{"data.document_masking": True})
    assert lay.document_mask == "sdpa"  # job_spec plans a CPU run
    assert layout_for(cfg, 1, **{"data.document_masking": True, "trainer.device": "cuda"}).document_mask == "flex"
    assert layout_for(cfg, 1).document_mask == "none"

    model = plain_model(cfg)
    _, mbs = packed_rows(cfg.vocab_size)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        model(mbs[0].inputs, positions=mbs[0].positions, document_ids=mbs[0].document_ids)
    masks = {t.data_ptr(): t for t in saved if t.dim() == 4 and t.shape[1] == 1}
    assert len(masks) == 1, "every layer must save the same mask tensor"
    (mask,) = masks.values()
    assert mask.numel() * mask.element_size() == document_mask_bytes(lay)

    shape = model_shape(cfg)
    plain = dc_replace(lay, document_mask="none")
    grown = estimate_memory(shape, lay)[0].activations - estimate_memory(shape, plain)[0].activations
    assert grown == int(document_mask_bytes(lay))
    hw = compose_spec([]).hardware
    st = stage_params(shape, 1, 1, lay.schedule, ())[0]
    extra = microbatch_compute_s(shape, st, lay, hw) - microbatch_compute_s(shape, st, plain, hw)
    assert extra == pytest.approx(document_mask_s(st, lay, hw)) and extra > 0
    flex = dc_replace(lay, document_mask="flex")
    assert document_mask_s(st, flex, hw) == 0.0  # costed as plain causal attention (an upper bound)
    assert 0 < document_mask_bytes(flex) < document_mask_bytes(lay)



def _check_against_one_rank(got: dict, cfg, mbs) -> None:
    one = native_engine(cfg, 1)
    ev = one.eval_stats(mbs)
    st = one.train_step(mbs)
    assert got["eval"]["loss"] == pytest.approx(ev.loss, rel=1e-5)
    assert {int(s): v for s, v in got["eval"]["source_loss"].items()} == pytest.approx(ev.source_loss, rel=1e-5)
    assert got["train"]["loss"] == pytest.approx(st.loss, rel=1e-5)
    assert got["train"]["grad_norm"] == pytest.approx(st.grad_norm, rel=1e-4)
    assert {int(s): v for s, v in got["train"]["source_loss"].items()} == pytest.approx(st.source_loss, rel=1e-5)


@pytest.mark.multiprocess
def test_deepspeed_zero1_with_masking_matches_one_rank(deepspeed_two_ranks):
    got = deepspeed_two_ranks["ds_zero1_ac_dense"]
    assert "error" not in got, got.get("traceback", got.get("error"))
    assert got["layout"] == {"sharding": "deepspeed", "pp": "deepspeed", "ac": "deepspeed"}
    cfg = model_cfg("debug")
    _check_against_one_rank(got, cfg, packed_rows(cfg.vocab_size)[1])


@pytest.mark.multiprocess
def test_deepspeed_pipeline_reports_source_loss_and_refuses_masking(deepspeed_two_ranks):
    got = deepspeed_two_ranks["ds_pp2_sources_dense"]
    assert "error" not in got, got.get("traceback", got.get("error"))
    assert got["layout"]["pp"] == "deepspeed"
    cfg = model_cfg("debug")
    plain = [mb._replace(positions=None, document_ids=None) for mb in packed_rows(cfg.vocab_size)[1]]
    _check_against_one_rank(got, cfg, plain)
    refused = deepspeed_two_ranks["ds_pp2_masking_refused"]
    assert "refused" in refused and "Fix:" in refused["refused"], refused
