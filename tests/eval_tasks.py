"""Local lm-eval tasks and a word-level tokenizer for the downstream-evaluation tests (no network).

Written by the tests that evaluate (tests/test_eval_loop.py, tests/test_deepspeed_runtime.py,
tests/test_train_e2e.py): a multiple-choice task (tiny_mc: acc, acc_norm), a perplexity task
(tiny_ppl: loglikelihood_rolling) and a cloze task (tiny_cloze: output_type loglikelihood with
lm-eval's `acc`, which is is_greedy, and `perplexity`). The tokenizer holds exactly the model's
vocabulary (words, then filler words up to `vocab` ids), and tiny_cloze asks, after each of its
contexts, every word as the continuation: at most one of them is the model's greedy token, so its
acc is (contexts whose argmax is a word) / documents, whatever the weights.

`hflm_reference` scores tasks with lm-eval's own HF backend (HFLM) on an HF folder, through the
same task building and `evaluate` call as the training loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

WORDS = ("the a cat dog bird fish sat ran flew swam on in under over mat tree sky sea red blue green big small "
         "is was it what where who question answer yes no and or with to from of at by").split()
PUNCT = [":", "?", "."]
SPECIAL = ["[UNK]", "<s>", "</s>"]

MC_DOCS = [
    {"question": "Question: where is the cat ?", "choices": ["on the mat", "in the sky", "under the sea"], "label": 0},
    {"question": "Question: what flew over the tree ?", "choices": ["a fish", "a bird", "the dog"], "label": 1},
    {"question": "Question: who swam in the sea ?", "choices": ["the red fish", "a big tree", "the blue sky", "no"],
     "label": 0},
    {"question": "Question: is it a dog ?", "choices": ["yes", "no"], "label": 1},
    {"question": "Question: what sat on the mat ?", "choices": ["the small cat", "the green sea"], "label": 0},
]
# One text longer than seq_len + 1 tokens: lm-eval's rolling windows, several rows per document.
PPL_DOCS = [{"text": "the cat sat on the mat and the dog ran under the tree ."},
            {"text": " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(70)) + " ."},
            {"text": "a big blue bird flew over the green sea ."}]
CLOZE_CONTEXTS = ("the cat sat on the", "a big blue bird flew over")

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_YAML = """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
# LAMBADA's shape: a context, one continuation (its leading space in the target, as LAMBADA's
# YAML: lm-eval puts no delimiter between them), acc = is_greedy and perplexity.
CLOZE_YAML = """task: tiny_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + word}}}}"
metric_list:
  - metric: acc
  - metric: perplexity
"""
TASKS = ("tiny_mc", "tiny_ppl", "tiny_cloze")


def vocabulary(vocab: int) -> List[str]:
    """The tokenizer's tokens by id: the special tokens, WORDS, PUNCT, then fillers w<i> up to `vocab`."""
    words = SPECIAL + WORDS + PUNCT
    if vocab < len(words):
        raise ValueError(f"vocab {vocab} < the {len(words)} tokens the tasks use")
    return words + [f"w{i}" for i in range(vocab - len(words))]


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level HF tokenizer folder of exactly `vocab` ids (tokenizer.json + tokenizer_config.json
    with <s> and </s>), so every id the model can predict is a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary(vocab))}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="[UNK]").save_pretrained(str(folder))


def cloze_docs(vocab: int) -> List[Dict[str, str]]:
    """Every non-special token as the continuation of each CLOZE_CONTEXTS context."""
    return [{"context": c, "word": w} for c in CLOZE_CONTEXTS for w in vocabulary(vocab)[len(SPECIAL):]]


def one_context_limit(vocab: int) -> int:
    """eval.limit that keeps tiny_cloze to its first context (tiny_mc and tiny_ppl stay whole)."""
    return vocab - len(SPECIAL)


def write_tasks(folder: Path, vocab: int) -> Path:
    """tiny_mc, tiny_ppl and tiny_cloze (JSONL + task YAML) in `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs, yaml in (("tiny_mc", MC_DOCS, MC_YAML), ("tiny_ppl", PPL_DOCS, PPL_YAML),
                             ("tiny_cloze", cloze_docs(vocab), CLOZE_YAML)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(yaml.format(data=data))
    return folder


def hflm_reference(folder: Path, tokenizer: Path, tasks: Path, max_length: int, names: Sequence[str] = TASKS,
                   num_fewshot: int = 0, limit: int = 0) -> Dict[str, float]:
    """lm-eval's own HF backend on `folder` (fp32), through the same task building and evaluate call."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.eval.loop import evaluate_tasks, metric_rows
    from launcher.eval.tasks import load_tasks, set_offline_env

    set_offline_env()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(str(tokenizer)), max_length=max_length,
              batch_size=16, device="cpu")
    return metric_rows(evaluate_tasks(lm, load_tasks(list(names), [str(tasks)], num_fewshot), limit))


def assert_scores_equal(ours: Dict[str, float], theirs: Dict[str, float], names: Sequence[str] = TASKS,
                        some_greedy: bool = True) -> None:
    """acc / acc_norm exactly, log-likelihood metrics within 1e-4 relative (fp32); with some_greedy,
    tiny_cloze's acc is not trivially 0 (some context's argmax is a word)."""
    import math

    exact = [k for k in ("eval/tiny_mc/acc", "eval/tiny_mc/acc_norm", "eval/tiny_cloze/acc")
             if k.split("/")[1] in names]
    close = [k for k in ("eval/tiny_ppl/bits_per_byte", "eval/tiny_ppl/word_perplexity",
                         "eval/tiny_ppl/byte_perplexity", "eval/tiny_cloze/perplexity") if k.split("/")[1] in names]
    for key in exact:
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    for key in close:
        assert math.isclose(ours[key], theirs[key], rel_tol=1e-4), (key, ours[key], theirs[key])
    if some_greedy and "tiny_cloze" in names:
        assert ours["eval/tiny_cloze/acc"] > 0, "no cloze continuation was greedy: is_greedy not exercised"
