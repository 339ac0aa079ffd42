"""All-gather context parallelism's pieces that one process can check (the 2- and 4-rank runs are
in tests/test_document_masking.py and the layout matrix, tests/test_parallel_layouts.py):
the mask of a rank's queries over the rank-ordered gathered keys (SDPA's tensor and the
FlexAttention mask_mod CUDA uses), backend.cp_impl's resolution and refusals, and the planner's
gathered bytes and MLA up-projection against the real model's tensors."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from launcher.config.errors import ConfigError
from launcher.models.layers import KeyIndex, attention_mask, flex_mask_mod
from launcher.parallel.cp import key_order, shard_positions
from launcher.plan.estimate.cp_allgather import gathered_bytes_per_token, repeated_up_projection_params
from launcher.plan.estimate.params import model_shape
from tests.layout_for import layout_for
from tests.masking_harness import layout_model_cfg, plain_model

SEQ, CP = 16, 2
DOCS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])


def _rank_mask(rank: int, docs=DOCS):
    """What rank `rank` of cp=2 attends to, as a [b, s_q, S] boolean in sequence order of the keys."""
    mine = torch.tensor(shard_positions(SEQ, CP, rank))
    keys = torch.tensor(key_order(SEQ, CP))
    qd = docs[:, mine] if docs is not None else None
    kd = docs[:, keys] if docs is not None else None
    sdpa = attention_mask(mine, keys, qd, kd, kernel="sdpa")[:, 0]
    flex = create_mask(flex_mask_mod(mine, keys, qd, kd), sdpa.shape[0], 1, len(mine), len(keys), device="cpu")[:, 0]
    return mine, keys, sdpa, flex


@pytest.mark.parametrize("docs", [DOCS, None], ids=["documents", "causal"])
def test_each_rank_sees_exactly_its_queries_causal_document_keys(docs):
    """Rank r's mask over the rank-ordered gathered keys, put back in sequence order, is the rows
    of the whole sequence's (block-)causal mask at r's positions; the FlexAttention mask_mod
    (the CUDA block mask's rule) is the same mask."""
    index = torch.arange(SEQ)
    whole = attention_mask(index, index, docs, docs, kernel="sdpa")[:, 0]
    for rank in range(CP):
        mine, keys, sdpa, flex = _rank_mask(rank, docs)
        assert torch.equal(sdpa, flex)
        in_order = torch.empty_like(sdpa)
        in_order[:, :, keys] = sdpa
        assert torch.equal(in_order, whole.expand(sdpa.shape[0], -1, -1)[:, mine])
    # Head-tail: every rank gets the same number of causal (query, key) pairs.
    pairs = [int(_rank_mask(r, None)[2].sum()) for r in range(CP)]
    assert pairs[0] == pairs[1] == SEQ * (SEQ + 1) // 2 // CP


def test_auto_picks_allgather_where_ring_cannot_run_and_says_why():
    cfg = layout_model_cfg({"model": "debug"})
    assert layout_for(cfg, 2, **{"parallel.cp": 2}).owners.cp_impl == "allgather"  # CPU
    cuda = {"parallel.cp": 2, "trainer.device": "cuda"}
    assert layout_for(cfg, 2, **cuda).owners.cp_impl == "ring"
    masked = layout_for(cfg, 2, **cuda, **{"data.document_masking": True})
    assert masked.owners.cp_impl == "allgather"
    why = dict(masked.owners.choices)["cp"].impl
    assert "allgather" in why and "document mask" in why
    assert layout_for(cfg, 2, **cuda, **{"backend.cp_impl": "allgather"}).owners.cp_impl == "allgather"
    assert layout_for(cfg, 1).owners.cp_impl == "off"
    # Multi-token prediction cuts its shifted tokens and targets with the all-gather slice.
    mtp = layout_for(layout_model_cfg({"model": "debug_moe", "overrides": {"family": "deepseek_v3", "mtp_layers": 1}}),
                     2, **cuda)
    assert mtp.owners.cp_impl == "allgather" and "multi-token" in dict(mtp.owners.choices)["cp"].impl


def test_ring_where_it_cannot_run_is_refused_with_the_fix():
    cfg = layout_model_cfg({"model": "debug"})
    with pytest.raises(ConfigError, match="ring attention has no CPU kernel.*Fix: backend.cp_impl=allgather"):
        layout_for(cfg, 2, **{"parallel.cp": 2, "backend.cp_impl": "ring"})
    with pytest.raises(ConfigError, match="takes no document mask.*Fix: backend.cp_impl=allgather"):
        layout_for(cfg, 2, **{"parallel.cp": 2, "backend.cp_impl": "ring", "trainer.device": "cuda",
                              "data.reset_positions": True})
    mtp = layout_model_cfg({"model": "debug_moe", "overrides": {"family": "deepseek_v3", "mtp_layers": 1}})
    with pytest.raises(ConfigError, match="model.mtp_layers > 0.*Fix: backend.cp_impl=allgather"):
        layout_for(mtp, 2, **{"parallel.cp": 2, "backend.cp_impl": "ring", "trainer.device": "cuda"})
    with pytest.raises(ConfigError, match="backend.cp_impl=bogus is not one of auto, allgather, ring"):
        layout_for(cfg, 2, **{"parallel.cp": 2, "backend.cp_impl": "bogus"})


@pytest.mark.parametrize("spec", [{"model": "debug"}, {"model": "deepseek_v3_tiny"}], ids=["gqa", "mla"])
def test_planner_gathers_the_bytes_the_model_gathers(spec):
    """The planner's gathered bytes per token are the tensor each attention layer hands to the
    all-gather (GQA: the kv heads' K and V, not repeated; MLA: the latent and the RoPE key), and
    its repeated up-projection is MLA's wkv_b."""
    cfg = layout_model_cfg(spec)
    lay = layout_for(cfg, 2, **{"parallel.cp": 2})
    model = plain_model(cfg)
    sent = []

    def gather(x):  # stands in for the all-gather: the other rank's half is a copy
        sent.append(x)
        return torch.cat([x, x], dim=1)

    for m in model.modules():
        if hasattr(m, "kv_gather"):
            m.kv_gather = gather
    mine = torch.tensor(shard_positions(SEQ, CP, 0))
    keys = KeyIndex(query_index=mine, key_index=torch.tensor(key_order(SEQ, CP)))
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, SEQ // CP)), positions=mine.unsqueeze(0), keys=keys)
    assert len(sent) == cfg.n_layers
    local = sent[0]
    assert local.numel() * local.element_size() / local.shape[1] == gathered_bytes_per_token(model_shape(cfg), lay)
    wkv_b = [m.wkv_b.weight.numel() for m in model.modules() if hasattr(m, "wkv_b")]
    assert repeated_up_projection_params(model_shape(cfg)) == (wkv_b[0] if wkv_b else 0)
