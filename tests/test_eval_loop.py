"""Downstream evaluation in the loop (eval.*): lm-eval's tasks on the live sharded model.

A tiny random Llama folder (transformers' own classes) with a word-level tokenizer, a local
multiple-choice task and a local perplexity task (JSONL + task YAML, no network) are written
here. A 2-rank FSDP `train` run with eval.every logs eval/<task>/<metric> at the evaluated step;
the same numbers come from lm-eval's own HF backend (HFLM) on the run's fp32 HF export of the
weights it evaluated: acc and acc_norm exactly, log-likelihood metrics within 1e-4 relative.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, run_train
from launcher.config.loader import compose_spec
from launcher.data.eval_inputs import eval_input_problems
from launcher.plan.decide.resolve import validate

WORDS = ("the a cat dog bird fish sat ran flew swam on in under over mat tree sky sea red blue green big small "
         "is was it what where who question answer yes no and or with to from of at by").split()
PUNCT = [":", "?", "."]
SEQ = 32

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


def write_tokenizer(folder: Path) -> None:
    """A word-level HF tokenizer folder (tokenizer.json + tokenizer_config.json with <s> and </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS + PUNCT)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="[UNK]").save_pretrained(str(folder))


@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory):
    """(HF model folder with its tokenizer, task folder): a tiny random Llama and two local tasks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    model = root / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False)).save_pretrained(model)
    write_tokenizer(model)
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs, yaml in (("tiny_mc", MC_DOCS, MC_YAML), ("tiny_ppl", PPL_DOCS, PPL_YAML)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    return model, tasks


def hflm_reference(folder: Path, tokenizer: Path, tasks: Path) -> dict:
    """lm-eval's own HF backend on `folder` (fp32), through the same task building and evaluate call."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.eval.loop import evaluate_tasks, metric_rows
    from launcher.eval.tasks import load_tasks, set_offline_env

    set_offline_env()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(str(tokenizer)), max_length=SEQ,
              batch_size=4, device="cpu")
    return metric_rows(evaluate_tasks(lm, load_tasks(["tiny_mc", "tiny_ppl"], [str(tasks)], 0), 0))


