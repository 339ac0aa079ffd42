"""`train action=prepare` tokens/s vs the `tokenizers` library's own batch encoding, same text, same cores.

    .venv/bin/python bench/data_prepare.py [--mb 32] [--workers 0] [--rounds 3] [--tokenizer PATH]

Makes a JSON-lines corpus (`--mb` MB of English-like text in `--files` files, documents of 200 to
6,000 characters) and, unless `--tokenizer` names a local tokenizer.json or Hugging Face folder,
trains a byte-level BPE of `--vocab` tokens on a sample of it. Then, in alternating rounds so that
machine load hits both alike:

- library: the texts already in memory, `Tokenizer.encode_batch_fast` and `encode_batch` (the
  library's batch encoders, Rust threads on every core this process may use); the faster of the
  two is the reference;
- prepare: `launcher.data.prepare.run_prepare` with `prepare.workers=--workers` (0: every core)
  into a fresh folder: reading and decompressing nothing (plain .jsonl), JSON parsing, tokenizing,
  EOS, shard and index writing, hashing, manifest, worker start-up: the whole command minus Hydra.

Tokens counted on both sides are the tokenizer's ids (prepare's added EOS not counted). A side's
figure is the median over its rounds. Each round also prints both sides' CPU seconds (this process's
threads plus prepare's reaped workers) and the paired wall-time ratio of the round; on a shared,
busy machine these disturb less than the rates. The last line is `prepare / library tokens/s
ratio R` (target >= 0.7, issue 26).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from launcher.config.schema import PrepareConfig  # noqa: E402
from launcher.data.prepare import available_cores, run_prepare  # noqa: E402

SYLLABLES = ("ka ri to na mi ve lo su ten par ing ed er al on st th re an de co pro ex ment tion ly ful "
             "ness able pre un dis ver com per").split()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=32, help="corpus size in MB of text")
    p.add_argument("--files", type=int, default=8, help=".jsonl files the corpus is split into")
    p.add_argument("--workers", type=int, default=0, help="prepare.workers (0: every core)")
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per side")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the BPE trained here")
    p.add_argument("--tokenizer", default="", help="a local tokenizer.json / HF folder instead of training one")
    p.add_argument("--workdir", type=Path, help="where the corpus and outputs go (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def make_texts(total_bytes: int, seed: int = 0) -> List[str]:
    """English-like documents: words of 1-4 syllables from a Zipf-ish vocabulary, punctuation, numbers."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, int(rng.integers(1, 5)))) for _ in range(20000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    texts, size = [], 0
    while size < total_bytes:
        n = int(rng.integers(40, 1000))
        picks = rng.choice(len(words), n, p=weights)
        sentence = " ".join(words[i] for i in picks)
        text = sentence.replace(words[picks[0]], words[picks[0]].capitalize(), 1) + f". See {int(rng.integers(1, 9999))}."
        texts.append(text)
        size += len(text)
    return texts


def train_tokenizer(texts: Sequence[str], vocab: int, folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts[: max(1, len(texts) // 10)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its reaped children (prepare's workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def time_library(tokenizer_file: Path, texts: List[str]) -> dict:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    tok = Tokenizer.from_file(str(tokenizer_file))
    best = None
    for name in ("encode_batch_fast", "encode_batch"):
        if not hasattr(tok, name):
            continue
        t0, c0 = time.perf_counter(), cpu_seconds()
        encodings = getattr(tok, name)(texts, add_special_tokens=False)
        dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        tokens = sum(len(e.ids) for e in encodings)
        if best is None or dt < best["seconds"]:
            best = {"encoder": name, "seconds": dt, "cpu_seconds": cpu, "tokens": tokens}
    return best


def time_prepare(raw: Path, tokenizer: str, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    manifest = run_prepare(PrepareConfig(input=str(raw), output=str(out), tokenizer=tokenizer, workers=workers),
                           progress=False)
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    added = len(manifest["tokenizer"]["start_ids"]) + len(manifest["tokenizer"]["end_ids"])
    return {"seconds": dt, "cpu_seconds": cpu, "tokens": manifest["tokens"] - added * manifest["documents"],
            "documents": manifest["documents"]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    work.mkdir(parents=True, exist_ok=True)
    texts = make_texts(int(args.mb * 1e6))
    raw = work / "raw"
    raw.mkdir(exist_ok=True)
    per_file = -(-len(texts) // args.files)
    for f in range(args.files):
        with open(raw / f"part_{f:03d}.jsonl", "w") as fh:
            for t in texts[f * per_file:(f + 1) * per_file]:
                fh.write(json.dumps({"text": t}) + "\n")
    tokenizer = args.tokenizer or str(train_tokenizer(texts, args.vocab, work / "tokenizer"))
    from launcher.data.tokenizer import tokenizer_file

    tok_file = tokenizer_file(tokenizer)
    cores = available_cores()
    workers = args.workers or cores
    print(f"corpus: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} MB in {args.files} .jsonl files; "
          f"tokenizer {tok_file}; {cores} cores; prepare.workers={workers}", flush=True)
    # Prepare runs in worker processes (prepare.workers): the library side's threads are not yet
    # started when prepare forks nothing (spawn), and the library's own pool is per process.
    lib, prep = [], []
    for r in range(args.rounds):
        lib.append(time_library(tok_file, texts))
        prep.append(time_prepare(raw, tokenizer, work / "out", args.workers))
        print(f"round {r + 1}: library {lib[-1]['encoder']} {lib[-1]['tokens'] / lib[-1]['seconds']:,.0f} tokens/s "
              f"({lib[-1]['seconds']:.2f} s, {lib[-1]['cpu_seconds']:.2f} CPU s); prepare "
              f"{prep[-1]['tokens'] / prep[-1]['seconds']:,.0f} tokens/s ({prep[-1]['seconds']:.2f} s, "
              f"{prep[-1]['cpu_seconds']:.2f} CPU s); this round's ratio "
              f"{lib[-1]['seconds'] / prep[-1]['seconds']:.3f}", flush=True)
    assert all(p["tokens"] == lib[0]["tokens"] for p in prep), "prepare and the library counted different tokens"
    lib_rate = statistics.median(x["tokens"] / x["seconds"] for x in lib)
    prep_rate = statistics.median(x["tokens"] / x["seconds"] for x in prep)
    ratio = prep_rate / lib_rate
    # CPU time per token: what a busy machine disturbs least (both sides' waiting is left out).
    cpu_ratio = statistics.median(x["cpu_seconds"] for x in lib) / statistics.median(x["cpu_seconds"] for x in prep)
    result = {"documents": len(texts), "mb": sum(map(len, texts)) / 1e6, "tokens": lib[0]["tokens"], "cores": cores,
              "workers": workers, "library_tokens_per_s": lib_rate, "prepare_tokens_per_s": prep_rate,
              "ratio": ratio, "cpu_ratio": cpu_ratio,
              "rounds": {"library": lib, "prepare": prep}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"library (tokenizers {lib[0]['encoder']}, {cores} threads): {lib_rate:,.0f} tokens/s; "
          f"prepare ({workers} workers, whole command minus Hydra): {prep_rate:,.0f} tokens/s")
    print(f"library / prepare CPU seconds (same tokens): {cpu_ratio:.3f}")
    print(f"prepare / library tokens/s ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
