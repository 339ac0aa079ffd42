"""The model-family registry: one folder per family (launcher/models/<family>/), keyed by model.family.

A family folder holds what is specific to one architecture:
- ``__init__.py``: its ``FAMILY`` record (this module's ModelFamily), pure Python;
- the model definition it builds (often the shared decoder of launcher/models/transformer.py);
- ``tp.py``: the tensor-parallel plan of one decoder block;
- ``hf.py``: the Hugging Face maps (config.json <-> model.*, tensor names and shapes), pure Python;
- ``params.py``: the parameter counts the planner and FLOPs formulas use, pure Python.

Everything is named by import path and loaded on first use, so the registry (and the planner,
which reads families' hf and params modules) imports no torch. Adding a family: a folder with
those files, its name in FAMILY_PACKAGES, a conf/model/*.yaml with `family:`, and tests
(docs/models.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

# The family folders, in the order they are listed to users.
FAMILY_PACKAGES = ("llama", "mixtral", "qwen3", "deepseek_v3")
DEFAULT_FAMILY = "llama"


@dataclass(frozen=True)
class ModelFamily:
    """What the launcher needs from one model family (import paths, loaded on first use).

    model: "module:attr" of the nn.Module class built from a ModelConfig (needs torch);
    tp_plan: "module:attr" of block_plan(block, styles, *, sequence_parallel) -> the
    parallelize_module plan of one decoder block (needs torch; `styles` is
    launcher.parallel.tp.BlockStyles, so the family imports nothing from launcher/parallel);
    hf: module with hf_model_fields(hf), unsupported_features(hf), hf_config_for(model, dtype)
    and tensor_maps(model) (pure Python);
    params: module with component_counts(model) -> Dict[str, int] (see launcher/plan/estimate/params.py for
    the keys), attention_layout(model) and ffn_linears(model) (the block's matmul shapes and head
    sizes the planner's formulas read: launcher/models/shape.py) and block_description(model) (pure Python);
    hf_model_types: config.json `model_type` values this family reads."""

    name: str
    hf_model_types: Tuple[str, ...]
    model: str
    tp_plan: str
    hf: str
    params: str

    def model_class(self) -> Any:
        return _attr(self.model)

    def tp_block_plan(self) -> Any:
        return _attr(self.tp_plan)

    def hf_module(self) -> ModuleType:
        return importlib.import_module(self.hf)

    def params_module(self) -> ModuleType:
        return importlib.import_module(self.params)


def _attr(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@lru_cache(maxsize=1)
def families() -> Dict[str, ModelFamily]:
    """Every registered family by name (each folder's FAMILY record)."""
    out: Dict[str, ModelFamily] = {}
    for package in FAMILY_PACKAGES:
        spec = importlib.import_module(f"launcher.models.{package}").FAMILY
        out[spec.name] = spec
    return out


def get_family(name: str) -> ModelFamily:
    """The family called `name`; ValueError naming the known ones otherwise."""
    known = families()
    if name not in known:
        raise ValueError(f"model.family={name!r} is not a known model family. "
                         f"Fix: set model.family to one of {', '.join(known)}.")
    return known[name]


def family_of(model: Any) -> ModelFamily:
    """The family of a model config (a config without `family` is llama)."""
    return get_family(str(getattr(model, "family", None) or DEFAULT_FAMILY))


def family_for_hf_type(model_type: Optional[str]) -> Optional[ModelFamily]:
    """The family that reads config.json's `model_type` (None: no family does)."""
    for spec in families().values():
        if model_type in spec.hf_model_types:
            return spec
    return None


def hf_model_types() -> Tuple[str, ...]:
    """Every config.json model_type some family reads."""
    return tuple(t for spec in families().values() for t in spec.hf_model_types)


def family_problems(model: Any) -> List[str]:
    """Why model.family cannot be built (empty: it can): the validator's check, before any rank."""
    name = str(getattr(model, "family", None) or DEFAULT_FAMILY)
    if name in families():
        return []
    types = ", ".join(f"{t} -> {spec.name}" for spec in families().values() for t in spec.hf_model_types)
    return [f"model.family={name!r} is not a known model family. Fix: set model.family to one of "
            f"{', '.join(families())} (a Hugging Face config.json's model_type maps as {types}); "
            f"docs/models.md says how to add a family."]
