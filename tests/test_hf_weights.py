"""Hugging Face weights in (model.init_from) and out (checkpoint.export=hf, action=export).

Tiny random Llama (GQA; untied, tied), Mixtral, Qwen3 and Qwen3-MoE models are built locally with transformers'
own config classes and saved with save_pretrained (nothing is downloaded). Our logits must equal
transformers' within 1e-5 (fp32) on 1 rank and in dp_shard=2, tp=2, pp=2 and ep=2 layouts (one
torchrun launch), and for the MoE families with tp=2 and ep=2 together (pp=2 and ep=2 for
DeepSeek-V3; one 4-rank launch) before and after training (through checkpoint.export=hf); exports
must round-trip byte for byte, and bad folders exit 2 before launch.
The real sizes (Llama 3, Mixtral, Qwen3 dense and MoE) are mapped on the meta device.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from launcher.config.hf_model import hf_model_fields
from launcher.hf.format import folder_problems, hf_shapes, read_hf_config, tensor_maps
from launcher.config.schema import ModelConfig, RopeScalingConfig
from tests.conftest import REPO, TRAIN, run_train, train_env
from tests.deepspeed_harness.common import deepspeed_env

import transformers  # noqa: E402,F401  the `test` extra (CI installs it): a missing one must fail, not skip

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
WORDS = "the a model weights train tokens data layer head expert load save export fine tune run step".split()


def _model_cfg(name: str) -> ModelConfig:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(cfg)


def _save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{name: folder}: llama (fp32, 3 safetensors shards + index, with a tokenizer.json),
    llama_tied_bf16 (tied embeddings, bf16 on disk), mixtral (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    llama = LlamaForCausalLM(LlamaConfig(**TINY, rope_theta=500000.0, tie_word_embeddings=False))
    out["llama"] = root / "llama"
    llama.save_pretrained(out["llama"], max_shard_size="40KB")
    _save_tokenizer(out["llama"])
    tied = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).to(torch.bfloat16)
    out["llama_tied_bf16"] = root / "llama_tied_bf16"
    tied.save_pretrained(out["llama_tied_bf16"])
    mixtral = MixtralForCausalLM(MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2))
    out["mixtral"] = root / "mixtral"
    mixtral.save_pretrained(out["mixtral"])
    # Llama 3.1-style RoPE scaling, with a pre-training context (8) shorter than the test's 16
    # tokens, so every frequency is scaled (the highest one smoothed, the others divided by 8).
    scaled = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False))
    out["llama31_rope"] = root / "llama31_rope"
    scaled.save_pretrained(out["llama31_rope"])
    # Qwen3: head_dim 16 != hidden / heads (8), q/k RMSNorm. Qwen3-MoE: block 0 dense
    # (mlp_only_layers), the others 4 experts top-2, renormalised (norm_topk_prob).
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    qwen = dict(TINY, head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6)
    _randomize_norms(Qwen3ForCausalLM(Qwen3Config(**qwen, tie_word_embeddings=False))).save_pretrained(out.setdefault("qwen3", root / "qwen3"))
    moe = Qwen3MoeConfig(**dict(qwen, num_hidden_layers=3), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False)
    _randomize_norms(Qwen3MoeForCausalLM(moe)).save_pretrained(out.setdefault("qwen3_moe", root / "qwen3_moe"))
    # DeepSeek-V3: MLA (q_lora_rank 16, or 0 as V2-Lite), YaRN with a pre-training context (8)
    # shorter than the test's 16 tokens and mscale != mscale_all_dim (both magnitudes matter), a
    # dense first block, then 8 experts in 4 groups (top-2 groups, top-2 experts), a shared
    # expert, random correction biases (routing depends on them).
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    for name, q_rank in (("deepseek_v3", 16), ("deepseek_v3_q0", None)):
        config = DeepseekV3Config(**DEEPSEEK_V3, q_lora_rank=q_rank)
        _randomize_norms(DeepseekV3ForCausalLM(config)).save_pretrained(out.setdefault(name, root / name))
    # DeepSeek-V3 as released in FP8: dims above 128 and projections that are not multiples of it
    # (hidden 200, q_lora 136, kv_a 138 x 200, experts 136 x 200), quantized by this test in
    # 128 x 128 blocks: amax / 448 with float32 scales, and power-of-two scales stored as e8m0
    # (ue8m0). Each beside the float32 folder of its dequantized weights (transformers' reference).
    config = DeepseekV3Config(**DEEPSEEK_V3_FP8)
    _randomize_norms(DeepseekV3ForCausalLM(config)).save_pretrained(root / "deepseek_v3_fp8_source")
    for name, ue8m0 in (("deepseek_v3_fp8", False), ("deepseek_v3_fp8_ue8m0", True)):
        out[name], out[name + "_ref"] = _fp8_release(root / "deepseek_v3_fp8_source", root / name, ue8m0)
    # Qwen3 as its -FP8 releases: head_dim 48, so query head 2 (rows 96-144) straddles two 128-row blocks.
    Qwen3ForCausalLM(Qwen3Config(**dict(qwen, head_dim=48), tie_word_embeddings=False)).save_pretrained(root / "qwen3_48")
    out["qwen3_fp8"], out["qwen3_fp8_ref"] = _fp8_release(root / "qwen3_48", root / "qwen3_fp8", False)
    return out


def _fp8_blocks(w: torch.Tensor, ue8m0: bool):
    """(e4m3 weight, scale_inv, dequantized float32) of a 2-D weight in 128 x 128 blocks, edge blocks
    partial: scale = amax / 448 per block (rounded up to a power of two for ue8m0)."""
    n, k = w.shape
    nb0, nb1 = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(nb0 * FP8_BLOCK, nb1 * FP8_BLOCK)
    padded[:n, :k] = w.float()
    amax = padded.view(nb0, FP8_BLOCK, nb1, FP8_BLOCK).abs().amax(dim=(1, 3))
    scale = amax / 448.0
    if ue8m0:
        scale = 2.0 ** torch.ceil(torch.log2(scale))
    full_scale = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    q = (w.float() / full_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu if ue8m0 else torch.float32), q.float() * full_scale


def _fp8_release(src: Path, dst: Path, ue8m0: bool):
    """Quantize `src` (a save_pretrained folder) as DeepSeek-V3 is released: every 2-D weight of the
    blocks but the router. Returns (the FP8 folder, the folder of its dequantized weights)."""
    from safetensors.torch import save_file

    ref_dir = dst.with_name(dst.name + "_ref")
    quantized, ref = {}, {}
    for name, t in _hf_tensors(src).items():
        if t.dim() == 2 and name.startswith("model.layers.") and not name.endswith("mlp.gate.weight"):
            q, scale, value = _fp8_blocks(t, ue8m0)
            quantized[name], quantized[name + "_scale_inv"], ref[name] = q, scale, value
        else:
            quantized[name] = ref[name] = t
    config = json.loads((src / "config.json").read_text())
    for folder, tensors, extra in ((dst, quantized, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            **({"scale_fmt": "ue8m0"} if ue8m0 else {})}}), (ref_dir, ref, {})):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
    return dst, ref_dir


DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
DEEPSEEK_V3 = dict(TINY, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=16, n_shared_experts=1,
                   n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                   kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-6,
                   rope_parameters=DEEPSEEK_V3_YARN, tie_word_embeddings=False, routed_scaling_factor=2.5,
                   initializer_range=0.1)  # weights large enough that RoPE and routing move the logits
DEEPSEEK_V3_FP8 = dict(DEEPSEEK_V3, num_hidden_layers=2, hidden_size=200, intermediate_size=264, num_attention_heads=2,
                       num_key_value_heads=2, q_lora_rank=136, kv_lora_rank=130, qk_nope_head_dim=16, qk_rope_head_dim=8,
                       v_head_dim=16, moe_intermediate_size=136, n_routed_experts=4, n_group=2, topk_group=1,
                       initializer_range=0.05)
FP8_BLOCK = 128


def _randomize_norms(model):
    """RMSNorm weights start at 1: random ones make a swapped or missing norm (q_norm vs k_norm) show.
    DeepSeek-V3's correction biases start at 0: random ones make the expert choice depend on them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    return model


