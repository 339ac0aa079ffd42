"""DeepSpeed checkpoints that resume at another world size or ZeRO stage (universal checkpoints).

A DeepSpeed checkpoint holds the optimizer partitioned for the data-parallel size and ZeRO
stage that wrote it, and `engine.load_checkpoint` reads it back only under that layout. So the
DeepSpeed engine records what wrote each checkpoint (`deepspeed_layout.json` in the engine
folder, covered by the checkpoint's manifest), and on resume compares it with the layout now:

- same layout: DeepSpeed's plain load (bit-identical continuation);
- another data-parallel size or ZeRO stage (1-2 -> 1-3, 3 -> 3): the checkpoint is converted once with DeepSpeed's
  `deepspeed.checkpoint.ds_to_universal` into `<engine folder>.universal/` beside it (written
  into a hidden `.incomplete_` folder and renamed when complete, so a crash never leaves a
  half-converted folder that looks usable; later resumes reuse it), and loaded with DeepSpeed's
  `checkpoint.load_universal`;
- what DeepSpeed cannot convert or load that way is refused with one line and a Fix: ZeRO-0
  (no ZeRO optimizer partitions to convert), ZeRO-3 -> ZeRO 1-2, the pipeline engine,
  NVMe-offloaded optimizer states (they live in swap files the converter does not read).

Importing this module does not import deepspeed.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
from argparse import Namespace
from pathlib import Path
from typing import Any, Dict, Optional

import torch

log = logging.getLogger(__name__)

LAYOUT_FILE = "deepspeed_layout.json"
UNIVERSAL_SUFFIX = ".universal"
SAME, UNIVERSAL = "same", "universal"


def layout_record(*, world_size: int, dp: int, zero_stage: int, pp: int, offload_optimizer: str) -> Dict[str, Any]:
    """What a checkpoint's loadability depends on: written beside every DeepSpeed save."""
    return {"world_size": int(world_size), "dp": int(dp), "zero_stage": int(zero_stage), "pp": int(pp),
            "offload_optimizer": str(offload_optimizer)}


