"""model=hf and model.init_from, on the config's side: model.* typed from a Hugging Face config.json.

launcher/hf/format.py reads config.json and maps its keys (pure Python, below the config); this
module makes the config's types of them (ModelConfig's RopeScalingConfig) and fills a composed
config's missing model.* keys from the folder, refusing with a ConfigError. Loading
(launcher/config/loader.py) calls `fill_from_hf`; hf/ imports nothing from config/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from omegaconf import OmegaConf, open_dict

from launcher.config.errors import ConfigError
from launcher.config.schema import RopeScalingConfig
from launcher.hf.format import (FILL_ONLY_KEYS, FROM_FOLDER_WHEN_NEGATIVE, SHAPE_KEYS, folder_mtp_layers,
                                hf_model_values, read_hf_config)


def hf_model_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """model.* values a config.json describes, typed as ModelConfig holds them."""
    fields = hf_model_values(hf)
    return dict(fields, rope_scaling=RopeScalingConfig(**fields["rope_scaling"]))


def fill_from_hf(cfg) -> None:
    """model=hf: fill the model.* shape keys from config.json of model.init_from,
    and data.tokenizer from the folder's tokenizer.json when data=text has none (a DictConfig,
    edited in place before it becomes a JobConfig). Problems raise ConfigError."""
    model = cfg.get("model")
    if model is None or OmegaConf.is_missing(model, "init_from") or not model.get("init_from"):
        if model is not None and model.get("name") == "hf":
            raise ConfigError(["model=hf takes its shape from a Hugging Face folder but model.init_from is not set. "
                               "Fix: model=hf model.init_from=/path/to/folder (with config.json)."])
        return
    folder = str(model.init_from)
    data = cfg.get("data")
    if data is not None and data.get("source") == "text" and not data.get("tokenizer"):
        tok = Path(folder) / "tokenizer.json"
        if tok.is_file():
            with open_dict(data):
                data.tokenizer = str(tok)
    # model=hf: every shape key from config.json (a yaml ??? cannot override a schema default in
    # OmegaConf's merge, so the name decides); max_seq_len only where left 0 (a user value wins).
    if model.get("name") == "hf":
        missing = list(SHAPE_KEYS) + [k for k in FILL_ONLY_KEYS if not model.get(k)]
    else:
        missing = [k for k in SHAPE_KEYS + FILL_ONLY_KEYS if OmegaConf.is_missing(model, k)]
    from_folder = [k for k in FROM_FOLDER_WHEN_NEGATIVE if int(model.get(k, 0) or 0) < 0]
    if from_folder:  # only mtp_layers: the depths the folder holds (transformers' saves hold none)
        try:
            model.mtp_layers = folder_mtp_layers(folder)
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise ConfigError([f"model.init_from={folder}: cannot take model.mtp_layers from it ({err}). "
                               f"Fix: point model.init_from at a local Hugging Face folder, or set "
                               f"model.mtp_layers=0."]) from err
    if not missing:
        return
    try:
        fields = hf_model_fields(read_hf_config(folder))
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise ConfigError([f"model.init_from={folder}: cannot take model.{', model.'.join(missing)} from it ({err}). "
                           f"Fix: point model.init_from at a local Hugging Face folder with config.json."]) from err
    for k in missing:
        model[k] = fields[k]
