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
from launcher.parallel.cp import key_order, shard_for_allgather, shard_positions, to_sequence_order
from launcher.parallel.cp_balance import rank_positions
from launcher.plan.estimate.cp_allgather import gathered_bytes_per_token, repeated_up_projection_params
from launcher.plan.estimate.params import model_shape
from tests.layout_for import layout_for
from tests.masking_harness import layout_model_cfg, plain_model

SEQ, CP = 16, 2
DOCS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])


def _rank_mask(rank: int, docs=DOCS):
    """What rank `rank` of cp=2 attends to, as a [b, s_q, S] boolean over the rank-ordered keys:
    with documents each row's own per-document split (the engine's), else the head-tail one."""
    split = rank_positions(SEQ, CP, docs)  # [1 or b, cp, s/cp]
    mine, keys = (split[0, rank], split[0].reshape(-1)) if docs is None else (split[:, rank], split.reshape(2, -1))
    qd = docs.gather(1, mine) if docs is not None else None
    kd = docs.gather(1, keys) if docs is not None else None
    sdpa = attention_mask(mine, keys, qd, kd, kernel="sdpa")[:, 0]
    flex = create_mask(flex_mask_mod(mine, keys, qd, kd), sdpa.shape[0], 1, mine.shape[-1], keys.shape[-1],
                       device="cpu")[:, 0]
    return mine, keys, sdpa, flex


@pytest.mark.parametrize("docs", [DOCS, None], ids=["documents", "causal"])
def test_each_rank_sees_exactly_its_queries_causal_document_keys(docs):
    """Rank r's mask over the rank-ordered gathered keys, put back in sequence order, is the rows
    of the whole sequence's (block-)causal mask at r's positions (per row with documents); the
    FlexAttention mask_mod (the CUDA block mask's rule) is the same mask."""
    index = torch.arange(SEQ)
    whole = attention_mask(index, index, docs, docs, kernel="sdpa")[:, 0].expand(2, -1, -1)
    for rank in range(CP):
        mine, keys, sdpa, flex = _rank_mask(rank, docs)
        assert torch.equal(sdpa, flex)
        for row in range(sdpa.shape[0]):
            k, q = (keys, mine) if keys.dim() == 1 else (keys[row], mine[row])
            in_order = torch.empty_like(sdpa[row])
            in_order[:, k] = sdpa[row]
            assert torch.equal(in_order, whole[row, q])
    # Head-tail: every rank gets the same number of causal (query, key) pairs.
    pairs = [int(_rank_mask(r, None)[2].sum()) for r in range(CP)]
    assert pairs[0] == pairs[1] == SEQ * (SEQ + 1) // 2 // CP


def _pairs_per_rank(docs: torch.Tensor, cp: int, per_document: bool):
    """The unmasked (query, key) pairs of each cp rank's queries over one packed row: its slice
    under the per-document split (what the engine runs) or the row-level head-tail split."""
    s = docs.shape[1]
    split = rank_positions(s, cp, docs if per_document else None)[0]
    keys = split.reshape(-1)
    return [int(attention_mask(split[r], keys, docs[:, split[r]], docs[:, keys], kernel="sdpa").sum())
            for r in range(cp)]


