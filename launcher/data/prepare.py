"""`train action=prepare`: local raw files -> Megatron indexed shards + manifest.json, resumably.

    train action=prepare prepare.input='/raw/web/*.jsonl.zst' prepare.output=/data/web \\
          prepare.tokenizer=/models/Llama-3.1-8B prepare.workers=32

The main process reads the files in sorted order (launcher/data/readers.py) and cuts them into
fixed-size chunks of records; `prepare.workers` processes parse and tokenize the chunks, and the
main process takes their results back in order and writes shards of about `prepare.shard_tokens`
tokens (documents never split). Every decision about the output (order, shard cuts) is made in
the main process on the ordered stream, so the bytes do not depend on the worker count.

A shard is written aside, renamed in, and only then listed in manifest.json (itself rewritten
atomically) together with the position in the input where the next shard starts. A run killed
at any point therefore leaves a manifest whose shards are complete; the next run checks that
the input files, tokenizer and settings are the ones the manifest records and continues from
that position.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from launcher.config.errors import print_problems
from launcher.config.loader import load_spec
from launcher.config.schema import PrepareConfig
from launcher.data.indexed import token_dtype_for_vocab, write_index
from launcher.data.readers import JSON_LINE, TEXT_BYTES, SourceReader, file_format, input_files, parquet_schema_problem
from launcher.data.tokenizer import (TokenizerError, TokenizerInfo, document_layout, load_tokenizer_info,
                                      open_for_documents)

MANIFEST = "manifest.json"
FORMAT = "launcher-indexed"
VERSION = 1
BAD_RECORD_CHOICES = ("fail", "skip")
# A chunk (the unit of work a tokenizer process gets) ends at this many records or bytes.
CHUNK_RECORDS = 256
CHUNK_BYTES = 256 << 10
# Chunks in flight per worker: keeps every worker busy and memory bounded (Pool.imap would
# read the whole input ahead).
IN_FLIGHT_PER_WORKER = 3
SHARD_PREFIX = "shard_"


class PrepareError(Exception):
    """Prepare cannot go on; `problems` are one line each, ending with a fix."""

    def __init__(self, problems: Sequence[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


# --------------------------------------------------------------------------- checks before work


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which SLURM and taskset set)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def settings_of(cfg: PrepareConfig) -> dict:
    """The settings that decide the output bytes (a resumed run must use the same)."""
    return {"text_key": cfg.text_key, "shard_tokens": int(cfg.shard_tokens), "on_bad_record": cfg.on_bad_record}


def source_stamps(files: Sequence[Path]) -> List[dict]:
    """path, size and mtime of each input file: how a resumed run knows they did not change."""
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": str(f), "size": st.st_size, "mtime": st.st_mtime})
    return out


def prepare_problems(cfg: PrepareConfig) -> List[str]:
    """Every problem with the prepare.* keys, checked before any work (empty: none)."""
    problems: List[str] = []
    if cfg.workers < 0:
        problems.append(f"prepare.workers={cfg.workers} must be >= 0 (0: every core). Fix: e.g. prepare.workers=0.")
    if cfg.shard_tokens <= 0:
        problems.append(f"prepare.shard_tokens={cfg.shard_tokens} must be positive. Fix: e.g. prepare.shard_tokens=250000000.")
    if cfg.on_bad_record not in BAD_RECORD_CHOICES:
        problems.append(f"prepare.on_bad_record={cfg.on_bad_record!r} is not one of fail, skip. "
                        f"Fix: prepare.on_bad_record=fail (stop at the first bad record) or skip (count and go on).")
    if not cfg.text_key:
        problems.append("prepare.text_key is empty. Fix: prepare.text_key=text (the JSON key / parquet column of the text).")
    out = Path(cfg.output).expanduser() if cfg.output else None
    if out is None:
        problems.append("prepare.output is empty. Fix: prepare.output=/path/to/dataset_folder (created if missing).")
    elif out.exists() and not out.is_dir():
        problems.append(f"prepare.output={cfg.output} is a file; prepare writes a folder of shards. "
                        f"Fix: choose a folder path, e.g. prepare.output={cfg.output}_tokens.")
    files: List[Path] = []
    try:
        files = input_files(cfg.input)
    except ValueError as err:
        problems.append(str(err))
    if cfg.text_key:
        bad = [p for p in (parquet_schema_problem(f, cfg.text_key) for f in files if file_format(f) == ".parquet") if p]
        problems.extend(bad[:5])
        if len(bad) > 5:
            problems.append(f"... and {len(bad) - 5} more parquet files with the same kind of problem. Fix: as above.")
    tok: Optional[TokenizerInfo] = None
    try:
        tok = load_tokenizer_info(cfg.tokenizer, cfg.eos_token)
    except TokenizerError as err:
        problems.append(str(err))
    if out is not None and out.is_dir() and files and tok is not None and not problems:
        problems.extend(resume_problems(out, source_stamps(files), tok, settings_of(cfg)))
    return problems


def read_manifest(out_dir: Path) -> Optional[dict]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def resume_problems(out_dir: Path, sources: List[dict], tok: TokenizerInfo, settings: dict) -> List[str]:
    """Why the dataset already in `out_dir` cannot be continued (or confirmed) with this input."""
    fix = f"Fix: choose a new prepare.output (or delete {out_dir} to start over)."
    try:
        manifest = read_manifest(out_dir)
    except (ValueError, OSError) as err:
        return [f"prepare.output={out_dir}: its {MANIFEST} cannot be read ({err}). {fix}"]
    if manifest is None:
        # A prepare writes its manifest before its first shard, so files without one are someone else's.
        others = sorted(p.name for p in out_dir.iterdir())
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            return [f"prepare.output={out_dir} is a folder with other files ({shown}) and no {MANIFEST}. "
                    f"Fix: choose a new or empty folder for prepare.output."]
        return []
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return [f"prepare.output={out_dir}: {MANIFEST} is not a {FORMAT} v{VERSION} manifest. {fix}"]
    problems = []
    old_tok = manifest.get("tokenizer", {})
    if old_tok.get("sha256") != tok.sha256:
        problems.append(f"prepare.output={out_dir} was prepared with another tokenizer ({old_tok.get('path')}, "
                        f"sha256 {str(old_tok.get('sha256'))[:12]}...) than prepare.tokenizer ({tok.path}, "
                        f"sha256 {tok.sha256[:12]}...). {fix}")
    else:
        # A manifest written before start_ids/end_ids were recorded: BOS by add_bos_token, then EOS.
        old_start = old_tok.get("start_ids", [old_tok.get("bos_id")] if old_tok.get("add_bos") else [])
        old_end = old_tok.get("end_ids", [old_tok.get("eos_id")])
        if list(old_start) != list(tok.start_ids) or list(old_end) != list(tok.end_ids):
            was = document_layout(old_tok.get("starts_with", [str(i) for i in old_start]),
                                  old_tok.get("ends_with", [str(i) for i in old_end]))
            problems.append(f"prepare.output={out_dir} holds documents written as {was}; prepare.tokenizer and "
                            f"prepare.eos_token now give {document_layout(tok.starts_with, tok.ends_with)}. {fix}")
    old_settings = dict(manifest.get("settings", {}))
    if not manifest.get("skipped"):
        # No record skipped yet: the shards so far are the same under fail and skip, so a run stopped
        # by on_bad_record=fail continues with on_bad_record=skip (the fix its message gives).
        old_settings["on_bad_record"] = settings.get("on_bad_record")
    changed = [f"prepare.{k}: {old_settings.get(k)!r} -> {v!r}" for k, v in settings.items() if old_settings.get(k) != v]
    if changed:
        problems.append(f"prepare.output={out_dir} was prepared with other settings ({'; '.join(changed)}). "
                        f"Fix: the earlier values to continue it, or a new prepare.output.")
    old_sources = [{k: s.get(k) for k in ("path", "size", "mtime")} for s in manifest.get("sources", [])]
    if old_sources != sources:
        old_paths = {s["path"]: s for s in old_sources}
        new_paths = {s["path"]: s for s in sources}
        changed_files = [p for p in new_paths if p in old_paths and old_paths[p] != new_paths[p]]
        detail = (f"changed since: {', '.join(changed_files[:3])}" if changed_files else
                  f"{len(set(new_paths) - set(old_paths))} new, {len(set(old_paths) - set(new_paths))} missing files")
        problems.append(f"prepare.output={out_dir} was prepared from other input files ({detail}). {fix}")
    dtype = np.dtype(manifest.get("dtype", "uint16"))
    for shard in manifest.get("shards", []):
        bin_path = out_dir / f"{shard['name']}.bin"
        want = shard["tokens"] * dtype.itemsize
        if not bin_path.is_file() or bin_path.stat().st_size != want or not (out_dir / f"{shard['name']}.idx").is_file():
            problems.append(f"prepare.output={out_dir}: {shard['name']} is listed in {MANIFEST} but its .bin/.idx is "
                            f"missing or not {want} bytes. {fix}")
            break
    return problems


# --------------------------------------------------------------------------- tokenizer processes

_WORKER: dict = {}


def _init_worker(tokenizer_path: str, text_key: str, prepend: Tuple[int, ...], append: Tuple[int, ...],
                 dtype: str) -> None:
    """Load the tokenizer once per process. One thread per process: `workers` processes = `workers` cores.
    `prepend`/`append`: the ids prepare adds around the post-processor's output (TokenizerInfo)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer  # lazy: tokenizers (a Rust extension) only when a tokenizer.json is read

    tok = open_for_documents(Tokenizer.from_file(tokenizer_path))
    # encode_batch_fast (tokenizers >= 0.21) skips the offsets prepare does not use; same ids.
    _WORKER.update(tok=tok, encode_batch=getattr(tok, "encode_batch_fast", tok.encode_batch), key=text_key,
                   prepend=list(prepend), append=list(append), dtype=np.dtype(dtype))


