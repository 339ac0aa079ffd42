"""The data a job names, checked before launch (torch-free: the planner calls it).

`data_sources` turns data.path / data.mix (and data.val_path / data.val_mix) into named,
weighted sources; `data_problems` lists every problem the files show (missing datasets, bad
indexes, token ids beyond the vocabulary, tokenizers that differ inside a mix, bad weights,
document options without document boundaries), one line each ending with a Fix, so the CLI
exits 2 before any rank starts; `repeat_warnings` tells how often the planned steps would read
each source over.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from launcher.config.schema import DataConfig, JobConfig
from launcher.data.corpus import CorpusInfo, corpus_info
from launcher.data.text import text_files
from launcher.data.tokens import shard_files

# Actions that read the data (or plan a run that will): action=export reads none.
DATA_ACTIONS = ("run", "plan", "search", "rehearse")


@dataclass(frozen=True)
class SourceSpec:
    """One named source of a run: its path and its share (1.0 for a single source)."""

    name: str
    path: str
    weight: float


def source_name(path: str) -> str:
    """A mix entry's default name: its path's last folder (or prefix) name."""
    return Path(str(path).rstrip("/")).name or str(path)


def data_sources(cfg: DataConfig, validation: bool = False) -> List[SourceSpec]:
    """The named sources of data.mix (data.val_mix with validation=True), else data.path (val_path)
    as one source."""
    mix = cfg.val_mix if validation else cfg.mix
    if mix:
        return [SourceSpec(m.name or source_name(m.path), str(m.path), float(m.weight)) for m in mix]
    path = cfg.val_path if validation else cfg.path
    return [SourceSpec(source_name(path) if path else cfg.source, path, 1.0)]


def is_mixture(cfg: DataConfig, validation: bool = False) -> bool:
    return bool(cfg.val_mix if validation else cfg.mix)


def _open(src: SourceSpec, key: str, problems: List[str]) -> Optional[CorpusInfo]:
    try:
        return corpus_info(src.path)
    except (OSError, ValueError) as err:  # IndexedFormatError is a ValueError; messages end with a Fix
        problems.append(f"{key}: {err}")
        return None


def _mix_problems(cfg: DataConfig, key: str, validation: bool, problems: List[str]) -> List[SourceSpec]:
    sources = data_sources(cfg, validation)
    weights = [s.weight for s in sources]
    # nan and inf too: every rank turns the weights into exact fractions (launcher/data/mixture.py)
    bad = [f"{s.name}={s.weight:g}" for s in sources if not 0 < s.weight < math.inf]
    if bad:
        problems.append(f"{key}: weights must be > 0 and finite, got {', '.join(bad)} (weights are relative "
                        f"shares). Fix: give every source a positive finite weight, or remove it from {key}.")
    elif sum(weights) <= 0:
        problems.append(f"{key}: the weights sum to 0. Fix: positive weights.")
    names = [s.name for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"{key}: several sources are named {', '.join(dupes)} (a name keys the metrics and the "
                        f"checkpointed read position). Fix: give them distinct `name:` values.")
    for i, s in enumerate(sources):
        if not s.path:
            problems.append(f"{key}[{i}] has no path. Fix: {{path:/data/web,weight:0.7,name:web}}.")
    return [s for s in sources if s.path]


def _indexed_problems(spec: JobConfig, sources: List[SourceSpec], key: str, problems: List[str]) -> List[Tuple[SourceSpec, CorpusInfo]]:
    """Each source opened and checked; the ones that opened."""
    seq = spec.trainer.seq_len
    vocab = spec.model.vocab_size
    opened = []
    for s in sources:
        where = f"{key} source {s.name!r}" if len(sources) > 1 or key.endswith("mix") else f"{key}={s.path}"
        if not os.path.exists(s.path) and not os.path.exists(f"{s.path}.idx"):
            problems.append(f"{where}: {s.path} does not exist. Fix: point it at a folder written by "
                            f"`train action=prepare` (or a Megatron PREFIX of PREFIX.bin/PREFIX.idx).")
            continue
        info = _open(s, where, problems)
        if info is None:
            continue
        opened.append((s, info))
        if not info.complete:
            problems.append(f"{where}: {s.path}/manifest.json says the preparation is not complete "
                            f"(complete=false). Fix: re-run the same `train action=prepare` (it resumes), then train.")
        if info.max_token_id is not None and info.max_token_id >= vocab:
            problems.append(f"{where}: the dataset holds token id {info.max_token_id} (manifest max_token_id) but "
                            f"model.vocab_size={vocab}. Fix: model.vocab_size >= {info.max_token_id + 1}, or data "
                            f"prepared with the model's tokenizer.")
        if info.windows(seq) == 0:
            problems.append(f"{where}: {info.tokens} tokens in {len(info.shards)} shard(s), too few for one sample "
                            f"of trainer.seq_len+1 = {seq + 1} tokens in a shard. Fix: lower trainer.seq_len or add data.")
    hashes = {s.name: info.tokenizer_sha256 for s, info in opened if info.tokenizer_sha256}
    if len(set(hashes.values())) > 1:
        listed = ", ".join(f"{n}: {h[:12]}" for n, h in sorted(hashes.items()))
        problems.append(f"{key}: the sources were prepared with different tokenizers (manifest tokenizer.sha256 {listed}), "
                        f"so the same id means different text. Fix: prepare every source with one tokenizer.")
    return opened


def _plain_path_problems(cfg: DataConfig, path: str, key: str, problems: List[str]) -> None:
    """data.source=tokens|text: the path holds what the ranks will read (found here, not in every rank)."""
    if not path or not os.path.exists(path):
        return  # reported by launcher.config.validate (missing key / missing path)
    try:
        if cfg.source == "tokens":
            shard_files(Path(path), key)
        else:
            text_files(Path(path))
    except (OSError, ValueError) as err:
        problems.append(str(err))


def data_problems(spec: JobConfig) -> List[str]:
    """Every problem with the job's data (empty: none): one line each, ending with a Fix."""
    if spec.action not in DATA_ACTIONS:
        return []
    d, problems = spec.data, []
    validating = spec.trainer.val_every > 0
    if d.source != "indexed":
        for key in ("mix", "val_mix"):
            if getattr(d, key):
                problems.append(f"data.{key} blends indexed datasets but data.source={d.source}. "
                                f"Fix: data=indexed (datasets written by `train action=prepare`).")
        for key in ("document_masking", "reset_positions"):
            if getattr(d, key):
                problems.append(f"data.{key}=true needs document boundaries, which data.source={d.source} does not "
                                f"have (its tokens are one stream). Fix: prepare the corpus with `train action=prepare` "
                                f"and train with data=indexed, or data.{key}=false.")
        if d.source in ("tokens", "text"):
            if spec.action != "run" and d.path and not os.path.exists(d.path):
                problems.append(f"data.path={d.path} does not exist. Fix: point data.path at your {d.source} data.")
            _plain_path_problems(d, d.path, "data.path", problems)
            if validating and d.val_path:
                _plain_path_problems(d, d.val_path, "data.val_path", problems)
    else:
        if d.mix and d.path:
            problems.append(f"data.path={d.path} and data.mix are both set. Fix: one of them (a single dataset "
                            f"is data.path; a blend is data.mix).")
        elif not d.mix and not d.path:
            problems.append("data.source=indexed needs data.path or data.mix. Fix: data.path=/data/prepared, or "
                            "'data.mix=[{path:/d/web,weight:0.7},{path:/d/code,weight:0.3}]'.")
        else:
            key = "data.mix" if d.mix else "data.path"
            sources = _mix_problems(d, key, False, problems) if d.mix else data_sources(d)
            _indexed_problems(spec, sources, key, problems)
        if validating and d.val_mix and d.val_path:
            problems.append("data.val_path and data.val_mix are both set. Fix: one of them.")
        elif validating and (d.val_mix or d.val_path):
            key = "data.val_mix" if d.val_mix else "data.val_path"
            sources = _mix_problems(d, key, True, problems) if d.val_mix else data_sources(d, True)
            _indexed_problems(spec, sources, key, problems)
        if validating and not d.val_mix and not d.val_path:
            pass  # launcher.config.validate names the missing data.val_path
    return problems