def write_layout_record(directory: Path, record: Dict[str, Any]) -> None:
    """Write `record` into the engine folder (rank 0; the checkpoint's manifest covers it)."""
    tmp = Path(directory) / (LAYOUT_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(Path(directory) / LAYOUT_FILE)


def read_layout_record(directory: Path) -> Optional[Dict[str, Any]]:
    """The record `write_layout_record` left, or None (a checkpoint saved before it existed)."""
    path = Path(directory) / LAYOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _ranks(n: int) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def _describe(rec: Dict[str, Any]) -> str:
    return (f"{_ranks(rec['world_size'])} (data-parallel {rec['dp']}, pp {rec['pp']}), ZeRO-{rec['zero_stage']}"
            + (f", optimizer offloaded to {rec['offload_optimizer']}" if rec["offload_optimizer"] != "none" else ""))


def resume_action(saved: Optional[Dict[str, Any]], now: Dict[str, Any]) -> str:
    """SAME (DeepSpeed's plain load) or UNIVERSAL (convert, then load_universal).

    Raises ValueError (one line, with a Fix) for a layout change DeepSpeed cannot load.
    """
    if saved is None:
        return SAME  # an older checkpoint without a record: the plain load reports a mismatch itself
    if all(saved[k] == now[k] for k in ("dp", "zero_stage", "pp")):
        return SAME
    head = f"checkpoint.resume: this DeepSpeed checkpoint was saved with {_describe(saved)}; this run has {_describe(now)}"
    back = (f"Fix: resume with the saving layout ({_ranks(saved['world_size'])}, parallel.zero_stage="
            f"{saved['zero_stage']}, parallel.pp={saved['pp']})")
    if 0 in (saved["zero_stage"], now["zero_stage"]):
        raise ValueError(
            f"{head}. A ZeRO-0 checkpoint has no ZeRO optimizer partitions for DeepSpeed's universal conversion, "
            f"and ZeRO-0 cannot load a universal checkpoint. {back}, or use parallel.zero_stage 1-3 on both sides.")
    if saved["pp"] > 1 or now["pp"] > 1:
        raise ValueError(
            f"{head}. The DeepSpeed pipeline engine's checkpoints load only at the layout that wrote them. {back}.")
    if "nvme" in (saved["offload_optimizer"], now["offload_optimizer"]):
        raise ValueError(
            f"{head}. Optimizer states offloaded to NVMe are not converted or loaded by DeepSpeed's universal "
            f"checkpoint. {back}, or use offload.optimizer=cpu|none on both sides.")
    if saved["zero_stage"] == 3 and now["zero_stage"] < 3:
        # The ZeRO-3 conversion writes flat per-parameter tensors without the step and version
        # metadata that ZeRO 1-2's universal load reads (measured with deepspeed 0.19.8).
        raise ValueError(
            f"{head}. DeepSpeed's universal conversion of a ZeRO-3 checkpoint loads only at ZeRO-3. {back}, or "
            f"parallel.zero_stage=3 at any world size.")
    return UNIVERSAL


def universal_dir(engine_dir: Path) -> Path:
    """Where the universal conversion of `engine_dir` is kept: beside it, `<engine_dir>.universal`."""
    engine_dir = Path(engine_dir)
    return engine_dir.with_name(engine_dir.name + UNIVERSAL_SUFFIX)


def convert_to_universal(engine_dir: Path, tag: str) -> bool:
    """Convert `<engine_dir>/<tag>` with ds_to_universal into `universal_dir(engine_dir)/<tag>`
    (one process: rank 0). Returns True if it converted, False if a finished conversion was there.

    Written into `.incomplete_<name>` and renamed when complete: a crash mid-conversion leaves
    no folder that a later resume would trust, and the leftover is removed by the next try.
    """
    final = universal_dir(engine_dir)
    if final.is_dir():
        return False
    tmp = final.with_name(".incomplete_" + final.name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from deepspeed.checkpoint import ds_to_universal  # lazy: deepspeed is slow to import (DeepSpeed backend only)

    # One worker: the converter's process pool would fork this rank, which holds the process
    # group's threads. inject_missing_state: our model has no tensor-parallel slicing patterns.
    args = Namespace(input_folder=str(Path(engine_dir) / tag), output_folder=str(tmp / tag), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter):  # the converter prints its progress
        ds_to_universal.main(args)
    log.debug("ds_to_universal output:\n%s", chatter.getvalue())
    _alias_model_states(tmp / tag)
    _add_stage3_optimizer_view(tmp / tag / "zero" / "optimizer_state.pt")
    tmp.replace(final)
    return True


# The engine finds a universal checkpoint's metadata file (LR schedule, step counters; the
# weights come from zero/) under the loading stage's name: ZeRO-3 wants the first of these,
# ZeRO 1-2 the second, while the converter keeps the saving stage's name.
_MODEL_STATES = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt")


def _add_stage3_optimizer_view(path: Path) -> None:
    """ZeRO-3's universal load reads the optimizer step and hyperparameters from
    `optimizer_state_dict` (the shape its own conversion writes); a ZeRO 1-2 conversion has only
    `param_groups` and per-parameter step.pt files. Add that view (same values) when it is missing."""
    sd = torch.load(path, map_location="cpu", weights_only=False)
    if "optimizer_state_dict" in sd:
        return
    steps = sorted(path.parent.glob("*/step.pt"))
    if not steps:
        raise FileNotFoundError(f"no */step.pt beside {path}: cannot tell the optimizer step")
    step = torch.load(steps[0], map_location="cpu", weights_only=False)
    sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": sd["param_groups"]}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(sd, tmp)
    tmp.replace(path)


def _alias_model_states(folder: Path) -> None:
    """Give the converted metadata file both stages' names (a hard link: no second copy)."""
    present = [name for name in _MODEL_STATES if (folder / name).is_file()]
    if not present:
        raise FileNotFoundError(f"ds_to_universal wrote no model-states file into {folder}")
    for name in _MODEL_STATES:
        if name not in present:
            try:
                os.link(folder / present[0], folder / name)
            except OSError:  # a file system without hard links
                shutil.copy2(folder / present[0], folder / name)