def _text_of(kind: int, payload: object, key: str) -> Tuple[Optional[str], str]:
    """(text, "") or (None, why the record is bad)."""
    if kind == TEXT_BYTES:
        try:
            return payload.decode("utf-8"), ""  # type: ignore[union-attr]
        except UnicodeDecodeError as err:
            return None, f"not UTF-8 (byte {err.start})"
    if kind == JSON_LINE:
        try:
            line = payload.decode("utf-8")  # type: ignore[union-attr]
        except UnicodeDecodeError as err:
            return None, f"not UTF-8 (byte {err.start} of the line)"
        try:
            obj = json.loads(line)
        except ValueError as err:
            return None, f"not JSON ({getattr(err, 'msg', err)} at column {getattr(err, 'colno', '?')})"
        if not isinstance(obj, dict):
            return None, f"a JSON {type(obj).__name__}, not an object with {key!r}"
        if key not in obj:
            return None, f"no key {key!r} (keys: {', '.join(list(obj)[:8])})"
        payload = obj[key]
    if isinstance(payload, str):
        return payload, ""
    return None, f"{key!r} is {'null' if payload is None else type(payload).__name__}, not a string"


def _encode_chunk(items: List[Tuple[int, object]]) -> Tuple[np.ndarray, np.ndarray, Dict[int, str]]:
    """Tokenize one chunk: (token ids of its documents back to back, per record the document's
    length or -1 for a bad record, {record index in the chunk: why it is bad})."""
    w = _WORKER
    key, prepend, append = w["key"], w["prepend"], w["append"]
    texts: List[str] = []
    slots: List[int] = []
    bad: Dict[int, str] = {}
    for j, (kind, payload) in enumerate(items):
        text, why = _text_of(kind, payload, key)
        if why:
            bad[j] = why
        else:
            texts.append(text)  # type: ignore[arg-type]
            slots.append(j)
    try:
        # The post-processor's special tokens, as transformers' tokenizer(text) adds them.
        encodings = w["encode_batch"](texts, add_special_tokens=True)
    except Exception:  # a text the tokenizer refuses (a lone surrogate from a JSON escape): find it
        encodings = []
        kept = []
        for j, text in zip(slots, texts):
            try:
                encodings.append(w["tok"].encode(text, add_special_tokens=True))
                kept.append(j)
            except Exception as err:
                bad[j] = f"text the tokenizer refuses ({str(err).strip()[:80]})"
        slots = kept
    lengths = np.full(len(items), -1, dtype=np.int64)
    flat: List[int] = []
    extra = len(prepend) + len(append)
    for j, enc in zip(slots, encodings):
        ids = enc.ids
        flat.extend(prepend)
        flat.extend(ids)
        flat.extend(append)
        lengths[j] = len(ids) + extra
    return np.array(flat, dtype=w["dtype"]), lengths, bad


