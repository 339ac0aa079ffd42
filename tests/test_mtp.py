"""DeepSeek-V3's multi-token prediction (model.mtp_layers, launcher/models/mtp.py): the released
layer-{num_hidden_layers} tensors load and export exactly, and the forward is the release's
(embedding first in eh_proj's input), checked against a transcription written here from the raw
HF tensors."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from launcher.config.hf_model import hf_model_fields
from launcher.config.schema import ModelConfig
from launcher.hf.format import folder_mtp_layers, folder_problems, read_hf_config
from launcher.hf.weights import export_hf, load_hf_weights
from launcher.models import build_model
from launcher.models.mtp import IGNORE_INDEX, shifted_labels


def mtp_folder(folder, seed: int = 0):
    """A tiny DeepSeek-V3 saved by transformers with num_nextn_predict_layers=1, and the layer-3
    (= num_hidden_layers) multi-token-prediction tensors added as the release lays them out: enorm,
    hnorm, eh_proj, a full MoE decoder block, shared_head.norm (all random), and embed_tokens /
    shared_head.head, copies of the main model's. transformers builds no MTP, so the test writes them."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.test_hf_weights import DEEPSEEK_V3, _randomize_norms

    torch.manual_seed(seed)
    _randomize_norms(DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_V3, q_lora_rank=16,
                                                            num_nextn_predict_layers=1))).save_pretrained(folder)
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed + 1)
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:  # an MoE block's names
        t = tensors[name]
        tensors["model.layers.3." + name[len("model.layers.2."):]] = (torch.randn(t.shape, generator=gen) * 0.1).to(t.dtype)
    dim = DEEPSEEK_V3["hidden_size"]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.3.{name}.weight"] = 1 + 0.2 * torch.randn(dim, generator=gen)
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(dim, 2 * dim, generator=gen) * 0.1
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {n: path.name for n in tensors}
        index.write_text(json.dumps(data))
    return folder


def _loaded(folder):
    fields = dict(hf_model_fields(read_hf_config(folder)), mtp_layers=folder_mtp_layers(str(folder)))
    cfg = ModelConfig(name="hf", init_from=str(folder), **fields)
    model = build_model(cfg)
    load_hf_weights([model], str(folder), cfg)
    return model, cfg


