"""What downstream evaluation (eval.*) reads, checked before launch without lm-eval or torch.

- the tokenizer folder: eval.tokenizer, else the tokenizer recorded in data.path's manifest.json
  (`train action=prepare`), else model.init_from's folder;
- each task's local data: the task YAMLs under eval.include_path are read as plain YAML (their
  `dataset_path` and `dataset_kwargs.data_files`), so `action=plan` stays instant and torch-free.
  Built-in tasks (no include_path) are checked fully by the launch pre-check of `action=run`
  (launcher/launch/preflight.py), which builds them offline with lm-eval.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import yaml

from launcher.config.schema import JobConfig
from launcher.data.corpus import read_manifest

# What lm-eval's `datasets` loads from local files (dataset_path: <builder> + data_files).
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def eval_tokenizer_folder(spec: JobConfig) -> Tuple[str, str]:
    """(folder, the key it came from) of the tokenizer evaluation encodes text with ('' when none)."""
    if spec.eval.tokenizer:
        return spec.eval.tokenizer, "eval.tokenizer"
    if spec.data.source == "indexed" and spec.data.path and os.path.isdir(spec.data.path):
        try:
            manifest = read_manifest(Path(spec.data.path)) or {}
        except ValueError:
            manifest = {}
        path = str((manifest.get("tokenizer") or {}).get("path") or "")
        if path:
            return (str(Path(path).parent) if os.path.isfile(path) else path), f"data.path={spec.data.path} (manifest.json)"
    if spec.model.init_from:
        return spec.model.init_from, "model.init_from"
    return "", ""


class _Lenient(yaml.SafeLoader):
    """PyYAML that reads lm-eval's `!function module.fn` tags as plain strings."""


_Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_yamls(include_path: List[str]) -> Iterator[Tuple[Path, Dict[str, Any]]]:
    """(file, its mapping) of every task YAML under the folders."""
    for folder in include_path:
        for path in sorted(Path(folder).rglob("*.yaml")):
            try:
                doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_Lenient)
            except (OSError, yaml.YAMLError, UnicodeDecodeError):
                continue  # lm-eval reports a malformed file when it builds the task
            if isinstance(doc, dict) and isinstance(doc.get("task"), str):
                yield path, doc


def _data_files(doc: Dict[str, Any]) -> List[str]:
    files = ((doc.get("dataset_kwargs") or {}).get("data_files")) or []
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        out: List[str] = []
        for value in files.values():
            out.extend([value] if isinstance(value, str) else list(value or []))
        return out
    return [str(f) for f in files]


def eval_task_keys(spec: JobConfig) -> Dict[str, str]:
    """{task name: the key that names it}: eval.tasks (in the loop), then eval.on_checkpoint (the
    per-checkpoint jobs, when eval.job is on)."""
    out = {name: "eval.tasks" for name in spec.eval.tasks}
    if spec.eval.job:
        for name in spec.eval.on_checkpoint:
            out.setdefault(name, "eval.on_checkpoint")
    return out


def eval_input_problems(spec: JobConfig) -> List[str]:
    """eval.* inputs that do not exist: include_path folders, the tokenizer, local task data."""
    e = spec.eval
    named = eval_task_keys(spec)
    if not named:
        return []
    problems: List[str] = []
    folders = []
    for folder in e.include_path:
        if os.path.isdir(folder):
            folders.append(folder)
        else:
            problems.append(f"eval.include_path: {folder} is not a folder. Fix: the folder holding your task YAMLs.")
    tok, key = eval_tokenizer_folder(spec)
    if not tok:
        problems.append(f"{', '.join(sorted(set(named.values())))} needs a tokenizer to encode the tasks' text, and none is known. Fix: "
                        "eval.tokenizer=/path/to/hf_tokenizer_folder (or train on data prepared with one).")
    elif not any(os.path.isfile(os.path.join(tok, f)) for f in TOKENIZER_FILES):
        problems.append(f"eval.tokenizer: {tok} (from {key}) holds no {' / '.join(TOKENIZER_FILES)}. Fix: "
                        f"eval.tokenizer=<a Hugging Face tokenizer folder> (nothing is downloaded).")
    found = {doc["task"]: (path, doc) for path, doc in task_yamls(folders)}
    for name, key in named.items():
        if name not in found:
            continue  # a group, a tag or a built-in task: the launch pre-check builds it
        path, doc = found[name]
        dataset = doc.get("dataset_path")
        files = _data_files(doc)
        if dataset in LOCAL_BUILDERS:
            missing = [f for f in files if not (os.path.exists(f) or (path.parent / f).exists())]
            if not files or missing:
                problems.append(f"{key}: task {name} ({path}) reads dataset_path: {dataset} but its data_files "
                                f"{missing or '(none given)'} do not exist. Fix: point dataset_kwargs.data_files at "
                                f"local files.")
        elif isinstance(dataset, str) and dataset and not os.path.exists(dataset) and not _hf_cached(dataset):
            problems.append(f"{key}: task {name} ({path}) reads the Hub dataset {dataset}, which is not in this "
                            f"machine's Hugging Face cache, and the ranks never download. Fix: cache it first on a node "
                            f"with network access (docs/evaluation.md), or use dataset_path: json with local data_files.")
    return problems


def _hf_cache_dir() -> Path:
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "datasets"


def _hf_cached(dataset: str) -> bool:
    """Whether `datasets` has anything cached for the Hub dataset `owner/name` (its folder name)."""
    cache = _hf_cache_dir()
    return any(cache.glob(dataset.replace("/", "___") + "*")) if cache.is_dir() else False