class _Encoders:
    """Ordered, bounded map of chunks over `workers` processes (in this process when workers=1)."""

    def __init__(self, workers: int, initargs: tuple):
        self.workers = workers
        self.pool = None
        if workers == 1:
            self._saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
            _init_worker(*initargs)
        else:
            # fork where there is one: a worker starts in milliseconds instead of re-importing the
            # `train` command (Hydra, OmegaConf) as spawn does. The pool is made before any input
            # is read, so no reader library is mid-use in another thread; the workers load their
            # own tokenizer and never use the library's thread pool (TOKENIZERS_PARALLELISM=false).
            # A worker closes its copy of the task pipe's write end (multiprocessing.pool.worker), so
            # when this process dies, even by kill -9, the workers read EOF and exit.
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            self.pool = multiprocessing.get_context(method).Pool(workers, _init_worker, initargs)

    def map(self, chunks: Iterator[Tuple["_Chunk", list]]) -> Iterator[Tuple["_Chunk", tuple]]:
        if self.pool is None:
            for chunk, items in chunks:
                yield chunk, _encode_chunk(items)
            return
        pending: deque = deque()
        limit = self.workers * IN_FLIGHT_PER_WORKER
        for chunk, items in chunks:
            pending.append((chunk, self.pool.apply_async(_encode_chunk, (items,))))
            if len(pending) >= limit:
                first, result = pending.popleft()
                yield first, result.get()
        while pending:
            first, result = pending.popleft()
            yield first, result.get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        else:
            if self._saved_env is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = self._saved_env