@pytest.mark.multiprocess
def test_in_loop_scores_equal_lm_evals_hf_backend(eval_inputs, tmp_path):
    model, tasks = eval_inputs
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS[(i * 5) % len(WORDS)] for i in range(3000)))
    run = tmp_path / "run"
    run_train(["model=hf", f"model.init_from={model}", "data=text", f"data.path={corpus}", "trainer.steps=2",
               f"trainer.seq_len={SEQ}", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
               "precision=fp32", "cluster.gpus_per_node=2", "eval.tasks=[tiny_mc,tiny_ppl]", "eval.every=2",
               f"eval.include_path=[{tasks}]", "checkpoint.export=hf", "checkpoint.export_dtype=fp32",
               "logging.progress=false", "plan.plots=false", "logging.wandb.mode=disabled"],
              run, check=True, timeout=600)
    rows = {r["step"]: r for r in read_metrics(run)}
    assert not any(k.startswith("eval/") for k in rows[1]), rows[1]  # eval.every=2: step 2 only
    ours = {k: v for k, v in rows[2].items() if k.startswith("eval/")}
    assert ours["eval/seconds"] > 0
    # The weights evaluated at step 2 are the final ones: the run's export (fp32) holds them.
    theirs = hflm_reference(run / "export" / "hf", model, tasks)
    for key in ("eval/tiny_mc/acc", "eval/tiny_mc/acc_norm"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    assert "eval/tiny_mc/acc_stderr" in ours
    for key in ("eval/tiny_ppl/bits_per_byte", "eval/tiny_ppl/word_perplexity", "eval/tiny_ppl/byte_perplexity"):
        assert math.isclose(ours[key], theirs[key], rel_tol=1e-4), (key, ours[key], theirs[key])


def test_eval_inputs_are_checked_before_launch(eval_inputs, tmp_path, monkeypatch):
    """action=plan reads the task YAMLs without lm-eval: missing local data names the task; the
    launch pre-check builds the tasks offline and names an unknown one, and without lm-eval
    installed says how to install it (exit-2 problems)."""
    from launcher.config.errors import ConfigError
    from launcher.launch.preflight import check_eval_tasks

    model, tasks = eval_inputs
    broken = tmp_path / "tasks"
    broken.mkdir()
    (broken / "gone.yaml").write_text(MC_YAML.replace("tiny_mc", "gone").format(data=tmp_path / "nope.jsonl"))
    base = ["+recipe=debug", "eval.every=2", f"eval.tokenizer={model}"]
    spec = compose_spec(base + ["eval.tasks=[gone]", f"eval.include_path=[{broken}]"])
    problems = eval_input_problems(spec)
    assert len(problems) == 1 and "task gone" in problems[0] and "nope.jsonl" in problems[0], problems
    assert any("eval.every=0" in p for p in validate(compose_spec(["+recipe=debug", "eval.tasks=[tiny_mc]",
                                                                   f"eval.tokenizer={model}"])))
    with pytest.raises(ConfigError) as err:
        check_eval_tasks(compose_spec(base + ["eval.tasks=[tiny_mc,hellaswagg]", f"eval.include_path=[{tasks}]"]))
    assert "hellaswagg" in err.value.problems[0] and "Fix:" in err.value.problems[0]
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # what `import lm_eval` meets when not installed
    with pytest.raises(ConfigError) as err:
        check_eval_tasks(compose_spec(base + ["eval.tasks=[tiny_mc]", f"eval.include_path=[{tasks}]"]))
    assert "pip install 'launcher[eval]'" in err.value.problems[0], err.value.problems


def test_rows_score_summed_log_likelihoods_and_leave_the_model_alone(debug_engine):
    """RowScorer through the engine's eval path: each row's summed log p of its scored tokens equals
    the model's own log-softmax; calls are filled to the same shape; weights and RNG untouched."""
    from launcher.eval.rows import RowScorer, RowShape

    engine, _, plan = debug_engine
    vocab, seq = engine.model_cfg.vocab_size, 32
    gen = torch.Generator().manual_seed(3)
    rows = [(torch.randint(0, vocab, (n,), generator=gen).tolist(), k) for n, k in ((33, 5), (8, 1), (20, 19), (2, 1), (12, 3))]
    before = {k: v.detach().clone() for k, v in engine.parts[0].state_dict().items()}
    rng = torch.get_rng_state()
    scorer = RowScorer(engine, RowShape(seq_len=seq, micro_batch_size=1, microbatches=2, dp_rank=0, dp_size=1), pad_id=0)
    got = scorer.score(rows)  # 5 rows in calls of 2: the last call is filled with a no-token row
    for (tokens, k), ll in zip(rows, got):
        with torch.no_grad():
            logp = torch.log_softmax(engine.parts[0](torch.tensor([tokens[:-1]])).float(), dim=-1)[0]
        want = sum(float(logp[i, tokens[i + 1]]) for i in range(len(tokens) - 1 - k, len(tokens) - 1))
        assert math.isclose(ll, want, rel_tol=1e-5, abs_tol=1e-5), (ll, want)
    assert all(torch.equal(before[k], v) for k, v in engine.parts[0].state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_an_evaluation_leaves_weights_modes_and_random_states_as_they_were(debug_engine, eval_inputs):
    """DownstreamEval.run on the live engine: eval/<task>/<metric> names, and the model's weights,
    train mode and Python/numpy/torch random states unchanged (lm-eval seeds generators itself)."""
    import random

    import numpy as np
    from transformers import AutoTokenizer

    from launcher.eval.lm import LiveModelLM
    from launcher.eval.loop import DownstreamEval
    from launcher.eval.rows import RowScorer, RowShape
    from launcher.eval.tasks import load_tasks, set_offline_env

    engine, _, _ = debug_engine
    model, tasks = eval_inputs
    set_offline_env()
    scorer = RowScorer(engine, RowShape(seq_len=SEQ, micro_batch_size=1, microbatches=4, dp_rank=0, dp_size=1), pad_id=2)
    lm = LiveModelLM(scorer, AutoTokenizer.from_pretrained(str(model)), max_length=SEQ)
    evaluation = DownstreamEval(lm, load_tasks(["tiny_mc", "tiny_ppl"], [str(tasks)], 1), every=3, limit=2,
                                model_parts=engine.parts)
    assert [evaluation.due(s) for s in (1, 3, 6)] == [False, True, True]
    before = {k: v.detach().clone() for k, v in engine.parts[0].state_dict().items()}
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    row = evaluation.run()
    assert {"eval/tiny_mc/acc", "eval/tiny_mc/acc_norm", "eval/tiny_ppl/bits_per_byte", "eval/seconds"} <= set(row)
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    assert all(torch.equal(before[k], v) for k, v in engine.parts[0].state_dict().items())
    assert all(part.training for part in engine.parts)