def test_layer_n_mtp_tensors_load_and_export_exactly(tmp_path):
    """model=hf reads model.mtp_layers=1 from num_nextn_predict_layers (transformers' own save of the
    same config, which keeps the key but writes no MTP layer, gives 0); the folder passes the check;
    an fp32 export has every source tensor (the layer-3 copies of embed_tokens and shared_head.head
    included) byte for byte, and says num_nextn_predict_layers: 1."""
    from tests.test_hf_weights import _assert_byte_identical

    src = mtp_folder(tmp_path / "src")
    model, cfg = _loaded(src)
    assert cfg.mtp_layers == 1 and folder_problems(cfg, str(src)) == []
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.test_hf_weights import DEEPSEEK_V3
    DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_V3, num_nextn_predict_layers=1)).save_pretrained(tmp_path / "plain")
    assert read_hf_config(tmp_path / "plain")["num_nextn_predict_layers"] == 1
    assert folder_mtp_layers(str(tmp_path / "plain")) == 0
    assert torch.equal(model.mtp["0"].eh_proj.weight, _raw(src)["model.layers.3.eh_proj.weight"])
    export_hf([model], None, tmp_path / "out", cfg, "fp32")
    _assert_byte_identical(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def _raw(folder) -> dict:
    from tests.test_hf_weights import _hf_tensors

    return _hf_tensors(folder)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_forward_is_the_releases_order_embedding_first(tmp_path):
    """The MTP loss equals a transcription from the raw HF tensors in the release's order:
    h1 = block(eh_proj([enorm(Emb(t_{i+1})); hnorm(h0)])), logits = shared_head.head(shared_head.norm(h1)),
    targets t_{i+2}; h0 is the main model's final-normed hidden state. The same transcription with
    the embedding and hidden halves swapped gives another loss (so this test tells the orders apart)."""
    src = mtp_folder(tmp_path / "src")
    model, cfg = _loaded(src)
    raw = _raw(src)
    eps = cfg.norm_eps
    toks = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    labels = torch.roll(toks, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    h0 = {}
    model.norm.register_forward_hook(lambda m, i, o: h0.setdefault("h", o))
    with torch.no_grad():
        model(toks, mtp_labels=labels)
    ours = model.last_mtp_loss  # sum over the depth's counted tokens (one depth)

    def transcribed(embedding_first: bool) -> torch.Tensor:
        p = "model.layers.3."
        e = _rms(F.embedding(torch.roll(toks, -1, 1), raw["model.layers.3.embed_tokens.weight"]),
                 raw[p + "enorm.weight"], eps)
        h = _rms(h0["h"], raw[p + "hnorm.weight"], eps)
        x = F.linear(torch.cat([e, h] if embedding_first else [h, e], -1), raw[p + "eh_proj.weight"])
        with torch.no_grad():
            x = model.mtp["0"].block(x, model.rope)  # the block itself: the decoder's, parity-tested
        logits = F.linear(_rms(x, raw[p + "shared_head.norm.weight"], eps), raw[p + "shared_head.head.weight"])
        targets = torch.full_like(toks, IGNORE_INDEX)
        targets[:, :-2] = toks[:, 2:]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    assert torch.allclose(ours, transcribed(True), rtol=1e-5, atol=1e-5), (ours, transcribed(True))
    assert not torch.allclose(ours, transcribed(False), rtol=1e-3)


def test_targets_shift_and_stop_at_document_boundaries():
    """Depth k's target at i is labels[i + k], ignored past the sequence's end and wherever i + k is
    in another document than i."""
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert shifted_labels(labels, 1).tolist() == [[11, 12, 13, 14, 15, -100]]
    assert shifted_labels(labels, 1, docs).tolist() == [[11, 12, -100, 14, 15, -100]]
    assert shifted_labels(labels, 2, docs).tolist() == [[12, -100, -100, 15, -100, -100]]


def test_context_parallel_slices_keep_the_whole_rows_shift():
    """Under all-gather CP (cp=2, the per-document split of launcher/parallel/cp_balance.py) each
    rank's depth tokens and targets are the whole row's at its positions: a position reads t(p + 1)
    and its target t(p + 2) even where those tokens sit on the other rank; targets stop at the
    document boundary and at the sequence's end."""
    from launcher.models.mtp import mtp_targets
    from launcher.parallel.cp import shard_for_allgather
    from launcher.parallel.cp_balance import rank_positions

    tokens = torch.arange(100, 108).unsqueeze(0)  # t(i) = 100 + i
    labels = tokens + 1  # the main labels: t(i+1)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    shifted, targets = mtp_targets(tokens, labels, 1, docs)
    split = rank_positions(8, 2, docs)[0]
    assert sorted(split.flatten().tolist()) == list(range(8))
    crossing = 0
    for rank in (0, 1):
        mine = split[rank].tolist()
        _, _, kw = shard_for_allgather(tokens, labels, {"document_ids": docs, "mtp_tokens": shifted,
                                                        "mtp_labels": targets}, 2, rank)
        want_targets = [100 + p + 2 if p + 1 < 8 and docs[0, p + 1] == docs[0, p] else -100 for p in mine]
        assert kw["mtp_labels"][0, :, 0].tolist() == want_targets, (rank, mine)
        for i, p in enumerate(mine):
            if p + 1 < 8:  # the last position's depth token wraps and is ignored (its target is -100)
                assert kw["mtp_tokens"][0, i, 0].item() == 101 + p, (rank, p)
                crossing += (p + 1) not in mine
    assert crossing > 0  # some shifts read tokens that only the other rank holds


def test_mtp_gradient_rides_on_the_logits_with_the_engines_scale():
    """The loss's gradient reaches the MTP weights (and the shared embedding) through the main
    logits' backward, scaled by mtp_loss_scale: scale 0 leaves eh_proj without gradient."""
    from tests.test_deepseek_v3 import TINY

    cfg = ModelConfig(**{**TINY, "mtp_layers": 1})
    model = build_model(cfg)
    model.init_weights(0)
    toks = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    grads = []
    for scale in (0.0, 0.5):
        model.zero_grad(set_to_none=True)
        model.mtp_loss_scale = scale
        model(toks, mtp_labels=torch.roll(toks, -1, 1)).sum().backward()
        grads.append(model.mtp["0"].eh_proj.weight.grad)
    assert grads[0].abs().max() == 0 and grads[1].abs().max() > 0


def test_planner_counts_the_mtp_depths():
    """The planner's parameter count equals the built model's with model.mtp_layers=1, and the
    DeepSeek-V3 shape with its one MTP module is the release's 685B (its README's count, with the
    module's copies of the embedding and head).
    The FLOPs per token grow by the depth's active parameters and one more use of the output head."""
    from launcher.config.loader import compose_spec
    from launcher.plan.estimate.flops import training_flops_per_token
    from launcher.plan.estimate.params import model_shape, stage_params

    cfg = compose_spec(["model=deepseek_v3_small", "model.mtp_layers=1"]).model
    with torch.device("meta"):
        model = build_model(cfg)
    assert model_shape(cfg).total == sum(p.numel() for p in model.parameters())
    pp2 = ["parallel.pp=2", "cluster.gpus_per_node=2"]
    v3_job = compose_spec(["model=deepseek_v3", *pp2])  # mtp_layers: 1, as released
    plain_job = compose_spec(["model=deepseek_v3", "model.mtp_layers=0", *pp2])
    v3, no_mtp = v3_job.model, plain_job.model
    shape, plain = model_shape(v3), model_shape(no_mtp)
    # DeepSeek-V3's README: 685B = 671B main + 14B MTP, the MTP module "11.5B unique parameters"
    # besides its copies of the 0.9B embedding and 0.9B head (which we hold once).
    assert round(plain.total / 1e9) == 671 and abs(shape.mtp_total / 1e9 - 11.5) < 0.15
    assert abs((shape.total + shape.embedding + shape.output) / 1e9 - 685) < 1
    assert v3.mtp_layers == 1 and training_flops_per_token(v3, 4096) > training_flops_per_token(no_mtp, 4096)
    stages = stage_params(shape, 2)
    assert stages[-1].shared + stages[-1].routed - (stage_params(plain, 2)[-1].shared + stage_params(plain, 2)[-1].routed) \
        == shape.mtp_total + shape.embedding  # on the last stage, with the head it reuses and its embedding copy
    # Under TP the depth's norms, eh_proj, router and shared expert stay whole on every rank.
    # MLA's down-projections wq_a (7168 x 1536), wkv_a (7168 x 576) and their norms stay whole under TP.
    assert shape.attention_tp_replicated == 7168 * 1536 + 7168 * 576 + 1536 + 512
    assert stages[-1].tp_replicated - stage_params(plain, 2)[-1].tp_replicated == (
        3 * shape.dim + 2 * shape.dim ** 2 + shape.block_norms + shape.attention_tp_replicated + shape.router
        + shape.n_shared_experts * shape.expert)
    # Activations: the last pipeline stage holds the depth's (with the head's, 1F1B: one micro-batch),
    # the first none of them; the depth's block is at least a main MoE block's.
    from launcher.plan.decide.resolve import resolve
    from launcher.plan.estimate.memory import estimate_memory, layer_activation_bytes, mtp_activation_bytes

    lay = resolve(v3_job)
    got, want = estimate_memory(shape, lay), estimate_memory(plain, resolve(plain_job))
    extra = mtp_activation_bytes(shape, lay)
    assert extra > layer_activation_bytes(shape, lay, True, "none")
    assert got[0].activations == want[0].activations
    assert got[1].detail["activations_head"] - want[1].detail["activations_head"] == int(extra)


def test_bad_mtp_settings_are_problems_with_a_fix():
    """Before launch: a malformed weight schedule and another family, each named with its Fix; tensor
    parallelism and zbv's V (the first and the last stage on one rank, which adds the embedding
    copy's gradient in place) are no problem."""
    from launcher.config.loader import compose_spec
    from launcher.config.validate import validate

    spec = compose_spec(["model=debug", "model.mtp_layers=1", "model.mtp_loss_weights=[[0,0.3],[5,inf],3]",
                         "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"])
    problems = [p for p in validate(spec) if "mtp" in p]
    assert len(problems) == 3 and all("Fix:" in p for p in problems), problems
    assert any("[5, inf]" in p for p in problems) and any("family=llama" in p for p in problems)
    assert not any("parallel.tp=2" in p or "zbv" in p for p in problems)