def test_per_document_split_evens_the_causal_work_of_packed_rows():
    """A row of uneven documents (a long one at the end, lengths not multiples of 2*cp): head-tail
    over the row gives the rank holding the long document's tail several times the work of the
    others; the per-document split gives each rank the same number of tokens and its share of the
    row's unmasked pairs to within 1 % (the middle tokens that do not divide evenly)."""
    lengths, cp = [7, 3, 12, 1, 5, 36], 4
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    total = sum(n * (n + 1) // 2 for n in lengths)
    head_tail = _pairs_per_rank(docs, cp, per_document=False)
    balanced = _pairs_per_rank(docs, cp, per_document=True)
    assert sum(head_tail) == sum(balanced) == total
    assert max(head_tail) / min(head_tail) > 2.5  # measured: 3.1 (289 vs 92 pairs)
    assert max(balanced) - min(balanced) <= 0.01 * total / cp, balanced  # measured: 199 vs 198
    split = rank_positions(docs.shape[1], cp, docs)[0]
    assert sorted(split.reshape(-1).tolist()) == list(range(docs.shape[1]))  # each token held once
    # One document: the per-document split is the head-tail split.
    assert rank_positions(SEQ, CP, torch.zeros(1, SEQ, dtype=torch.long)).tolist() == rank_positions(SEQ, CP).tolist()


def test_per_document_slices_take_each_row_at_its_split_and_reorder_back():
    """shard_for_allgather with document ids: each row gets its own split (its tokens, labels,
    reset positions and document ids taken at it, the keys' ids in rank order), and
    to_sequence_order puts the ranks' gathered outputs back in sequence order."""
    b, s = DOCS.shape
    tokens = torch.arange(b * s).view(b, s)
    reset = torch.cat([torch.arange(n) for n in (5, 7, 4)]).unsqueeze(0).repeat(b, 1)
    outs = []
    for rank in range(CP):
        x, y, kw = shard_for_allgather(tokens, tokens + 1, {"positions": reset, "document_ids": DOCS}, CP, rank)
        mine = kw["keys"].query_index
        assert mine.shape == (b, s // CP) and not torch.equal(mine[0], mine[1])  # the rows differ
        assert torch.equal(x, tokens.gather(1, mine)) and torch.equal(y, x + 1)
        assert torch.equal(kw["positions"], reset.gather(1, mine))
        assert torch.equal(kw["document_ids"], DOCS.gather(1, mine))
        keys = kw["keys"].key_index
        assert torch.equal(kw["keys"].key_document_ids, DOCS.gather(1, keys))
        assert torch.equal(keys.view(b, CP, -1)[:, rank], mine)  # the keys arrive in rank order
        outs.append(x)
    assert torch.equal(to_sequence_order(torch.cat(outs, dim=1), keys), tokens)


def test_auto_picks_allgather_where_ring_cannot_run_and_says_why():
    cfg = layout_model_cfg({"model": "debug"})
    assert layout_for(cfg, 2, **{"parallel.cp": 2}).owners.cp_impl == "allgather"  # CPU
    cuda = {"parallel.cp": 2, "trainer.device": "cuda"}
    masked = layout_for(cfg, 2, **cuda, **{"data.document_masking": True})
    assert masked.owners.cp_impl == "allgather"
    why = dict(masked.owners.choices)["cp"].impl
    assert "allgather" in why and "document mask" in why
    assert layout_for(cfg, 2, **cuda, **{"backend.cp_impl": "ring"}).owners.cp_impl == "ring"
    assert layout_for(cfg, 1).owners.cp_impl == "off"
    # Multi-token prediction cuts its shifted tokens and targets with the all-gather slice.
    mtp = layout_for(layout_model_cfg({"model": "debug_moe", "overrides": {"family": "deepseek_v3", "mtp_layers": 1}}),
                     2, **cuda)
    assert mtp.owners.cp_impl == "allgather" and "multi-token" in dict(mtp.owners.choices)["cp"].impl
    # Under pipelining the schedule takes the all-gather slices (ring would need its region per stage).
    piped = layout_for(cfg, 4, **cuda, **{"parallel.pp": 2})
    assert piped.owners.cp_impl == "allgather" and "pipeline" in dict(piped.owners.choices)["cp"].impl


def _llama8b(seq_len: int, cp: int = 8, **dotted):
    """Llama-3-8B on one node of 8 H100s (the default hardware), cp ranks, full recompute."""
    from tests.test_models import model_cfg

    return layout_for(model_cfg("llama3_8b"), 8, **{
        "parallel.cp": cp, "trainer.device": "cuda", "trainer.seq_len": seq_len, "model.max_seq_len": seq_len,
        "trainer.global_batch_size": 8 // cp, "precision.name": "bf16", "activation_checkpointing.mode": "full",
        **dotted})


def test_auto_picks_by_memory_on_gpus_and_says_why():
    """backend.cp_impl=auto on GPUs (h100_sxm, 80 GiB): all-gather where the plan with it fits, ring
    where it does not and ring needs less, all-gather where ring cannot run (documents), and the
    reason in the plan's "cp" row gives the gathered K/V per layer and the memory against the GPU.
    Llama-3-8B, cp=8, full recompute: at 128K tokens the plan with all-gather fits; at 1M neither
    fits and ring (K/V at seq_len/cp) needs less. At cp=2 without recompute ring (K/V repeated to
    the 32 query heads, saved in every layer) needs more than all-gather (the 8 kv heads' K/V of
    the whole sequence)."""
    from launcher.plan.estimate.memory import estimate_memory, most_loaded
    from launcher.plan.estimate.params import model_shape
    from tests.test_models import model_cfg

    def total(lay):
        return most_loaded(estimate_memory(model_shape(model_cfg("llama3_8b")), lay, 2 * 1024**3)).total

    short = _llama8b(131072)
    why = dict(short.owners.choices)["cp"].impl
    assert short.owners.cp_impl == "allgather", why
    assert total(short) <= 80 * 1024**3
    assert "the gathered K/V (0.5 GiB per layer at seq_len 131072) fit" in why and "h100_sxm" in why

    long = _llama8b(1048576)
    why = dict(long.owners.choices)["cp"].impl
    assert long.owners.cp_impl == "ring", why
    assert "the gathered K/V (4.0 GiB per layer at seq_len 1048576) do not fit" in why
    assert total(long) < total(_llama8b(1048576, **{"backend.cp_impl": "allgather"}))

    two = _llama8b(32768, cp=2, **{"activation_checkpointing.mode": "none"})
    why = dict(two.owners.choices)["cp"].impl
    assert two.owners.cp_impl == "allgather" and "do not fit" in why and "all-gather, the smaller" in why

    packed = _llama8b(1048576, **{"data.document_masking": True})
    why = dict(packed.owners.choices)["cp"].impl
    assert packed.owners.cp_impl == "allgather" and "takes no document mask" in why and "do not fit" in why


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