# --------------------------------------------------------------------------- reading and writing


@dataclass
class _Chunk:
    source: int  # index into the sorted input files
    numbers: List[int]  # record number (line, row) of each record, from 1
    bytes_done: int  # input bytes read when the chunk was cut (progress and ETA)


def _chunks(files: Sequence[Path], sizes: Sequence[int], text_key: str, start: Tuple[int, int]) -> Iterator[Tuple[_Chunk, list]]:
    """Chunks of records from position `start` = (source index, records already consumed)."""
    before = sum(sizes[: start[0]])
    for s in range(start[0], len(files)):
        reader = SourceReader(files[s], text_key, start=start[1] if s == start[0] else 0)
        items: list = []
        numbers: List[int] = []
        size = 0
        for number, kind, payload in reader.records():
            items.append((kind, payload))
            numbers.append(number)
            size += len(payload) if isinstance(payload, (bytes, str)) else 8
            if len(items) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
                yield _Chunk(s, numbers, before + reader.bytes_read), items
                items, numbers, size = [], [], 0
        if items:
            yield _Chunk(s, numbers, before + sizes[s]), items
        before += sizes[s]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class _ShardWriter:
    """One shard: .bin streamed aside (hashed as written), .idx written at the end, both renamed in."""

    def __init__(self, out_dir: Path, index: int, dtype: np.dtype):
        self.name = f"{SHARD_PREFIX}{index:05d}"
        self.out_dir = out_dir
        self.dtype = dtype
        self.tmp = out_dir / f"{self.name}.bin.tmp-{os.getpid()}"
        self.file = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.lengths: List[int] = []
        self.tokens = 0  # of the documents added (written or not yet)
        self.max_id = -1

    def add_document(self, length: int) -> None:
        self.lengths.append(length)
        self.tokens += length

    def write(self, ids: np.ndarray) -> None:
        if ids.size:
            data = memoryview(np.ascontiguousarray(ids)).cast("B")
            self.file.write(data)
            self.hash.update(data)
            self.max_id = max(self.max_id, int(ids.max()))

    def finish(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        bin_path = self.out_dir / f"{self.name}.bin"
        idx_path = self.out_dir / f"{self.name}.idx"
        self.tmp.replace(bin_path)
        write_index(idx_path, self.dtype, np.asarray(self.lengths, dtype=np.int64))
        return {"name": self.name, "documents": len(self.lengths), "tokens": self.tokens, "dtype": self.dtype.name,
                "bin_sha256": self.hash.hexdigest(), "idx_sha256": _sha256_file(idx_path), "max_token_id": self.max_id}


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    path = out_dir / MANIFEST
    tmp = out_dir / f"{MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _remove_leftovers(out_dir: Path, listed: int) -> None:
    """Files of an interrupted run: temporaries, and shards renamed in but never listed."""
    for p in out_dir.iterdir():
        if ".tmp-" in p.name:
            p.unlink()
        elif p.name.startswith(SHARD_PREFIX) and p.suffix in (".bin", ".idx"):
            digits = p.stem[len(SHARD_PREFIX):]
            if digits.isdigit() and int(digits) >= listed:
                p.unlink()


# --------------------------------------------------------------------------- progress


class _Progress:
    """A rich progress bar on a terminal (documents/s, tokens/s, ETA by input bytes); elsewhere one
    line per finished shard."""

    def __init__(self, total_bytes: int, done_bytes: int, enabled: Optional[bool]):
        self.total = max(1, total_bytes)
        self.start_bytes = done_bytes
        self.t0 = time.monotonic()
        self.docs = 0
        self.tokens = 0
        self.bytes = done_bytes
        self.bar = None
        tty = sys.stderr.isatty() if enabled is None else enabled
        if tty:
            # lazy: rich.progress (~70 ms) only for a terminal's progress bar
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("prepare"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                                TextColumn("{task.fields[rates]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("prepare", total=self.total, completed=done_bytes, rates="")
            self.bar.start()

    def rates(self) -> Tuple[float, float]:
        dt = max(1e-9, time.monotonic() - self.t0)
        return self.docs / dt, self.tokens / dt

    def update(self, docs: int, tokens: int, bytes_done: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes = bytes_done
        if self.bar is not None:
            d, t = self.rates()
            self.bar.update(self.task, completed=min(bytes_done, self.total), rates=f"{d:,.0f} docs/s {t:,.0f} tokens/s")

    def eta_s(self) -> float:
        done = self.bytes - self.start_bytes
        if done <= 0:
            return float("nan")
        return (self.total - self.bytes) * (time.monotonic() - self.t0) / done

    def shard(self, shard: dict) -> None:
        if self.bar is None:
            d, t = self.rates()
            eta = self.eta_s()
            speed = f", {d:,.0f} docs/s, {t:,.0f} tokens/s, ETA {eta:,.0f} s" if self.docs and eta == eta else ""
            print(f"prepare: {shard['name']} written ({shard['documents']:,} documents, {shard['tokens']:,} tokens); "
                  f"{100 * self.bytes / self.total:.1f}% of the input read{speed}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# --------------------------------------------------------------------------- the run


@dataclass
class _SourceStats:
    stamp: dict
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    first_skipped: str = ""

    def to_json(self) -> dict:
        return {**self.stamp, "documents": self.documents, "tokens": self.tokens, "skipped": self.skipped,
                "first_skipped": self.first_skipped}


@dataclass
class _State:
    shards: List[dict] = field(default_factory=list)
    next_position: Tuple[int, int] = (0, 0)


def _record_name(path: Path, number: int) -> str:
    fmt = file_format(path)
    if fmt == ".txt":
        return "the file"
    return f"row {number}" if fmt == ".parquet" else f"line {number}"


def _manifest(tok: TokenizerInfo, dtype: np.dtype, settings: dict, sources: List[_SourceStats], shards: List[dict],
              position: Tuple[int, int], complete: bool) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "tokenizer": tok.to_json(),
        "max_token_id": max((s["max_token_id"] for s in shards), default=-1),
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "skipped": sum(s.skipped for s in sources),
        "shards": shards,
        "sources": [s.to_json() for s in sources],
        "settings": settings,
        # Where the next shard starts: records of sources[source] already consumed (a resume reads on from there).
        "next": {"source": position[0], "record": position[1]},
        "complete": complete,
    }


def run_prepare(cfg: PrepareConfig, progress: Optional[bool] = None) -> dict:
    """Prepare cfg.input into cfg.output (continuing an interrupted run); returns the manifest.

    Raises PrepareError for a bad configuration or, with on_bad_record=fail, the first bad record.
    `progress`: a progress bar (True), shard lines only (False), or decide by whether stderr is a terminal (None).
    """
    problems = prepare_problems(cfg)
    if problems:
        raise PrepareError(problems)
    files = input_files(cfg.input)
    tok = load_tokenizer_info(cfg.tokenizer, cfg.eos_token)
    settings = settings_of(cfg)
    dtype = token_dtype_for_vocab(tok.vocab_size)
    out_dir = Path(cfg.output).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    stamps = source_stamps(files)
    stats = [_SourceStats(stamp) for stamp in stamps]
    old = read_manifest(out_dir)
    shards: List[dict] = []
    position = (0, 0)
    if old is not None:
        if old.get("complete"):
            print(f"prepare: {out_dir} is already complete ({old['documents']:,} documents, {old['tokens']:,} tokens "
                  f"in {len(old['shards'])} shards); nothing to do.", flush=True)
            return old
        shards = list(old["shards"])
        position = (old["next"]["source"], old["next"]["record"])
        for st, saved in zip(stats, old["sources"]):
            st.documents, st.tokens, st.skipped = saved["documents"], saved["tokens"], saved["skipped"]
            st.first_skipped = saved.get("first_skipped", "")
        print(f"prepare: continuing {out_dir} after {len(shards)} complete shard(s), at "
              f"{_record_name(files[position[0]], position[1] + 1) if position[0] < len(files) else 'the end'} "
              f"of {files[min(position[0], len(files) - 1)]}", flush=True)
    _remove_leftovers(out_dir, len(shards))
    _write_manifest(out_dir, _manifest(tok, dtype, settings, stats, shards, position, False))

    workers = cfg.workers or available_cores()
    sizes = [s["size"] for s in stamps]
    bar = _Progress(sum(sizes), sum(sizes[: position[0]]), progress)
    skip = cfg.on_bad_record == "skip"
    encoders = _Encoders(workers, (tok.path, cfg.text_key, tok.prepend_ids, tok.append_ids, dtype.name))
    writer: Optional[_ShardWriter] = None
    try:
        for chunk, (ids, lengths, bad) in encoders.map(_chunks(files, sizes, cfg.text_key, position)):
            src = stats[chunk.source]
            offset = start = 0
            docs_before, tokens_before = src.documents, src.tokens
            for j, length in enumerate(lengths.tolist()):
                if length < 0:
                    where = f"{files[chunk.source]}: {_record_name(files[chunk.source], chunk.numbers[j])}"
                    if not skip:
                        raise PrepareError([f"{where}: {bad[j]}. Fix: correct or remove the record, or "
                                            f"prepare.on_bad_record=skip to skip bad records (counted per file "
                                            f"in {MANIFEST})."])
                    src.skipped += 1
                    src.first_skipped = src.first_skipped or f"{_record_name(files[chunk.source], chunk.numbers[j])}: {bad[j]}"
                    continue
                if writer is None:
                    writer = _ShardWriter(out_dir, len(shards), dtype)
                writer.add_document(length)
                offset += length
                src.documents += 1
                src.tokens += length
                if writer.tokens >= cfg.shard_tokens:
                    writer.write(ids[start:offset])
                    start = offset
                    shards.append(writer.finish())
                    writer = None
                    # The counts so far cover the records up to this document: a resumed run reads on after it.
                    position = (chunk.source, chunk.numbers[j])
                    _write_manifest(out_dir, _manifest(tok, dtype, settings, stats, shards, position, False))
                    bar.shard(shards[-1])
            if writer is not None:
                writer.write(ids[start:offset])
            bar.update(src.documents - docs_before, src.tokens - tokens_before, chunk.bytes_done)
        if writer is not None:
            shards.append(writer.finish())
            bar.shard(shards[-1])
            writer = None
    finally:
        encoders.close()
        bar.close()
        if writer is not None:
            writer.file.close()
            writer.tmp.unlink(missing_ok=True)
    position = (len(files), 0)
    manifest = _manifest(tok, dtype, settings, stats, shards, position, bool(shards))
    _write_manifest(out_dir, manifest)
    if not shards:
        raise PrepareError([f"prepare.input={cfg.input}: no documents in {len(files)} file(s) "
                            f"({manifest['skipped']:,} bad records skipped). Fix: check prepare.input and prepare.text_key."])
    _print_summary(manifest, out_dir, bar)
    return manifest


def _print_summary(manifest: dict, out_dir: Path, bar: _Progress) -> None:
    d, t = bar.rates()
    print(f"prepare: {out_dir}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}) "
          f"in {len(manifest['shards'])} shard(s); {manifest['skipped']:,} bad records skipped; this run "
          f"{d:,.0f} docs/s, {t:,.0f} tokens/s", flush=True)
    tok = manifest["tokenizer"]
    print(f"prepare: each document is {document_layout(tok['starts_with'], tok['ends_with'])} "
          f"(start ids {tok['start_ids']}, end ids {tok['end_ids']})", flush=True)
    for s in manifest["sources"]:
        if s["skipped"]:
            print(f"  skipped {s['skipped']:,} in {s['path']} (first: {s['first_skipped']})", flush=True)
    print(f"prepare: use it with data.path={out_dir}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m launcher.data.prepare RUN_DIR`: the prepare of RUN_DIR/config.yaml (a SLURM job runs this)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m launcher.data.prepare RUN_DIR (holding the config.yaml `train` wrote)", file=sys.stderr)
        return 2
    spec = load_spec(Path(args[0]))
    try:
        run_prepare(spec.prepare)
    except PrepareError as err:
        report_failure(err.problems)
        return 2
    return 0


def report_failure(problems: Sequence[str]) -> None:
    """Print why prepare stopped (one line per problem), as the CLI's config errors are printed."""
    print_problems("Prepare stopped", problems)


if __name__ == "__main__":
    sys.exit(main())