def repeat_warnings(spec: JobConfig, steps: int, global_batch_size: int) -> List[str]:
    """One warning per source the planned steps would read more than data.max_epochs times over
    (samples needed at its weight vs windows it has). Silent for the embedded demo corpus and text
    (not tokenized yet), and for data that does not open (data_problems names it)."""
    d = spec.data
    seq = spec.trainer.seq_len
    out = []
    samples = steps * global_batch_size
    if d.source == "indexed":
        sources = data_sources(d)
        total = sum(s.weight for s in sources) or 1.0
        for s in sources:
            try:
                windows = corpus_info(s.path).windows(seq)
            except (OSError, ValueError):
                continue
            needed = samples * s.weight / total
            _repeat_line(out, f"source {s.name!r} ({s.path})" if d.mix else f"data.path={s.path}", needed, windows, seq, d.max_epochs)
    elif d.source == "tokens" and d.path and os.path.exists(d.path):
        try:
            itemsize = np.dtype(d.dtype).itemsize
            windows = sum(max(0, (f.stat().st_size // itemsize - 1) // seq) for f in shard_files(Path(d.path)))
        except (OSError, ValueError):
            return out
        _repeat_line(out, f"data.path={d.path}", samples, windows, seq, d.max_epochs)
    return out


def _repeat_line(out: List[str], what: str, needed: float, windows: int, seq: int, max_epochs: float) -> None:
    if windows <= 0:
        return
    epochs = needed / windows
    if epochs > max_epochs:
        out.append(f"{what}: the planned steps read {needed * seq:,.0f} tokens of its {windows * seq:,} "
                   f"({epochs:.2f} epochs, more than data.max_epochs={max_epochs:g}): the model sees the same data "
                   f"{epochs:.1f} times. Fix: add data, lower trainer.steps or the source's weight, or raise data.max_epochs.")
