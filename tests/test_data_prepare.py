"""`train action=prepare`: raw files -> Megatron indexed shards + manifest.json.

A corpus in every input format and a tokenizer are made here (nothing downloaded). The prepare
function runs in-process where the behaviour allows; the real `train` command only where the
CLI or a kill -9 is what is tested.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from launcher.config.schema import PrepareConfig
from launcher.data.indexed import IndexedDataset, dataset_prefixes
from launcher.data.prepare import MANIFEST, PrepareError, prepare_problems, run_prepare

from tests.conftest import TRAIN, train_env

WORDS = "the of and to in is was for on that with as by at from his her an are which be this or had not".split()


def _text(i: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(WORDS[k] for k in rng.integers(0, len(WORDS), 5 + i % 40)) + f" number {i}."


def make_tokenizer(folder: Path, add_bos: bool = True) -> Path:
    """A small byte-level BPE trained here, with a tokenizer_config.json naming EOS/BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_text(i) for i in range(500)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": {"content": "<s>"}, "add_bos_token": add_bos}))
    return folder


def make_corpus(folder: Path, per_file: int) -> List[str]:
    """One file per format (and a nested folder of .txt files); returns the documents in the
    order prepare must write them (files sorted by path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder.mkdir(parents=True, exist_ok=True)
    docs = [[_text(f * 100_000 + i) for i in range(per_file)] for f in range(4)]

    def lines(texts):
        return "".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(texts)).encode()

    (folder / "a.jsonl").write_bytes(lines(docs[0]))
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(lines(docs[1])))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(docs[2])))
    pq.write_table(pa.table({"text": docs[3], "n": list(range(per_file))}), folder / "d.parquet", row_group_size=97)
    (folder / "e").mkdir(exist_ok=True)
    txt = ["a whole file is one document.\nEven with several lines.\n", "second text file, ünïcode ✓"]
    (folder / "e" / "f.txt").write_text(txt[0], encoding="utf-8")
    (folder / "e" / "g.txt").write_text(txt[1], encoding="utf-8")
    (folder / "README.md").write_text("not an input format: ignored in a folder")
    return docs[0] + docs[1] + docs[2] + docs[3] + txt


def folder_bytes(folder: Path) -> Dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    tok = make_tokenizer(root / "tok")
    docs = make_corpus(root / "raw", 300)
    return root, tok, docs


def cfg(root: Path, tok: Path, out: str, **kw) -> PrepareConfig:
    kw.setdefault("input", str(root / "raw"))
    return PrepareConfig(output=str(root / out), tokenizer=str(tok), **kw)


def test_every_format_prepares_the_same_shards_with_1_and_3_workers(corpus):
    root, tok, docs = corpus
    one = run_prepare(cfg(root, tok, "w1", workers=1, shard_tokens=5000), progress=False)
    three = run_prepare(cfg(root, tok, "w3", workers=3, shard_tokens=5000), progress=False)
    assert folder_bytes(root / "w1") == folder_bytes(root / "w3")
    assert one == three and one["complete"] and len(one["shards"]) > 3

    # Token for token: [BOS] + the tokenizer's ids + [EOS] per document, in sorted file order.
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok / "tokenizer.json"))
    bos, eos = t.token_to_id("<s>"), t.token_to_id("<|endoftext|>")
    expected = [[bos] + t.encode(d, add_special_tokens=False).ids + [eos] for d in docs]
    got = []
    for prefix in dataset_prefixes(root / "w1"):
        ds = IndexedDataset(prefix)
        assert ds.dtype == np.uint16
        bounds = np.append(np.asarray(ds.sequence_pointers) // 2, ds.n_tokens)
        got += [ds.tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    assert got == expected
    assert one["documents"] == len(docs) and one["tokens"] == sum(map(len, expected))
    assert one["max_token_id"] == max(max(e) for e in expected) < one["tokenizer"]["vocab_size"]
    assert [Path(s["path"]).name for s in one["sources"]] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet",
                                                             "f.txt", "g.txt"]
    # Shards are about shard_tokens: only the last document may run over.
    for shard in one["shards"][:-1]:
        assert 5000 <= shard["tokens"] < 5000 + max(map(len, expected))
    assert one["tokenizer"]["add_bos"] and one["dtype"] == "uint16"

    # Run again: complete and unchanged, nothing is rewritten.
    before = folder_bytes(root / "w1")
    assert run_prepare(cfg(root, tok, "w1", workers=1, shard_tokens=5000), progress=False) == one
    assert folder_bytes(root / "w1") == before


def test_kill_9_mid_prepare_then_rerun_gives_the_uninterrupted_output(tmp_path, corpus, capsys):
    root, tok, _ = corpus
    raw = tmp_path / "raw"
    make_corpus(raw, 1200)
    reference = run_prepare(PrepareConfig(input=str(raw), output=str(tmp_path / "ref"), tokenizer=str(tok),
                                          workers=1, shard_tokens=2000), progress=False)
    out = tmp_path / "out"
    args = [TRAIN, "action=prepare", f"prepare.input={raw}", f"prepare.output={out}", f"prepare.tokenizer={tok}",
            "prepare.workers=2", "prepare.shard_tokens=2000", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=train_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # own group: cleanup
    deadline = time.monotonic() + 120
    listed = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            listed = len(json.loads((out / MANIFEST).read_text())["shards"])
        except (OSError, ValueError):
            listed = 0
        if listed:
            break
        time.sleep(0.02)
    assert listed and proc.poll() is None, proc.communicate()[0].decode()[-3000:]
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(workers) >= 2, workers  # the tokenizer processes
    os.kill(proc.pid, signal.SIGKILL)  # the command only: its workers must not outlive it
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
        time.sleep(0.05)
    alive = [w for w in workers if Path(f"/proc/{w}").exists()]
    if alive:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not alive, f"worker processes {alive} outlived the killed prepare"
    killed = json.loads((out / MANIFEST).read_text())
    assert not killed["complete"] and 0 < len(killed["shards"]) < len(reference["shards"])

    # The rerun (in this process, one worker: the killed run had two) continues after the listed shards.
    run_prepare(PrepareConfig(input=str(raw), output=str(out), tokenizer=str(tok), workers=1, shard_tokens=2000),
                progress=False)
    assert f"after {len(killed['shards'])} complete shard(s)" in capsys.readouterr().out
    assert folder_bytes(out) == folder_bytes(tmp_path / "ref")


def bad_corpus(folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    good = json.dumps({"text": "fine"}).encode()
    (folder / "a.jsonl").write_bytes(b"\n".join([
        good, b"{not json", json.dumps({"body": "no text key"}).encode(), b'{"text": "caf\xe9"}',
        json.dumps({"text": 42}).encode(), b"", good]) + b"\n")
    pq.write_table(pa.table({"text": ["ok", None, "ok again"]}), folder / "b.parquet")
    (folder / "c.txt").write_bytes(b"\xff\xfe not utf-8")


def test_bad_records_fail_naming_file_and_line_or_are_skipped_and_counted(tmp_path, corpus):
    _, tok, _ = corpus
    bad_corpus(tmp_path / "raw")
    with pytest.raises(PrepareError) as err:
        run_prepare(PrepareConfig(input=str(tmp_path / "raw"), output=str(tmp_path / "fail"), tokenizer=str(tok),
                                  workers=1), progress=False)
    (line,) = err.value.problems
    assert f"{tmp_path / 'raw' / 'a.jsonl'}: line 2: not JSON" in line and "prepare.on_bad_record=skip" in line

    manifest = run_prepare(PrepareConfig(input=str(tmp_path / "raw"), output=str(tmp_path / "skip"),
                                         tokenizer=str(tok), workers=1, on_bad_record="skip"), progress=False)
    by_name = {Path(s["path"]).name: s for s in manifest["sources"]}
    assert {n: (s["documents"], s["skipped"]) for n, s in by_name.items()} == {
        "a.jsonl": (2, 4), "b.parquet": (2, 1), "c.txt": (0, 1)}
    assert by_name["a.jsonl"]["first_skipped"].startswith("line 2: not JSON")
    assert by_name["b.parquet"]["first_skipped"] == "row 2: 'text' is null, not a string"
    assert manifest["skipped"] == 6 and manifest["documents"] == 4

    # The fix the failure gives works on the same output folder: it continues, and equals a fresh run.
    run_prepare(PrepareConfig(input=str(tmp_path / "raw"), output=str(tmp_path / "fail"), tokenizer=str(tok),
                              workers=1, on_bad_record="skip"), progress=False)
    assert folder_bytes(tmp_path / "fail") == folder_bytes(tmp_path / "skip")


def test_a_changed_input_or_tokenizer_is_refused_before_work(tmp_path, corpus):
    _, tok, _ = corpus
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    c = PrepareConfig(input=str(raw), output=str(tmp_path / "out"), tokenizer=str(tok), workers=1)
    run_prepare(c, progress=False)
    assert prepare_problems(c) == []
    other_tok = make_tokenizer(tmp_path / "tok2", add_bos=False)
    (problem,) = prepare_problems(PrepareConfig(input=c.input, output=c.output, tokenizer=str(other_tok)))
    # The same tokenizer.json without add_bos_token: documents would start differently.
    assert "documents written as <s> + text + <|endoftext|>" in problem and "now give text + <|endoftext|>" in problem
    assert "Fix: choose a new prepare.output" in problem
    (problem,) = prepare_problems(PrepareConfig(input=c.input, output=c.output, tokenizer=c.tokenizer, shard_tokens=7))
    assert "prepare.shard_tokens: 250000000 -> 7" in problem
    (raw / "a.jsonl").write_text(json.dumps({"text": "one, edited"}) + "\n")
    (problem,) = prepare_problems(c)
    assert "other input files" in problem and str(raw / "a.jsonl") in problem and "Fix:" in problem


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text("import atexit, sys\n"
                       "atexit.register(lambda: sys.stderr.write('TORCH_IMPORTED=%s\\n' % ('torch' in sys.modules)))\n"
                       "sys.argv = ['train'] + sys.argv[1:]\n"
                       "from launcher.cli import main\n"
                       "main()\n")
    return subprocess.run([sys.executable, str(wrapper), "action=prepare", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=train_env(tmp_path), capture_output=True, text=True, timeout=120)


def test_cli_bad_config_exits_2_with_one_fix_per_problem_and_no_torch(tmp_path):
    (tmp_path / "a_file").write_text("x")
    proc = _train(tmp_path, f"prepare.input={tmp_path}/nothing_*.jsonl", f"prepare.output={tmp_path / 'a_file'}",
                  f"prepare.tokenizer={tmp_path / 'missing'}", "prepare.workers=-1", "prepare.shard_tokens=0",
                  "prepare.on_bad_record=ignore",
                  # Training-side rules do not apply to action=prepare.
                  "data=tokens", f"data.path={tmp_path / 'will_be_prepared'}", "model.n_heads=3")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "TORCH_IMPORTED=False" in proc.stderr
    problems = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 6 and all("Fix:" in p for p in problems), proc.stderr
    for key in ("prepare.input", "prepare.output", "prepare.tokenizer", "prepare.workers", "prepare.shard_tokens",
                "prepare.on_bad_record"):
        assert any(key in p for p in problems), key
    assert not (tmp_path / "run").exists()


def test_cli_prepares_without_torch_and_a_bad_record_exits_2(tmp_path, corpus):
    root, tok, _ = corpus
    proc = _train(tmp_path, f"prepare.input={root / 'raw' / '*.jsonl*'}", f"prepare.output={tmp_path / 'out'}",
                  f"prepare.tokenizer={tok / 'tokenizer.json'}", "prepare.workers=1",
                  "prepare.eos_token='<s>'")  # a special token, quoted as Hydra needs (docs/data.md)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TORCH_IMPORTED=False" in proc.stderr and f"data.path={tmp_path / 'out'}" in proc.stdout
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["documents"] == 900 and manifest["tokenizer"]["ends_with"] == ["<s>"]
    assert "prepare: each document is <s> + text + <s>" in proc.stdout

    bad_corpus(tmp_path / "bad")
    proc = _train(tmp_path, f"prepare.input={tmp_path / 'bad'}", f"prepare.output={tmp_path / 'out_bad'}",
                  f"prepare.tokenizer={tok}", "prepare.workers=1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{tmp_path / 'bad' / 'a.jsonl'}: line 2: not JSON" in proc.stderr and "on_bad_record=skip" in proc.stderr


def test_slurm_renders_a_one_node_cpu_job_without_secrets(tmp_path, corpus, monkeypatch):
    root, tok, _ = corpus
    secret = "s3cr3t-prepare-8d1"
    monkeypatch.setenv("HF_TOKEN", secret)  # forwarded by name (cluster.secret_env), never written
    (tmp_path / "weird dir$x").mkdir()
    proc = _train(tmp_path, f"prepare.input={root / 'raw'}", f"prepare.output={tmp_path / 'weird dir$x' / 'out'}",
                  f"prepare.tokenizer={tok}", "prepare.workers=8", "cluster=slurm", "cluster.dry_run=true",
                  "cluster.partition=cpu")
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "run" / "prepare.sbatch").read_text()
    assert '#SBATCH --nodes="1"' in script and '#SBATCH --cpus-per-task="8"' in script
    assert "gpus" not in script and f"-m launcher.data.prepare {tmp_path / 'run'}" in script
    from launcher.config.loader import load_spec

    assert load_spec(tmp_path / "run").prepare.output == str(tmp_path / "weird dir$x" / "out")
    assert bash_syntax_ok(tmp_path / "run" / "prepare.sbatch")
    assert not any(secret in p.read_text(errors="ignore") for p in (tmp_path / "run").rglob("*") if p.is_file())


def bash_syntax_ok(path: Path) -> bool:
    return subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_bench_data_prepare_smoke_prints_the_ratio_line(tmp_path):
    """bench/data_prepare.py on a tiny corpus: it runs and both sides count the same tokens. No
    timing assertion: R is a benchmark result (docs/benchmarks.md)."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "bench" / "data_prepare.py"), "--mb", "0.2", "--rounds", "1",
                           "--vocab", "400", "--workers", "2", "--files", "3", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300, env=train_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "prepare / library tokens/s ratio" in proc.stdout.splitlines()[-1]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["tokens"] > 0 and result["rounds"]["prepare"][0]["tokens"] == result["tokens"]


