"""Index a 15T-token, 3-source mixture and load its first step on a 2,048-GPU layout.

    .venv/bin/python bench/data_index.py [--dir /tmp] [--ranks 0,1023,2047] [--keep]

Writes three sources of 5T tokens each (uint16, two shards of 2.5T tokens per source, 4.5 TiB
per .bin). The .bin files are sparse (truncated to size: no disk is used, they read as zeros);
the .idx files are real, declaring few, very long documents (2^30 tokens each, about 2,300 per
shard), with a manifest like `train action=prepare` writes. Then, for each representative
data-parallel rank, a fresh process does what a rank does before step 1 with data=indexed, a
0.5/0.3/0.2 mix and document masking plus position reset: check every shard's index (as
`action=plan` does), open the sources, build the samplers, assign the first global batch
(4,096 samples of 8,192 tokens: 2,048 data-parallel ranks x micro-batch 1 x 2 accumulation
steps) to sources and take the rank's slice with document ids and positions.

Reported per rank: set-up seconds (opening to first batches; interpreter and torch import not
counted, as they do not depend on the data), the process's peak RSS growth over that set-up
(what the data side costs) and its peak RSS in all (with torch). Targets: set-up < 10 s,
host memory per rank < 256 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

SOURCES = (("web", 0.5), ("code", 0.3), ("math", 0.2))
TOKENS_PER_SOURCE = 5 * 10**12
SHARDS_PER_SOURCE = 2
DOC_TOKENS = 2**30
SEQ_LEN = 8192
DP = 2048
MICRO = 1
ACCUM = 2


def write_sparse_corpus(root: Path) -> None:
    """Three sources of sparse shards with real indexes and manifests."""
    import numpy as np

    from launcher.data.indexed import write_index

    per_shard = TOKENS_PER_SOURCE // SHARDS_PER_SOURCE
    for name, _ in SOURCES:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        shards = []
        for i in range(SHARDS_PER_SOURCE):
            prefix = folder / f"shard_{i:05d}"
            with open(f"{prefix}.bin", "wb") as f:
                f.truncate(per_shard * 2)  # uint16 tokens; a hole reads as zeros
            lengths = np.full(per_shard // DOC_TOKENS, DOC_TOKENS, dtype=np.int64)
            lengths[-1] += per_shard - int(lengths.sum())
            write_index(Path(f"{prefix}.idx"), np.uint16, lengths)
            shards.append({"name": prefix.name, "documents": len(lengths), "tokens": per_shard, "dtype": "uint16",
                           "bin_sha256": "", "idx_sha256": ""})
        (folder / "manifest.json").write_text(json.dumps({
            "format": "launcher-indexed", "version": 1, "dtype": "uint16",
            "tokenizer": {"path": "tokenizer.json", "sha256": "bench", "vocab_size": 32000, "eos_id": 0, "bos_id": None},
            "max_token_id": 31999, "documents": sum(s["documents"] for s in shards), "tokens": TOKENS_PER_SOURCE,
            "skipped": 0, "shards": shards, "sources": [], "complete": True}))


def one_rank(root: Path, dp_rank: int) -> dict:
    """A rank's data set-up in this process (run in a fresh one per rank)."""
    import resource

    import torch  # noqa: F401  (a rank has it loaded before its data; not counted)

    from launcher.config.schema import DataConfig, MixSourceConfig
    from launcher.data.checks import data_sources
    from launcher.data.corpus import corpus_info
    from launcher.data.dataset import BatchSlice, data_step_batches

    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    cfg = DataConfig(source="indexed", mix=[MixSourceConfig(str(root / n), w, n) for n, w in SOURCES],
                     document_masking=True, reset_positions=True)
    shards = sum(len(corpus_info(s.path).shards) for s in data_sources(cfg))  # the pre-launch check
    batches = data_step_batches(cfg, seq_len=SEQ_LEN, seed=1234, global_batch_size=DP * MICRO * ACCUM,
                                part=BatchSlice(dp_rank, DP, MICRO, ACCUM), vocab_size=32000,
                                cache_dir=root / "cache")
    mbs = batches.for_step(1)
    setup_s = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert len(mbs) == ACCUM and tuple(mbs[0].inputs.shape) == (MICRO, SEQ_LEN)
    assert mbs[0].document_ids is not None and mbs[0].positions is not None and mbs[0].sources is not None
    windows = sum(w.n_windows for w in batches.sources)
    return {"dp_rank": dp_rank, "setup_s": setup_s, "rss_growth_mb": (peak_kb - base_kb) / 1024,
            "peak_rss_mb": peak_kb / 1024, "shards": shards, "windows": windows,
            "tokens": sum(corpus_info(s.path).tokens for s in data_sources(cfg)),
            "sources_of_rows": [int(s) for mb in mbs for s in mb.sources]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write the sparse corpus (default: a temp folder)")
    parser.add_argument("--ranks", default="0,1023,2047", help="data-parallel ranks to load, comma-separated")
    parser.add_argument("--keep", action="store_true", help="keep the corpus folder")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # internal: one rank
    args = parser.parse_args(argv)
    if args.rank is not None:
        print(json.dumps(one_rank(Path(args.dir), args.rank)))
        return 0
    root = Path(tempfile.mkdtemp(prefix="data_index_", dir=args.dir))
    try:
        t0 = time.perf_counter()
        write_sparse_corpus(root)
        print(f"wrote a sparse {len(SOURCES) * TOKENS_PER_SOURCE / 1e12:.0f}T-token corpus "
              f"({len(SOURCES)} sources x {SHARDS_PER_SOURCE} shards) in {time.perf_counter() - t0:.1f} s: {root}")
        worst = {"setup_s": 0.0, "rss_growth_mb": 0.0, "peak_rss_mb": 0.0}
        for rank in [int(r) for r in args.ranks.split(",")]:
            proc = subprocess.run([sys.executable, __file__, "--dir", str(root), "--rank", str(rank)],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode:
                sys.stderr.write(proc.stderr)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"dp rank {r['dp_rank']:>4}: set-up {r['setup_s']:.2f} s, data RSS growth {r['rss_growth_mb']:.1f} MB, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB (with torch); {r['tokens'] / 1e12:.1f}T tokens, "
                  f"{r['shards']} shards, {r['windows']:,} windows; row sources {r['sources_of_rows']}")
            for key in worst:
                worst[key] = max(worst[key], r[key])
        ok = worst["setup_s"] < 10 and worst["rss_growth_mb"] < 256
        print(f"worst: set-up {worst['setup_s']:.2f} s (target < 10), data RSS growth {worst['rss_growth_mb']:.1f} MB "
              f"(target < 256), peak RSS {worst['peak_rss_mb']:.0f} MB: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