def _hf_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(f))
    return out


def _assert_byte_identical(src: Path, dst: Path) -> None:
    a, b = _hf_tensors(src), _hf_tensors(dst)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _hf_logits(folder, toks):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(toks).logits


# ----------------------------------------------------------------------------- real sizes, meta device


def _hf_on_disk_shapes(model) -> dict:
    """(name -> shape) as save_pretrained writes them: transformers 5 fuses Mixtral experts in memory
    (mlp.experts.gate_up_proj [E, 2F, D] = gate|up, down_proj [E, D, F]) and stores them per expert:
    Mixtral under block_sparse_moe as w1/w3/w2, Qwen3-MoE under mlp as gate_proj/up_proj/down_proj
    (transformers' conversion_mapping)."""
    mixtral = model.config.model_type == "mixtral"
    moe, gate, up, down = (("block_sparse_moe", "w1", "w3", "w2") if mixtral else ("mlp", "gate_proj", "up_proj", "down_proj"))
    out = {}
    for name, p in model.state_dict().items():
        shape = tuple(p.shape)
        if ".mlp.experts." in name or ".mlp.gate." in name:
            base = name.split(".mlp.")[0] + f".{moe}."
            if name.endswith("gate.weight") or name.endswith("gate.e_score_correction_bias"):
                out[base + name.split(".mlp.")[1]] = shape
            elif name.endswith("gate_up_proj"):
                for e in range(shape[0]):
                    out[f"{base}experts.{e}.{gate}.weight"] = (shape[1] // 2, shape[2])
                    out[f"{base}experts.{e}.{up}.weight"] = (shape[1] // 2, shape[2])
            elif name.endswith("down_proj"):
                for e in range(shape[0]):
                    out[f"{base}experts.{e}.{down}.weight"] = shape[1:]
            else:
                raise AssertionError(f"unexpected transformers expert tensor {name}")
        else:
            out[name] = shape
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # tied: save_pretrained drops it
    return out


@pytest.mark.parametrize("name", ["llama3_8b", "llama3_70b", "llama3_405b", "mixtral_8x7b", "mixtral_8x22b", "qwen3_0_6b",
                                  "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3",
                                  "deepseek_v3_small"])
def test_real_model_configs_map_name_for_name_on_meta(name):
    """Our conf/model/NAME.yaml and transformers' config of the same size map one to one: every
    transformers tensor has exactly one source in our model with the right shape, and back (so
    the parameter counts are transformers' too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from launcher.hf.format import hf_config_for
    from launcher.models import build_model

    cfg = _model_cfg(name)
    hf_cfg = hf_config_for(cfg, "bfloat16")
    config = AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    assert type(config).__name__.lower().startswith(cfg.family.replace("_", "")), (cfg.family, type(config))
    assert {k: getattr(cfg, k) for k in hf_model_fields(config.to_dict())} | {"max_seq_len": cfg.max_seq_len} == \
        hf_model_fields(config.to_dict()) | {"max_seq_len": cfg.max_seq_len}
    with torch.device("meta"):
        ours = build_model(cfg)
        theirs = AutoModelForCausalLM.from_config(config)
    maps = tensor_maps(cfg)
    state = set(ours.state_dict())  # persistent buffers too (DeepSeek-V3's e_score_correction_bias)
    assert {m.ours: m.shape for m in maps} == {n: tuple(p.shape) for n, p in ours.named_parameters()} | \
        {n: tuple(b.shape) for n, b in ours.named_buffers() if n in state}
    mapped = {}
    for m in maps:
        for hf_name, shape in hf_shapes(m):
            assert hf_name not in mapped, f"{hf_name} mapped twice"
            mapped[hf_name] = tuple(shape)
    # transformers builds no multi-token prediction (DeepSeek-V3's layer 61: tests/test_mtp.py).
    mtp = {n for n in mapped if any(n.startswith(f"model.layers.{cfg.n_layers + k}.") for k in range(cfg.mtp_layers))}
    assert bool(mtp) == bool(cfg.mtp_layers)
    assert {n: shape for n, shape in mapped.items() if n not in mtp} == _hf_on_disk_shapes(theirs)


# ----------------------------------------------------------------------------- one rank, in process


@pytest.mark.parametrize("which", ["llama", "llama_tied_bf16", "mixtral", "llama31_rope", "qwen3", "qwen3_moe",
                                   "deepseek_v3", "deepseek_v3_q0"])
def test_one_rank_logits_and_exact_round_trip(hf_models, which, tmp_path):
    from launcher.models import build_model
    from launcher.models.layers import model_rope_table
    from launcher.hf.weights import export_hf, load_hf_weights

    folder = hf_models[which]
    cfg = ModelConfig(name="hf", init_from=str(folder), **hf_model_fields(read_hf_config(folder)))
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    load_hf_weights([model], str(folder), cfg)
    toks = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(toks)
    theirs = _hf_logits(folder, toks)
    assert (ours - theirs).abs().max() <= 1e-5
    if which == "llama31_rope":  # the scaling matters here: plain RoPE would be far off
        assert cfg.rope_scaling.type == "llama3"
        plain = model_rope_table(ModelConfig(**{**cfg.__dict__, "rope_scaling": RopeScalingConfig()}))
        scaled, model.rope = model.rope, plain
        with torch.no_grad():
            assert (model(toks) - theirs).abs().max() > 1e-4
        model.rope = scaled
    if which.startswith("deepseek_v3"):
        _check_deepseek_v3_details(model, cfg, toks, theirs, which)
    dtype = "bf16" if which.endswith("bf16") else "fp32"
    export_hf([model], None, tmp_path / "hf", cfg, dtype)
    _assert_byte_identical(folder, tmp_path / "hf")
    if dtype == "fp32":  # transformers reads our config.json (RoPE included) as it read the source's
        assert (ours - _hf_logits(tmp_path / "hf", toks)).abs().max() <= 1e-5
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert "lm_head.weight" not in index["weight_map"] if cfg.tie_embeddings else "lm_head.weight" in index["weight_map"]


def _check_deepseek_v3_details(model, cfg, toks, theirs, which):
    """What the DeepSeek-V3 parity covers: the correction bias is loaded (a buffer, and it changes
    the routing), YaRN and its mscale^2 softmax scale are in effect, MLA as configured."""
    from launcher.models.layers import model_rope_table

    assert cfg.family == "deepseek_v3" and cfg.rope_scaling.type == "yarn" and cfg.n_group == 4 and cfg.topk_group == 2
    assert cfg.q_lora_rank == (16 if which == "deepseek_v3" else 0) and cfg.n_dense_layers == 1
    moe = model.layers["1"].moe
    assert "e_score_correction_bias" not in dict(moe.named_parameters())
    assert "layers.1.moe.e_score_correction_bias" in model.state_dict()  # checkpointed with the model
    assert moe.e_score_correction_bias.abs().max() > 0.05
    with torch.no_grad():
        biases = [m.e_score_correction_bias.clone() for m in model.moe_layers()]
        for m in model.moe_layers():
            m.e_score_correction_bias.zero_()
        assert (model(toks) - theirs).abs().max() > 1e-4  # the bias decides some experts
        for m, b in zip(model.moe_layers(), biases):
            m.e_score_correction_bias.copy_(b)
        plain = model_rope_table(ModelConfig(**{**cfg.__dict__, "rope_scaling": RopeScalingConfig()}))
        scaled, model.rope = model.rope, plain
        assert (model(toks) - theirs).abs().max() > 1e-4
        model.rope = scaled
        block = model.layers["0"].attention
        assert block.softmax_scale != block.qk_head ** -0.5  # mscale_all_dim=1 at factor 4
        assert (model(toks) - theirs).abs().max() <= 1e-5


def test_deepseek_v3_bf16_export_is_transformers_own_bf16_save(hf_models, tmp_path):
    """transformers keeps DeepSeek-V3's router weight and correction bias in float32 in a bf16
    model (_keep_in_fp32_modules_strict); a bf16 export does too: byte for byte its save_pretrained."""
    from transformers import AutoModelForCausalLM

    from launcher.hf.weights import export_hf, load_hf_weights
    from launcher.models import build_model

    folder = hf_models["deepseek_v3"]
    AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).save_pretrained(tmp_path / "theirs")
    cfg = ModelConfig(name="hf", init_from=str(folder), **hf_model_fields(read_hf_config(folder)))
    model = build_model(cfg)
    load_hf_weights([model], str(folder), cfg)
    export_hf([model], None, tmp_path / "ours", cfg, "bf16")
    _assert_byte_identical(tmp_path / "theirs", tmp_path / "ours")
    assert _hf_tensors(tmp_path / "ours")["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


# ----------------------------------------------------------------------------- FP8 block-quantized folders


def _dequantized(tensors: dict, name: str) -> torch.Tensor:
    """The float32 value of weight `name` of an FP8 folder's tensors (the test's own arithmetic)."""
    w, scale = tensors[name], tensors[name + "_scale_inv"].float()
    full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:w.shape[0], :w.shape[1]]
    return w.float() * full


@pytest.mark.parametrize("which", ["deepseek_v3_fp8", "deepseek_v3_fp8_ue8m0"])
def test_fp8_block_release_loads_dequantized_and_exports_fp8_block(hf_models, which, tmp_path, caplog):
    """A DeepSeek-V3 folder as released in FP8 (128 x 128 e4m3 blocks, partial edge blocks, float32
    or e8m0 scales): our logits equal transformers' on the dequantized weights (fp32, 1e-5), the
    scales are not reported as skipped tensors, and checkpoint.export_dtype=fp8_block writes the
    same layout back: the same tensors quantized, whose dequantized values equal the source's."""
    from dataclasses import replace

    from launcher.hf.format import fp8_export_plan
    from launcher.hf.weights import export_hf, load_hf_weights
    from launcher.models import build_model

    folder = hf_models[which]
    cfg = ModelConfig(name="hf", init_from=str(folder), **hf_model_fields(read_hf_config(folder)))
    assert folder_problems(cfg, str(folder)) == []
    model = build_model(cfg)
    with caplog.at_level("INFO", logger="launcher.hf.weights"):
        load_hf_weights([model], str(folder), cfg)
    assert "_scale_inv" not in caplog.text and "skipping" not in caplog.text
    toks = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(toks) - _hf_logits(hf_models[which + "_ref"], toks)).abs().max() <= 1e-5
    export_hf([model], None, tmp_path / "hf", cfg, "fp8_block")
    source, exported = _hf_tensors(folder), _hf_tensors(tmp_path / "hf")
    assert sorted(exported) == sorted(source)
    scaled = [n[:-len("_scale_inv")] for n in source if n.endswith("_scale_inv")]
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in scaled and "lm_head.weight" not in scaled
    for name in scaled:
        assert exported[name].dtype == torch.float8_e4m3fn and exported[name + "_scale_inv"].dtype == torch.float32
        # Exact: amax / 448 of a dequantized block gives back its scale (to the float32 ulp that the
        # block's own e4m3 rounding absorbs); power-of-two scales divide exactly.
        assert torch.equal(_dequantized(exported, name), _dequantized(source, name)), name
    assert exported["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router is not quantized
    assert exported["model.embed_tokens.weight"].dtype == torch.bfloat16
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["quantization_config"] == read_hf_config(folder)["quantization_config"] | {"activation_scheme": "dynamic"}
    # A from-scratch model quantizes what DeepSeek released quantized: every block linear but the router.
    quant, names = fp8_export_plan(replace(cfg, init_from=""))
    assert sorted(names) == sorted(scaled) and quant.block == (128, 128) and quant.scale_fmt == ""
    # An fp32 export of the FP8 source carries no quantization_config (transformers would misread it).
    export_hf([model], None, tmp_path / "fp32", cfg, "fp32")
    assert "quantization_config" not in json.loads((tmp_path / "fp32" / "config.json").read_text())
    if which == "deepseek_v3_fp8":  # the before-launch check: FP8 weights without their scales or block size
        from safetensors.torch import save_file

        broken = _copy(folder, tmp_path / "broken")
        del source["model.layers.0.mlp.down_proj.weight_scale_inv"]
        source["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
        save_file(source, str(broken / "model.safetensors"), metadata={"format": "pt"})
        (problem,) = [p for p in folder_problems(cfg, str(broken)) if "without their block scales" in p]
        assert "model.layers.0.mlp.down_proj.weight" in problem and "Fix:" in problem
        (problem,) = [p for p in folder_problems(cfg, str(broken)) if "wrong shape" in p]
        assert "o_proj.weight_scale_inv (1, 1) (expected (2, 1)" in problem


def test_fp8_qwen3_release_loads_through_the_rope_permutation(hf_models):
    """Qwen3's -FP8 layout (q/k rows in HF's half-rotation order, a query head across two row
    blocks): q/k are dequantized in HF's row order, then permuted to ours; logits equal
    transformers' on the dequantized weights."""
    from launcher.hf.weights import load_hf_weights
    from launcher.models import build_model

    folder = hf_models["qwen3_fp8"]
    cfg = ModelConfig(name="hf", init_from=str(folder), **hf_model_fields(read_hf_config(folder)))
    assert folder_problems(cfg, str(folder)) == []
    model = build_model(cfg)
    load_hf_weights([model], str(folder), cfg)
    toks = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(toks) - _hf_logits(hf_models["qwen3_fp8_ref"], toks)).abs().max() <= 1e-5


def test_fp8_box_reads_only_its_scale_blocks_and_bf16_scales(tmp_path):
    """A shard's box that cuts 128-blocks (rows 100-290, columns 5-257 of a 300 x 260 weight) is
    dequantized from the 3 x 3 scale blocks that cover it and nothing more; bf16 scales read too."""
    from safetensors.torch import save_file

    from launcher.hf.weights import HfReader

    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(0))
    q, scale, _ = _fp8_blocks(w, ue8m0=False)
    scale = scale.to(torch.bfloat16)
    save_file({"w": q, "w_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    reader = HfReader(str(tmp_path))
    box = reader.read("w", [(100, 290), (5, 257)])
    assert torch.equal(box, _dequantized({"w": q, "w_scale_inv": scale}, "w")[100:290, 5:257])
    assert reader.elements_read == 190 * 252 + 3 * 3


# ----------------------------------------------------------------------------- bad folders


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_folders_exit_2_before_launch(hf_models, tmp_path):
    missing = _copy(hf_models["llama"], tmp_path / "missing_shard")
    shards = sorted(missing.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    truncated = _copy(hf_models["mixtral"], tmp_path / "truncated")
    f = truncated / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    gptq = _copy(hf_models["mixtral"], tmp_path / "gptq")  # another quant_method: named, with its fix
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    run_dir = tmp_path / "run"
    proc = run_train(["-m", "model=hf", f"model.init_from={missing},{truncated},{gptq}", "cluster.gpus_per_node=1"], run_dir)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert f"shard {shards[1].name}" in err and "is missing" in err, err
    assert "model.safetensors is truncated" in err, err
    assert "quant_method='gptq'" in err and "Fix: dequantize the checkpoint" in err, err
    assert "Traceback" not in err
    proc = run_train(["model=debug", f"model.init_from={hf_models['llama']}"], run_dir)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.dim=64 vs 32" in proc.stderr and "Fix: model=hf" in proc.stderr, proc.stderr
    assert not run_dir.exists()  # nothing written, nothing launched


def test_a_file_truncated_after_the_check_is_a_clear_rank_error(hf_models, tmp_path):
    from launcher.models import build_model
    from launcher.hf.weights import load_hf_weights

    folder = _copy(hf_models["mixtral"], tmp_path / "late")
    cfg = ModelConfig(name="hf", init_from=str(folder), **hf_model_fields(read_hf_config(folder)))
    assert folder_problems(cfg, str(folder)) == []
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated.*Fix: copy"):
        load_hf_weights([model], str(folder), cfg)


def test_a_parameter_without_a_hugging_face_name_names_the_families_that_load(hf_models, tmp_path):
    """A model parameter the family's tensor map does not name: the rank's error names the family
    and today's families (not the Llama-and-Mixtral-only wording of before), with a Fix."""
    from launcher.hf.weights import load_hf_weights
    from launcher.models import build_model
    from launcher.models.family import FAMILY_PACKAGES

    folder = hf_models["qwen3"]
    cfg = ModelConfig(name="hf", init_from=str(folder), **hf_model_fields(read_hf_config(folder)))
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.register_parameter("unmapped_scale", torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(ValueError) as err:
        load_hf_weights([model], str(folder), cfg)
    message = str(err.value)
    assert "unmapped_scale" in message and "model.family=qwen3" in message and "Fix: " in message
    assert all(family in message for family in FAMILY_PACKAGES) and "Llama and Mixtral" not in message


# ----------------------------------------------------------------------------- 2 ranks, one launch


def _run_harness(jobs: list, tmp_path: Path, ranks: int) -> dict:
    """Run tests/hf_harness.py over `jobs` in one torchrun launch of `ranks` ranks: {job name: result}.
    Each job exports into tmp_path/NAME/hf."""
    for job in jobs:
        job["export_dir"] = str(tmp_path / job["name"])
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = deepspeed_env({"TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           str(REPO / "tests" / "hf_harness.py"), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and (tmp_path / "out.json").exists(), proc.stderr[-5000:]
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.multiprocess
def test_two_rank_layouts_load_train_and_export(hf_models, tmp_path):
    """tp=2 (sharded source, then 2 steps and an fp32 export that transformers loads), dp_shard=2
    (tied, bf16 on disk), pp=2, ep=2 (Mixtral, Qwen3-MoE) and tp=2 (Qwen3): logits equal transformers' after loading, and
    the exports of the untrained models are byte-identical to their sources. DeepSpeed ZeRO-1 and ZeRO-3
    (DeepSeek-V3 too: its router correction biases are buffers, which ZeRO-3's own loader must read)."""
    jobs = [
        {"name": "tp2_train", "folder": str(hf_models["llama"]), "mesh": {"tp": 2}, "train_steps": 2,
         "export_dtype": "fp32"},
        {"name": "dp_shard2_tied_bf16", "folder": str(hf_models["llama_tied_bf16"]), "mesh": {"dp_shard": 2},
         "export_dtype": "bf16"},
        {"name": "pp2", "folder": str(hf_models["llama"]), "mesh": {"pp": 2}, "export_dtype": "fp32"},
        {"name": "ep2_mixtral", "folder": str(hf_models["mixtral"]), "mesh": {"dp_shard": 2, "ep": 2},
         "export_dtype": "fp32"},
        # Llama 3.1-style RoPE scaling through the engine's own build (meta model, init, load).
        {"name": "tp2_llama31_rope", "folder": str(hf_models["llama31_rope"]), "mesh": {"tp": 2},
         "export_dtype": "fp32"},
        # Qwen3: q/k norms under TP (per-head weights replicated), head_dim decoupled from dim.
        {"name": "tp2_qwen3", "folder": str(hf_models["qwen3"]), "mesh": {"tp": 2}, "export_dtype": "fp32"},
        # Qwen3-MoE: a dense block then expert blocks, experts split over ep=2.
        {"name": "ep2_qwen3_moe", "folder": str(hf_models["qwen3_moe"]), "mesh": {"dp_shard": 2, "ep": 2},
         "export_dtype": "fp32"},
        # DeepSeek-V3: MLA heads over tp=2 (down-projections, their norms and the shared RoPE key
        # replicated), then 8 grouped experts over ep=2 (correction biases loaded into every replica).
        {"name": "tp2_deepseek_v3", "folder": str(hf_models["deepseek_v3"]), "mesh": {"tp": 2}, "export_dtype": "fp32"},
        {"name": "ep2_deepseek_v3", "folder": str(hf_models["deepseek_v3"]), "mesh": {"dp_shard": 2, "ep": 2},
         "export_dtype": "fp32"},
        # DeepSpeed ZeRO-3 (parameters partitioned as built; rank 0 reads one full tensor at a time).
        {"name": "deepspeed_zero3", "folder": str(hf_models["llama"]), "mesh": {"dp_shard": 2},
         "backend": "deepspeed", "zero_stage": 3, "export_dtype": "fp32"},
        # DeepSpeed ZeRO-1 (whole model built on each rank, then handed to DeepSpeed); tied, bf16 on disk.
        {"name": "deepspeed_zero1_tied", "folder": str(hf_models["llama_tied_bf16"]), "mesh": {"dp_shard": 2},
         "backend": "deepspeed", "zero_stage": 1, "export_dtype": "fp32"},
        # DeepSpeed ZeRO-3 with DeepSeek-V3: the router correction biases are buffers, not partitioned
        # parameters, and routing depends on them; one step (moving them) and a safetensors export.
        {"name": "deepspeed_zero3_deepseek_v3", "folder": str(hf_models["deepseek_v3"]), "mesh": {"dp_shard": 2},
         "backend": "deepspeed", "zero_stage": 3, "export_dtype": "fp32", "train_steps": 1,
         "model": {"bias_update_speed": 0.01}},
        # ...and in bf16, where the biases must keep the folder's float32 values.
        {"name": "deepspeed_zero3_deepseek_v3_bf16", "folder": str(hf_models["deepseek_v3"]), "mesh": {"dp_shard": 2},
         "backend": "deepspeed", "zero_stage": 3, "export_dtype": "fp32", "precision": "bf16"},
    ]
    out = _run_harness(jobs, tmp_path, ranks=2)
    for job in jobs:
        r = out[job["name"]]
        assert "error" not in r, f"{job['name']}: {r.get('error')}"
        if job.get("precision", "fp32") == "fp32":
            assert r["load_max_diff"] <= 1e-5, (job["name"], r)
        if job.get("backend") == "deepspeed":  # what DeepSpeed reports it built: ZeRO-3 over 2 ranks
            built = r["built"]
            assert built["backends"]["sharding"] == "deepspeed" and built["backends"]["zero_stage"] == job["zero_stage"], r
            assert built["mesh"]["dp"] == 2, r
            # Every rank holds the folder's correction biases (DeepSeek-V3), float32, bit for bit.
            assert r["bias_names_match"] and r["bias_exact_fp32"] and r["bias_loaded_on_every_rank"], (job["name"], r)
            continue
        mesh = r["built"]["mesh"]
        assert all(mesh[k] == v for k, v in job["mesh"].items()), (job["name"], mesh)
        # Each rank fetched its shards only: about half the model (norms and, under EP, the
        # non-expert weights are replicated), never all of it.
        # (MLA's replicated down-projections and, under TP, the replicated experts: a bit more.)
        share = 0.85 if job["name"] == "tp2_deepseek_v3" else 0.75
        assert all(0 < n < share * r["model_elements"] for n in r["elements_read"]), (job["name"], r)
    r = out["deepspeed_zero3_deepseek_v3"]
    assert abs(r["losses"][0] - r["first_loss_hf"]) <= 1e-5, r  # the first step trains transformers' model
    # The step moved the biases; the export (the names the native engine's writes) holds the moved ones.
    assert r["bias_moved"] > 1e-3 and r["export_has_biases"] and r["export_bias_max_diff"] == 0.0, r
    assert r["export_names_are_the_state_dicts"], r
    r = out["tp2_train"]
    assert r["weights_moved"] > 1e-3  # training changed the model, so the export check below means something
    assert r["export_max_diff"] <= 1e-5
    for name in ("dp_shard2_tied_bf16", "pp2", "ep2_mixtral", "tp2_llama31_rope", "tp2_qwen3", "ep2_qwen3_moe",
                 "tp2_deepseek_v3", "ep2_deepseek_v3"):
        job = next(j for j in jobs if j["name"] == name)
        _assert_byte_identical(Path(job["folder"]), Path(job["export_dir"]) / "hf")


# ----------------------------------------------------------------------------- 4 ranks, one launch


@pytest.mark.multiprocess
def test_four_rank_layouts_load_train_and_export(hf_models, tmp_path):
    """The MoE families with TP and EP together (tp=2 x dp_shard=2, ep=2: experts over the dp_shard
    ranks, each TP pair holding the same experts; DeepSeek-V3 also from its FP8 form) and DeepSeek-V3
    with PP and EP (pp=2 x dp_shard=2, ep=2): logits equal transformers' after loading (the FP8 form's:
    transformers' on its dequantized weights), then (the unquantized sources) 2 training steps and an fp32
    checkpoint.export=hf that transformers loads to our final-step logits."""
    jobs = [
        {"name": "tp2_ep2_qwen3_moe", "folder": str(hf_models["qwen3_moe"]), "mesh": {"tp": 2, "dp_shard": 2, "ep": 2}},
        {"name": "tp2_ep2_deepseek_v3", "folder": str(hf_models["deepseek_v3"]), "mesh": {"tp": 2, "dp_shard": 2, "ep": 2}},
        {"name": "pp2_ep2_deepseek_v3", "folder": str(hf_models["deepseek_v3"]), "mesh": {"pp": 2, "dp_shard": 2, "ep": 2}},
        # DeepSeek-V3 released in FP8 (e8m0 scales): TP shards cut the 128-blocks (q_b_proj's 48 rows,
        # the dense ffn's 264 in halves of 132), EP splits the experts; compared with transformers on
        # the dequantized weights.
        # Loading is what this case checks (training after the load is the other cases' path): no steps.
        {"name": "tp2_ep2_deepseek_v3_fp8", "folder": str(hf_models["deepseek_v3_fp8_ue8m0"]),
         "reference": str(hf_models["deepseek_v3_fp8_ue8m0_ref"]), "mesh": {"tp": 2, "dp_shard": 2, "ep": 2},
         "train_steps": 0},
    ]
    for job in jobs:
        job.setdefault("train_steps", 2)
        job["export_dtype"] = "fp32"
    out = _run_harness(jobs, tmp_path, ranks=4)
    for job in jobs:
        r = out[job["name"]]
        assert "error" not in r, f"{job['name']}: {r.get('error')}"
        mesh = r["built"]["mesh"]
        assert all(mesh[k] == v for k, v in job["mesh"].items()), (job["name"], mesh)
        assert r["load_max_diff"] <= 1e-5, (job["name"], r)
        # Each rank fetched its slices only: TP or PP halves the dense weights and EP the experts
        # (replicated norms, routers and, under TP, MLA's down-projections on top): under half the model.
        assert all(0 < n < 0.5 * r["model_elements"] for n in r["elements_read"]), (job["name"], r)
        if job["train_steps"]:
            assert r["weights_moved"] > 1e-3, (job["name"], r)  # training changed the model: the export check means something
            assert r["export_max_diff"] <= 1e-5, (job["name"], r)
    # The same model and batches in two layouts train alike (PP's hand-off and TP's reductions agree).
    tp, pp = out["tp2_ep2_deepseek_v3"]["losses"], out["pp2_ep2_deepseek_v3"]["losses"]
    assert len(tp) == 2 and max(abs(a - b) for a, b in zip(tp, pp)) <= 1e-5, (tp, pp)


# ----------------------------------------------------------------------------- the `train` command


@pytest.mark.multiprocess
def test_train_fine_tunes_from_a_folder_and_exports_for_transformers(hf_models, tmp_path):
    """`train model=hf model.init_from=DIR data=text` (the folder's tokenizer by default), the end of
    run export, then `train action=export` of the final checkpoint: the same weights in both."""
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(3000)))
    run = tmp_path / "run"
    args = ["model=hf", f"model.init_from={hf_models['llama']}", "data=text", f"data.path={text}",
            "trainer.steps=2", "trainer.seq_len=16", "trainer.global_batch_size=2", "precision=fp32",
            "checkpoint.export=hf", "cluster.gpus_per_node=1", "logging.progress=false", "plan.plots=false",
            "logging.wandb.mode=disabled"]
    run_train(args, run, check=True, timeout=600)
    config = OmegaConf.load(run / "config.yaml")
    assert config.data.tokenizer == str(hf_models["llama"] / "tokenizer.json")
    assert config.model.dim == 32 and config.model.n_kv_heads == 2
    export = run / "export" / "hf"
    assert (export / "tokenizer.json").is_file() and (export / "config.json").is_file()
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _hf_tensors(export).values())
    again = tmp_path / "again"
    # The training-only settings a training command carries are ignored (trainer.seq_len=2048, the
    # default, exceeds this model's max_seq_len=32; a batch no layout would split), and the export
    # goes beside the checkpoint, which the console names.
    step = run / "checkpoints" / "step_00000002"
    done = run_train(["model=hf", f"model.init_from={hf_models['llama']}", "action=export", "checkpoint.export=hf",
                      "checkpoint.export_dtype=fp32", f"checkpoint.resume={step}", "precision=fp32",
                      "trainer.global_batch_size=7", "trainer.tokens=1000", "cluster.gpus_per_node=1",
                      "plan.plots=false", "logging.wandb.mode=disabled"], again, check=True, timeout=600)
    beside = run / "checkpoints" / "step_00000002_export"
    assert f"to {beside}" in done.stdout, done.stdout[-2000:]
    assert not (again / "export").exists()
    fp32 = _hf_tensors(beside / "hf")
    bf16 = _hf_tensors(export)
    assert sorted(fp32) == sorted(bf16)
    assert all(torch.equal(fp32[k].to(torch.bfloat16), bf16[k]) for k in bf16)
    source = _hf_tensors(hf_models["llama"])
    assert any(not torch.equal(fp32[k], source[k]) for k in source)  # it trained
    toks = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(5))
    assert _hf_logits(beside / "hf", toks).isfinite().all()


def test_deepspeed_backend_refuses_hf_export_before_launch(hf_models):
    """checkpoint.export=hf is not supported yet with DeepSpeed owning the model states (model.init_from
    is: see the deepspeed_zero3 layout above): exit 2's problem line, with a Fix."""
    from types import SimpleNamespace

    from launcher.config.errors import ConfigError
    from launcher.config.loader import compose_spec
    from launcher.launch.preflight import check_hf_support
    from launcher.plan.decide.resolve import resolve

    spec = compose_spec(["model=hf", f"model.init_from={hf_models['llama']}", "backend=deepspeed",
                         "checkpoint.export=hf", "cluster.gpus_per_node=1"])
    layout = resolve(spec)
    assert layout.owners.sharding_backend == "deepspeed"
    with pytest.raises(ConfigError) as err:
        check_hf_support(spec, SimpleNamespace(layout=layout))
    assert len(err.value.problems) == 1 and "checkpoint.export=hf" in err.value.problems[0]
    assert "Fix: backend=native" in err.value.problems[0]
    for served in (["backend=native", "checkpoint.export=hf"], ["backend=deepspeed"]):
        spec = compose_spec(["model=hf", f"model.init_from={hf_models['llama']}", "cluster.gpus_per_node=1", *served])
        check_hf_support(spec, SimpleNamespace(layout=resolve(spec)))  # served: no problem


def test_action_export_needs_a_checkpoint_and_a_format(tmp_path):
    from launcher.config.loader import compose_spec
    from launcher.config.validate import validate

    problems = validate(compose_spec(["+recipe=debug", "action=export", "checkpoint.export=none",
                                      f"checkpoint.resume={tmp_path / 'no'}"]))
    assert any(p.startswith("action=export writes checkpoint.export but checkpoint.export=none") for p in problems)
    assert any("not a checkpoint folder" in p and "Fix: checkpoint.resume=" in p for p in problems)
    assert not validate(compose_spec(["+recipe=debug", "action=export", "checkpoint.export=hf",
                                      "checkpoint.export_dtype=fp8_block", f"checkpoint.resume={tmp_path}"]))


def test_action_export_ignores_the_training_only_settings(tmp_path):
    """A training command's sequence length, batch and token budget do not refuse its export
    (every rule, the resolver's batch split included), and a run keeps its own."""
    from launcher.config.loader import compose_spec
    from launcher.plan.decide.resolve import validate

    training = ["+recipe=debug", "trainer.seq_len=2048", "trainer.global_batch_size=7", "parallel.tp=2",
                "parallel.microbatches=3", "trainer.tokens=100000", "checkpoint.export=hf"]
    run = compose_spec(training)
    assert any("trainer.seq_len=2048 exceeds model.max_seq_len" in p for p in validate(run))
    export = compose_spec([*training, "action=export", f"checkpoint.resume={tmp_path}"])
    assert validate(export) == []
    t = export.trainer
    assert t.seq_len <= export.model.max_seq_len and t.seq_len % 2 == 0 and t.tokens == 0
    assert t.global_batch_size == t.micro_batch_size * 2 and export.parallel.microbatches == -1
    assert export.model == run.model and export.parallel.tp == 2  # what is exported is unchanged


def test_rope_scaling_read_in_both_spellings_written_back_and_validated(hf_models, tmp_path):
    """Llama 3.1's rope_scaling: config.json's `rope_parameters` (transformers 5) and `rope_scaling`
    (4.x) give the same model.rope_scaling; model=hf fills it; export writes it in both spellings;
    a named model without it is a mismatch; other rope types are refused by name; bad values exit 2."""
    from launcher.hf.format import hf_config_for, unsupported_features
    from launcher.config.loader import compose_spec
    from launcher.config.validate import validate

    folder = hf_models["llama31_rope"]
    want = RopeScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8)
    v5 = read_hf_config(folder)
    assert v5["rope_parameters"]["rope_type"] == "llama3" and "rope_scaling" not in v5  # transformers 5's spelling
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items()
                                                                     if k not in ("rope_type", "rope_theta")}})
    for hf in (v5, v4):
        assert unsupported_features(hf) == []
        assert hf_model_fields(hf)["rope_scaling"] == want and hf_model_fields(hf)["rope_theta"] == 10000.0
    written = hf_config_for(ModelConfig(name="hf", **hf_model_fields(v5)), "float32")
    assert written["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert written["rope_parameters"] == LLAMA3_ROPE
    assert hf_model_fields(written)["rope_scaling"] == want
    assert hf_config_for(_model_cfg("debug"), "float32")["rope_scaling"] is None
    # model=hf takes it from config.json; a model config without it disagrees with the folder.
    spec = compose_spec(["model=hf", f"model.init_from={folder}", "cluster.gpus_per_node=1"])
    assert spec.model.rope_scaling == want
    plain = ModelConfig(**{**hf_model_fields(v5), "rope_scaling": RopeScalingConfig(), "name": "x"})
    (problem,) = folder_problems(plain, str(folder))
    assert "model.rope_scaling={'type': 'none'} vs {'type': 'llama3', 'factor': 8.0" in problem and "Fix:" in problem
    for rope_type in ("linear", "dynamic", "yarn", "longrope"):
        (problem,) = unsupported_features({**v5, "rope_parameters": {"rope_type": rope_type, "factor": 2.0}})
        assert f"rope_type={rope_type!r}" in problem and "llama3" in problem
    yarn = tmp_path / "yarn"  # model=hf from such a folder: one line names it (the folder check's)
    yarn.mkdir()
    (yarn / "config.json").write_text(json.dumps({**v5, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    problems = validate(compose_spec(["model=hf", f"model.init_from={yarn}", "cluster.gpus_per_node=1"]))
    assert len([p for p in problems if "yarn" in p]) == 1, problems
    (problem,) = validate(compose_spec(["+recipe=debug", "model.rope_scaling.type=yarn"]))
    assert problem.startswith("model.rope_scaling.type='yarn' is not implemented") and "Fix:" in problem
    problems = validate(compose_spec(["+recipe=debug", "model.rope_scaling.type=llama3",
                                      "model.rope_scaling.low_freq_factor=4", "model.rope_scaling.factor=0.5"]))
    assert len(problems) == 2 and all("Fix:" in p for p in problems), problems