def test_a_vocabulary_over_65500_writes_int32_and_a_tokenizer_without_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))  # no tokenizer_config.json: EOS found by its usual name
    (tmp_path / "doc.txt").write_text("w69999 w1 w65535")
    manifest = run_prepare(PrepareConfig(input=str(tmp_path / "doc.txt"), output=str(tmp_path / "out"),
                                         tokenizer=str(tmp_path / "big.json"), workers=1), progress=False)
    ds = IndexedDataset(tmp_path / "out" / "shard_00000")
    assert manifest["dtype"] == "int32" and ds.dtype == np.int32
    assert ds.tokens.tolist() == [69999, 1, 65535, 70000] and manifest["max_token_id"] == 70000

    del vocab["<|endoftext|>"]
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "no_eos.json"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.md").write_text("not ours")
    problems = prepare_problems(PrepareConfig(input=str(tmp_path / "doc.txt"), output=str(tmp_path / "elsewhere"),
                                              tokenizer=str(tmp_path / "no_eos.json")))
    assert len(problems) == 1 and "end-of-document id" in problems[0] and "Fix:" in problems[0]
    problems = prepare_problems(PrepareConfig(input=str(tmp_path / "doc.txt"), output=str(tmp_path / "elsewhere"),
                                              tokenizer=str(tmp_path / "big.json")))
    assert len(problems) == 1 and "other files (notes.md)" in problems[0] and "Fix:" in problems[0]


