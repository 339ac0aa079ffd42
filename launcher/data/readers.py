"""The raw formats `action=prepare` reads: which files an input names, and their records in order.

Formats, by file name: `.jsonl` (one JSON object per line), `.jsonl.gz` (gzip), `.jsonl.zst`
(zstandard), `.parquet` (pyarrow; one column holds the text) and `.txt` (the whole file is one
document). The libraries do the parsing; this module only walks files and hands each record on
undecoded where decoding can fail (a JSON line, a text file's bytes), so that the tokenizer
processes do that work and a bad record is reported with its file and line.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Tuple

import zstandard

FORMATS = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".txt")

# Record kinds handed to the tokenizer processes.
JSON_LINE = 0  # payload: the line's bytes (decoded and parsed by the worker)
TEXT_BYTES = 1  # payload: a .txt file's bytes (one document)
VALUE = 2  # payload: a parquet cell as pyarrow gives it (a str, or None / another type: a bad record)

PARQUET_BATCH_ROWS = 4096


def file_format(path: Path) -> str:
    """The format suffix of `path` ('.jsonl', '.jsonl.gz', ...) or '' for a file prepare does not read."""
    name = path.name.lower()
    for suffix in FORMATS:
        if name.endswith(suffix):
            return suffix
    return ""


def input_files(pattern: str) -> List[Path]:
    """The files prepare.input names, sorted by path (a deterministic order).

    A file is taken as it is (its format must be known); a folder is searched recursively and a
    glob expanded (`**` included), keeping files of a known format. Raises ValueError with the
    problem and a fix when nothing readable is named.
    """
    if not pattern:
        raise ValueError("prepare.input is empty. Fix: prepare.input=/path/to/file, folder or 'glob/*.jsonl'.")
    path = Path(pattern).expanduser()
    if path.is_file():
        if not file_format(path):
            raise ValueError(f"prepare.input={pattern} is not a format prepare reads (known: {', '.join(FORMATS)}). "
                             f"Fix: convert it, or rename it if it is one of them.")
        return [path.resolve()]
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file()]
        where = f"the folder prepare.input={pattern}"
    elif glob.has_magic(pattern):
        candidates = [Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        where = f"the glob prepare.input={pattern!r}"
    else:
        raise ValueError(f"prepare.input={pattern} does not exist. Fix: give an existing file, folder or glob.")
    files = sorted({p.resolve() for p in candidates if file_format(p)}, key=str)
    if not files:
        raise ValueError(f"{where} has no {', '.join(FORMATS)} files ({len(candidates)} other files). "
                         f"Fix: point prepare.input at your corpus.")
    return files


@dataclass
class SourceReader:
    """The records of one file, from record number `start` on, with how far into the file it is."""

    path: Path
    text_key: str
    start: int = 0  # records (lines, rows) already consumed by an earlier run
    bytes_read: int = 0  # position in the file on disk (compressed bytes for .gz/.zst): progress

    def records(self) -> Iterator[Tuple[int, int, object]]:
        """(record number from 1, kind, payload) for every record after `start`. Blank lines are
        not records but keep their line numbers."""
        fmt = file_format(self.path)
        if fmt == ".parquet":
            yield from self._parquet()
        elif fmt == ".txt":
            if self.start < 1:
                data = self.path.read_bytes()
                self.bytes_read = len(data)
                yield 1, TEXT_BYTES, data
        else:
            yield from self._json_lines(fmt)

    def _json_lines(self, fmt: str) -> Iterator[Tuple[int, int, object]]:
        with open(self.path, "rb") as raw:
            if fmt == ".jsonl.gz":
                stream = gzip.GzipFile(fileobj=raw, mode="rb")
            elif fmt == ".jsonl.zst":
                stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
            else:
                stream = raw
            for number, line in enumerate(stream, 1):
                if number <= self.start:
                    continue
                if number % 256 == 0:
                    self.bytes_read = raw.tell()
                if line.strip():  # a blank line is no record (its number still counts)
                    yield number, JSON_LINE, line
            self.bytes_read = raw.tell()

    def _parquet(self) -> Iterator[Tuple[int, int, object]]:
        import pyarrow.parquet as pq  # lazy: pyarrow takes ~0.25 s to import; only .parquet input needs it

        pf = pq.ParquetFile(self.path)
        rows = max(1, pf.metadata.num_rows)
        size = self.path.stat().st_size
        number = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[self.text_key]):
            if number + batch.num_rows <= self.start:
                number += batch.num_rows
                continue
            for value in batch.column(0).to_pylist():
                number += 1
                if number > self.start:
                    yield number, VALUE, value
            self.bytes_read = size * number // rows
        self.bytes_read = size


def parquet_schema_problem(path: Path, text_key: str) -> str:
    """Why `path` (a parquet file) cannot give prepare.text_key ('' when it can): read from the footer only."""
    import pyarrow as pa  # lazy: pyarrow takes ~0.25 s to import; only .parquet input needs it
    import pyarrow.parquet as pq  # lazy: pyarrow takes ~0.25 s to import; only .parquet input needs it

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as err:
        return f"{path}: not a readable parquet file ({str(err).strip().splitlines()[0]}). Fix: re-write or remove it."
    if text_key not in schema.names:
        return (f"{path}: no column {text_key!r} (columns: {', '.join(schema.names[:12])}). "
                f"Fix: prepare.text_key=<the text column>.")
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return (f"{path}: column {text_key!r} is {kind}, not a string column. Fix: prepare.text_key=<the text column>.")
    return ""
