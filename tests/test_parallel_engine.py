"""The native engine in one process (no process group): export, save/load, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher.config.schema import OptimConfig
from launcher.engines.base import EngineOptions
from launcher.engines.native import NativeEngine
from launcher.models import build_model
from tests.layout_for import layout_for
from tests.test_models import model_cfg


def engine(model: str = "debug"):
    cfg = model_cfg(model)
    layout = layout_for(cfg, 1, **{"trainer.global_batch_size": 2, "trainer.seq_len": 8})
    options = EngineOptions(total_steps=10, grad_clip=1.0, seed=5)
    return cfg, NativeEngine(cfg, OptimConfig(lr=1e-2, warmup_steps=0), layout, torch.device("cpu"), options)


def batches(step: int, vocab: int = 256):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (2, 9), generator=g)
    return [(x[i:i + 1, :-1], x[i:i + 1, 1:]) for i in range(2)]


def test_export_fp32_loads_into_a_fresh_model(tmp_path):
    cfg, eng = engine("debug_moe")
    eng.train_step(batches(0))
    eng.export(tmp_path / "model.pt", "fp32")
    sd = torch.load(tmp_path / "model.pt")
    assert all(v.dtype == torch.float32 for v in sd.values())
    fresh = build_model(cfg)
    fresh.load_state_dict(sd)
    x = batches(1)[0][0]
    torch.testing.assert_close(fresh(x), eng.model_parts[0](x))


def test_export_safetensors(tmp_path):
    from safetensors.torch import load_file

    _, eng = engine()
    eng.export(tmp_path / "model.safetensors", "safetensors")
    assert "output.weight" in load_file(str(tmp_path / "model.safetensors"))


def test_save_load_resumes_bitwise(tmp_path):
    _, a = engine()
    for s in range(2):
        a.train_step(batches(s))
    a.save(tmp_path / "ckpt")
    want = [a.train_step(batches(s)).loss for s in (2, 3)]
    _, b = engine()
    b.load(tmp_path / "ckpt")
    got = [b.train_step(batches(s)).loss for s in (2, 3)]
    assert got == want, f"resumed losses {got} != uninterrupted {want}"
    assert b.schedulers[0].last_epoch == a.schedulers[0].last_epoch


def test_step_stats_and_aux(tmp_path):
    _, eng = engine("debug_moe")
    st = eng.train_step(batches(0))
    assert st.loss > 0 and st.grad_norm > 0 and st.lr == pytest.approx(1e-2)
    assert st.extra["moe_aux_loss"] > 0


def test_bad_export_format(tmp_path):
    _, eng = engine()
    with pytest.raises(ValueError, match="fp32\\|safetensors"):
        eng.export(tmp_path / "m.bin", "onnx")