# The special tokens of each family's tokenizer.json and tokenizer_config.json, as released.
LLAMA3 = {"specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], "template": ["<|begin_of_text|>"],
          "config": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                     "eos_token": "<|end_of_text|>"}}
# Qwen's tokenizer.json splits with this pattern before its byte-level step (transformers'
# Qwen2Tokenizer builds the same, whatever the file says).
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN3 = {"specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "template": None, "split": QWEN_SPLIT,
         "config": {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>", "add_bos_token": False}}
DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK = {"specials": [DS_BOS, DS_EOS], "template": [DS_BOS],
            "config": {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
                       "bos_token": {"__type": "AddedToken", "content": DS_BOS},
                       "eos_token": {"__type": "AddedToken", "content": DS_EOS}}}


def make_family_tokenizer(folder: Path, family: dict, template: object = "as released") -> Path:
    """A tiny byte-level BPE with `family`'s special tokens, post-processor and config; `template`
    replaces the post-processor's single-text template (None: a ByteLevel post-processor that adds none;
    ["<s>", "$A", "</s>"]-style lists name the tokens around $A)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    template = family["template"] if template == "as released" else template
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if "split" in family:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(family["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_text(i) for i in range(200)],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=family["specials"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    steps = [processors.ByteLevel(trim_offsets=False)]
    if template is not None:
        single = " ".join(t if t == "$A" else f"{t}:0" for t in (template if "$A" in template else [*template, "$A"]))
        specials = [(t, tok.token_to_id(t)) for t in dict.fromkeys(template) if t != "$A"]
        steps.append(processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=specials))
    tok.post_processor = processors.Sequence(steps)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(family["config"]))
    return folder


def prepared_documents(folder: Path) -> List[List[int]]:
    docs = []
    for prefix in dataset_prefixes(folder):
        ds = IndexedDataset(prefix)
        bounds = np.append(np.asarray(ds.sequence_pointers) // ds.dtype.itemsize, ds.n_tokens)
        docs += [ds.tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    return docs


def test_documents_are_encoded_as_transformers_encodes_them_then_eos(tmp_path, capsys):
    """Llama 3 (BOS from the post-processor), Qwen3 (no BOS; an instruct config's EOS replaced by
    prepare.eos_token), DeepSeek-V3 (add_bos_token and a post-processor that both add BOS: one BOS):
    each document is transformers' tokenizer(text)["input_ids"] + EOS. Then the rules where
    post-processor and config disagree: add_bos_token adds BOS the post-processor did not, and an
    EOS the post-processor adds is not added twice."""
    from transformers import AutoTokenizer

    texts = [_text(i) for i in range(40)] + ["", "a text that ends in <|endoftext|>"]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cases = [  # name, family, post-processor template, prepare.eos_token, ids prepare adds around transformers'
        ("llama3", LLAMA3, "as released", "", ([], ["<|end_of_text|>"])),
        ("qwen3_instruct", QWEN3, "as released", "", ([], ["<|im_end|>"])),
        ("qwen3_pretrain", QWEN3, "as released", "<|endoftext|>", ([], ["<|endoftext|>"])),
        ("deepseek_v3", DEEPSEEK, "as released", "", ([], [DS_EOS])),
        ("bos_by_config_only", DEEPSEEK, None, "", ([DS_BOS], [DS_EOS])),
        ("eos_by_template", LLAMA3, ["<|begin_of_text|>", "$A", "<|end_of_text|>"], "", ([], [])),
    ]
    for name, family, template, eos_token, (before, after) in cases:
        folder = make_family_tokenizer(tmp_path / f"tok_{name}", family, template)
        hf = AutoTokenizer.from_pretrained(str(folder))
        manifest = run_prepare(PrepareConfig(input=str(tmp_path / "raw.jsonl"), output=str(tmp_path / name),
                                             tokenizer=str(folder), eos_token=eos_token, workers=1), progress=False)
        ids = hf.convert_tokens_to_ids
        expected = [ids(before) + hf(t)["input_ids"] + ids(after) for t in texts]
        assert prepared_documents(tmp_path / name) == expected, name
        first, last = expected[0], expected[0]
        tok = manifest["tokenizer"]
        n_start = len(tok["start_ids"])
        assert tok["start_ids"] == first[:n_start] and tok["end_ids"] == last[len(last) - len(tok["end_ids"]):]
        assert tok["starts_with"] == hf.convert_ids_to_tokens(tok["start_ids"]), name
        assert tok["ends_with"] == hf.convert_ids_to_tokens(tok["end_ids"]), name
        assert tok["ends_with"][-1] == (eos_token or _token_content(family["config"]["eos_token"])), name
        layout = " + ".join([*tok["starts_with"], "text", *tok["ends_with"]])
        assert f"prepare: each document is {layout}" in capsys.readouterr().out, name
    assert layout == "<|begin_of_text|> + text + <|end_of_text|>"

    # The same folder with another end-of-document token is another dataset: refused before work.
    qwen = str(tmp_path / "tok_qwen3_instruct")
    (problem,) = prepare_problems(PrepareConfig(input=str(tmp_path / "raw.jsonl"), output=str(tmp_path / "qwen3_instruct"),
                                                tokenizer=qwen, eos_token="<|endoftext|>"))
    assert "text + <|im_end|>" in problem and "now give text + <|endoftext|>" in problem and "Fix:" in problem
    (problem,) = prepare_problems(PrepareConfig(input=str(tmp_path / "raw.jsonl"), output=str(tmp_path / "new"),
                                                tokenizer=qwen, eos_token="</s>"))
    assert "prepare.eos_token='</s>' is not a token" in problem and "<|im_end|>" in problem and "Fix:" in problem


def _token_content(value: object) -> str:
    return value["content"] if isinstance(value, dict) else value  # type: ignore[index]
