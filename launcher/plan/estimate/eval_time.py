"""The cost of in-loop downstream evaluation (eval.*): tokens scored per call and its time.

Without lm-eval or torch (action=plan stays instant): for a task YAML under eval.include_path
with local JSON-lines data, the documents are read and measured (their text at CHARS_PER_TOKEN
characters per token, the requests per document from `doc_to_choice`); any other task (a
built-in one, whose data is in the Hugging Face cache) gets the documented defaults below. The
time comes from the plan's own compute time per token: a forward is a third of a training step's
forward and backward, so evaluating T tokens costs T / tokens_per_step x compute_s / 3. T counts
what runs: every request is a row padded to trainer.seq_len (launcher/eval/rows.py), and a request
longer than that takes one row per seq_len tokens (lm-eval's rolling windows, HFLM's truncation).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher.config.schema import JobConfig
from launcher.data.eval_inputs import task_yamls

CHARS_PER_TOKEN = 4.0  # English text under BPE tokenizers of 32K-150K entries
# A task we cannot read: 1,000 documents (or eval.limit), 4 requests per document (a 4-way
# multiple choice), 128 tokens per request before few-shot examples.
DEFAULT_DOCS = 1000
DEFAULT_REQUESTS_PER_DOC = 4
DEFAULT_REQUEST_TOKENS = 128
FORWARD_SHARE = 1.0 / 3.0  # a forward's share of a training step's compute (backward = 2 forwards)
_FIELD = re.compile(r"^\s*\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}\s*$")


def _local_rows(path: Path, doc: Dict[str, Any], limit: int) -> Optional[List[Dict[str, Any]]]:
    """The first `limit` rows (all when 0) of a JSON-lines task's data, or None when unreadable."""
    if doc.get("dataset_path") != "json":
        return None
    files = (doc.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):  # the split lm-eval scores: test, else validation
        split = doc.get("test_split") or doc.get("validation_split") or next(iter(files), None)
        files = files.get(split) if split else None
    if isinstance(files, list):
        files = files[0] if files else None
    if not isinstance(files, str):
        return None
    data = Path(files) if os.path.isabs(files) else path.parent / files
    rows: List[Dict[str, Any]] = []
    try:
        with open(data, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    rows.append(json.loads(line))
                    if limit and len(rows) >= limit:
                        break
    except (OSError, ValueError):
        return None
    return rows


def _requests_per_doc(doc: Dict[str, Any], row: Dict[str, Any]) -> int:
    """lm-eval makes one request per choice of a multiple-choice document, else one."""
    if doc.get("output_type") != "multiple_choice":
        return 1
    choices = doc.get("doc_to_choice")
    if isinstance(choices, list):
        return max(1, len(choices))
    field = _FIELD.match(choices) if isinstance(choices, str) else None
    value = row.get(field.group(1)) if field else None
    return max(1, len(value)) if isinstance(value, list) else DEFAULT_REQUESTS_PER_DOC


def _row_tokens(row: Dict[str, Any]) -> float:
    text = sum(len(v) for v in row.values() if isinstance(v, str))
    text += sum(len(x) for v in row.values() if isinstance(v, list) for x in v if isinstance(x, str))
    return text / CHARS_PER_TOKEN


def task_tokens(name: str, found: Dict[str, Tuple[Path, Dict[str, Any]]], limit: int,
                num_fewshot: int, seq_len: int) -> Dict[str, Any]:
    """One task's documents, requests, text tokens and the tokens its padded rows run per
    evaluation call, and where the figures came from."""
    rows = _local_rows(*found[name], limit) if name in found else None
    if rows:
        doc = found[name][1]
        requests = sum(_requests_per_doc(doc, r) for r in rows)
        per_request = sum(_row_tokens(r) for r in rows) / len(rows)
        docs, source = len(rows), f"measured from {found[name][0].name}'s data"
    else:
        docs = limit or DEFAULT_DOCS
        requests = docs * DEFAULT_REQUESTS_PER_DOC
        per_request, source = float(DEFAULT_REQUEST_TOKENS), "defaults (the task's data is not read before launch)"
    # Each few-shot example repeats about one document's text in the context.
    per_request *= 1 + num_fewshot
    rows = requests * max(1, math.ceil(per_request / max(1, seq_len)))
    return {"task": name, "docs": docs, "requests": requests, "text_tokens": int(requests * per_request),
            "rows": rows, "tokens": rows * seq_len, "source": source}


def eval_workload(spec: JobConfig) -> Dict[str, Any]:
    """What one evaluation call scores ({} when evaluation is off): tasks, tokens per call, calls
    in the run. Read once per plan (action=search prices every candidate with it)."""
    e = spec.eval
    if not e.tasks or e.every <= 0:
        return {}
    folders = [f for f in e.include_path if os.path.isdir(f)]
    found = {doc["task"]: (path, doc) for path, doc in task_yamls(folders)}
    tasks = [task_tokens(name, found, e.limit, e.num_fewshot, spec.trainer.seq_len) for name in e.tasks]
    return {"every": e.every, "tasks": tasks, "tokens_per_call": sum(t["tokens"] for t in tasks),
            "calls": spec.trainer.steps // e.every}


def eval_estimate(workload: Dict[str, Any], compute_s: float, tokens_per_step: int) -> Dict[str, Any]:
    """plan.json's `eval`: the workload with its seconds per call, in the run, and per training
    step once amortized ({} when evaluation is off)."""
    if not workload:
        return {}
    call_s = workload["tokens_per_call"] / max(1, tokens_per_step) * compute_s * FORWARD_SHARE
    return {**workload, "call_s": call_s, "total_s": workload["calls"] * call_s,
            "per_step_s": call_s / workload["every"]}


def eval_summary(ev: Dict[str, Any]) -> str:
    """action=plan's evaluation line ('' when evaluation is off)."""
    if not ev:
        return ""
    tasks = ", ".join(f"{t['task']} {t['docs']:,} docs / {t['requests']:,} requests / {t['rows']:,} rows of "
                      f"{t['tokens'] // max(1, t['rows']):,} tokens ({t['text_tokens']:,} of text)"
                      f"{'' if t['source'].startswith('measured') else ' (defaults)'}" for t in ev["tasks"])
    return (f"Evaluation (eval.every={ev['every']}): {ev['tokens_per_call']:,} tokens per call = {ev['call_s']:.1f} s "
            f"(forward at the plan's compute rate), {ev['calls']:,} calls = {ev['total_s'] / 3600:,.2f} h in the run, "
            f"+{ev['per_step_s']:.3f} s per step amortized\n  {tasks}")
