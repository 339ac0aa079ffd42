"""Downstream evaluation in the loop (eval.*): lm-eval's tasks on the live sharded model.

A tiny random Llama folder (transformers' own classes) with a word-level tokenizer, and local
multiple-choice, perplexity and cloze tasks (tests/eval_tasks.py: JSONL + task YAML, no network)
are written here. A 2-rank FSDP `train` run with eval.every logs eval/<task>/<metric> at the
evaluated step; the same numbers come from lm-eval's own HF backend (HFLM) on the run's fp32 HF
export of the weights it evaluated: acc, acc_norm and the cloze task's is_greedy acc exactly,
log-likelihood metrics within 1e-4 relative.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import TRAIN, read_metrics, train_env
from eval_tasks import MC_DOCS, MC_YAML, TASKS, WORDS, assert_scores_equal, hflm_reference, write_tasks, write_tokenizer
from launcher.config.loader import compose_spec
from launcher.data.eval_inputs import eval_input_problems
from launcher.plan.decide.resolve import validate

SEQ = 32
VOCAB = 64  # the tiny Llama's, and the tokenizer's (tests/eval_tasks.py)


@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory):
    """(HF model folder with its tokenizer, task folder): a tiny random Llama and the local tasks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    model = root / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False)).save_pretrained(model)
    write_tokenizer(model, VOCAB)
    return model, write_tasks(root / "tasks", VOCAB)


def _break_when_saved(checkpoint: Path, proc: subprocess.Popen, timeout: float = 600) -> bool:
    """Zero a weight file of `checkpoint` once it is saved, keeping its size (training's pruning
    checks sizes only, so the folder stays): its evaluation job, after training, then fails on the
    crc32 sums before it exports."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        files = sorted((checkpoint / "engine").rglob("*.distcp")) if (checkpoint / "manifest.json").is_file() else []
        if files:
            files[0].write_bytes(bytes(files[0].stat().st_size))
            return True
        time.sleep(0.02)
    return False


@pytest.mark.multiprocess
def test_in_loop_scores_equal_lm_evals_hf_backend(eval_inputs, tmp_path):
    """Also the per-checkpoint evaluation jobs (eval.on_checkpoint, eval.job=true) of the same launch:
    after training, the checkpoint of step 2 is exported (fp32) and scored by HFLM (the same acc as
    in the loop); the checkpoint of step 1, broken after it was saved, fails its job, which is
    recorded with its log, and training's exit code, checkpoints and metrics are untouched."""
    model, tasks = eval_inputs
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS[(i * 5) % len(WORDS)] for i in range(3000)))
    run = tmp_path / "run"
    args = ["model=hf", f"model.init_from={model}", "data=text", f"data.path={corpus}", "trainer.steps=2",
            f"trainer.seq_len={SEQ}", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
            "precision=fp32", "cluster.gpus_per_node=2", f"eval.tasks=[{','.join(TASKS)}]", "eval.every=2",
            f"eval.include_path=[{tasks}]", "checkpoint.export=hf", "checkpoint.export_dtype=fp32",
            "eval.on_checkpoint=[tiny_mc]", "eval.job=true", "checkpoint.interval=1",
            "logging.progress=false", "plan.plots=false", "logging.wandb.mode=disabled", f"hydra.run.dir={run}"]
    proc = subprocess.Popen([TRAIN, *args], cwd=tmp_path, env=train_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    checkpoints = run / "checkpoints"  # hydra.run.dir given: <run dir>/checkpoints
    broke = _break_when_saved(checkpoints / "step_00000001", proc)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert broke, out[-2000:]
    rows = {r["step"]: r for r in read_metrics(run)}
    assert not any(k.startswith("eval/") for k in rows[1]), rows[1]  # eval.every=2: step 2 only
    ours = {k: v for k, v in rows[2].items() if k.startswith("eval/")}
    assert ours["eval/seconds"] > 0
    # The weights evaluated at step 2 are the final ones: the run's export (fp32) holds them.
    theirs = hflm_reference(run / "export" / "hf", model, tasks, SEQ)
    assert_scores_equal(ours, theirs)
    assert "eval/tiny_mc/acc_stderr" in ours
    # Per-checkpoint jobs: one record per checkpoint step; step 2's acc is the in-loop acc at step 2.
    records = {r["step"]: r for r in map(json.loads, (run / "eval.jsonl").read_text().splitlines())}
    assert sorted(records) == [1, 2], records
    ok, failed = records[2], records[1]
    assert ok["status"] == "ok" and ok["task"] == "tiny_mc" and ok["job_id"].startswith("local-"), ok
    assert ok["metrics"]["acc"] == ours["eval/tiny_mc/acc"] and ok["metrics"]["acc_norm"] == ours["eval/tiny_mc/acc_norm"]
    assert ok["stderr"]["acc"] == ours["eval/tiny_mc/acc_stderr"] and ok["seconds"] > 0
    assert failed["status"] == "failed" and "fails its crc32 check" in failed["error"] and Path(failed["log"]).is_file(), failed
    assert not (checkpoints / "step_00000002_export").exists()  # the job's export is removed; the checkpoint stays
    assert (checkpoints / "step_00000002" / "manifest.json").is_file()
    assert "evaluation job for step 1: FAILED" in out, out[-3000:]


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
    # Per-checkpoint jobs: asked for without tasks, tasks without the job, a task whose data is gone
    # (named with its key), a task lm-eval cannot build offline.
    jobs = base + ["eval.tasks=[]", "eval.every=0"]
    assert any("eval.job=true without eval.on_checkpoint" in p and "Fix:" in p
               for p in validate(compose_spec(jobs + ["eval.job=true"])))
    assert any("eval.on_checkpoint=['tiny_mc']" in p and "eval.job=true" in p
               for p in validate(compose_spec(jobs + ["eval.on_checkpoint=[tiny_mc]"])))
    problems = eval_input_problems(compose_spec(jobs + ["eval.on_checkpoint=[gone]", "eval.job=true",
                                                        f"eval.include_path=[{broken}]"]))
    assert len(problems) == 1 and problems[0].startswith("eval.on_checkpoint: task gone"), problems
    with pytest.raises(ConfigError) as err:
        check_eval_tasks(compose_spec(jobs + ["eval.on_checkpoint=[tiny_mcc]", "eval.job=true",
                                              f"eval.include_path=[{tasks}]"]))
    assert err.value.problems[0].startswith("eval.on_checkpoint: no task named tiny_mcc"), err.value.problems
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # what `import lm_eval` meets when not installed
    with pytest.raises(ConfigError) as err:
        check_eval_tasks(compose_spec(base + ["eval.tasks=[tiny_mc]", f"eval.include_path=[{tasks}]"]))
    assert "pip install 'launcher[eval]'" in err.value.problems[0], err.value.problems


def test_rows_score_summed_log_likelihoods_and_leave_the_model_alone(debug_engine):
    """RowScorer through the engine's eval path: each row's summed log p of its scored tokens equals
    the model's own log-softmax, and is_greedy whether each of them is the argmax of the full logits
    (rows continued greedily score True, one wrong last token False); calls are filled to the same
    shape; weights and RNG untouched."""
    from launcher.eval.rows import RowScorer, RowShape

    engine, _, plan = debug_engine
    vocab, seq = engine.model_cfg.vocab_size, 32
    model = engine.parts[0]

    def logp_of(tokens):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).float(), dim=-1)[0]

    def greedy_continued(prefix, k):  # prefix + k tokens, each the argmax after the ones before
        out = list(prefix)
        for _ in range(k):
            out.append(int(logp_of(out)[-1].argmax()))
        return out

    gen = torch.Generator().manual_seed(3)
    rows = [(torch.randint(0, vocab, (n,), generator=gen).tolist(), k) for n, k in ((33, 5), (8, 1), (20, 19), (2, 1), (12, 3))]
    greedy3 = greedy_continued(rows[1][0][:5], 3)
    wrong_last = greedy3[:-1] + [(greedy3[-1] + 1) % vocab]
    rows += [(greedy3, 3), (greedy_continued(rows[0][0][:30], 3), 3), (wrong_last, 3)]
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    scorer = RowScorer(engine, RowShape(seq_len=seq, micro_batch_size=1, microbatches=3, dp_rank=0, dp_size=1), pad_id=0)
    got = scorer.score(rows)  # 8 rows in calls of 3: the last call is filled with a no-token row
    for (tokens, k), (ll, greedy) in zip(rows, got):
        logp = logp_of(tokens[:-1])
        scored = range(len(tokens) - 1 - k, len(tokens) - 1)
        want = sum(float(logp[i, tokens[i + 1]]) for i in scored)
        assert math.isclose(ll, want, rel_tol=1e-5, abs_tol=1e-5), (ll, want)
        assert greedy == all(int(logp[i].argmax()) == tokens[i + 1] for i in scored), (tokens, k)
    assert [g for _, g in got] == [False] * 5 + [True, True, False]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_an_evaluation_leaves_weights_modes_and_random_states_as_they_were(debug_engine, eval_inputs, tmp_path):
    """DownstreamEval.run on the live engine (1 rank): eval/<task>/<metric> names, the scores of
    lm-eval's HF backend on an fp32 HF export of the same weights (1-shot, 2 documents per task),
    and the model's weights, train mode and Python/numpy/torch random states unchanged (lm-eval
    seeds generators itself)."""
    import random

    import numpy as np
    from transformers import AutoTokenizer

    from launcher.eval.lm import LiveModelLM
    from launcher.eval.loop import DownstreamEval
    from launcher.eval.rows import RowScorer, RowShape
    from launcher.eval.tasks import load_tasks, set_offline_env
    from launcher.hf.weights import export_hf

    engine, _, _ = debug_engine
    model, tasks = eval_inputs
    set_offline_env()
    scorer = RowScorer(engine, RowShape(seq_len=SEQ, micro_batch_size=1, microbatches=4, dp_rank=0, dp_size=1), pad_id=2)
    lm = LiveModelLM(scorer, AutoTokenizer.from_pretrained(str(model)), max_length=SEQ)
    evaluation = DownstreamEval(lm, load_tasks(list(TASKS), [str(tasks)], 1), every=3, limit=2,
                                model_parts=engine.parts)
    assert [evaluation.due(s) for s in (1, 3, 6)] == [False, True, True]
    before = {k: v.detach().clone() for k, v in engine.parts[0].state_dict().items()}
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    row = evaluation.run()
    assert {"eval/tiny_mc/acc", "eval/tiny_mc/acc_norm", "eval/tiny_ppl/bits_per_byte", "eval/tiny_cloze/acc",
            "eval/seconds"} <= set(row)
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    assert all(torch.equal(before[k], v) for k, v in engine.parts[0].state_dict().items())
    assert all(part.training for part in engine.parts)
    export_hf(engine.parts, None, tmp_path / "hf", engine.model_cfg, "fp32")
    theirs = hflm_reference(tmp_path / "hf", model, tasks, SEQ, num_fewshot=1, limit=2)
    assert_scores_equal(row, theirs, some_greedy=False)


def test_the_plan_prices_evaluation_from_the_tasks_data_and_adds_it_to_the_budget(eval_inputs):
    """action=plan reads each local task's documents (no lm-eval, no torch): requests per document
    from doc_to_choice, tokens from the text at 4 characters per token; a task it cannot read
    (a built-in one) gets the documented defaults; a call costs its tokens at a third of the
    plan's compute time per training token, and the run's calls are in the budget's wall time."""
    from launcher.plan.estimate.eval_time import CHARS_PER_TOKEN, DEFAULT_DOCS, DEFAULT_REQUESTS_PER_DOC
    from launcher.plan.present.plan import build_plan
    from launcher.plan.present.report import render_plan

    model, tasks = eval_inputs
    spec = compose_spec(["+recipe=debug", "trainer.steps=20", "eval.every=5", f"eval.tokenizer={model}",
                         "eval.tasks=[tiny_mc,tiny_ppl,hellaswag]", f"eval.include_path=[{tasks}]"])
    plan = build_plan(spec)
    ev = {t["task"]: t for t in plan.eval["tasks"]}
    chars = lambda d: sum(len(v) for v in d.values() if isinstance(v, str)) + sum(  # noqa: E731
        len(x) for v in d.values() if isinstance(v, list) for x in v)
    mc_requests = sum(len(d["choices"]) for d in MC_DOCS)
    assert (ev["tiny_mc"]["docs"], ev["tiny_mc"]["requests"]) == (5, mc_requests)
    assert ev["tiny_mc"]["text_tokens"] == int(mc_requests * sum(map(chars, MC_DOCS)) / len(MC_DOCS) / CHARS_PER_TOKEN)
    # What runs: every request is a row padded to trainer.seq_len.
    seq = spec.trainer.seq_len
    assert (ev["tiny_mc"]["rows"], ev["tiny_mc"]["tokens"]) == (mc_requests, mc_requests * seq)
    assert (ev["tiny_ppl"]["docs"], ev["tiny_ppl"]["requests"]) == (3, 3)
    assert ev["hellaswag"]["docs"] == DEFAULT_DOCS and ev["hellaswag"]["requests"] == DEFAULT_DOCS * DEFAULT_REQUESTS_PER_DOC
    assert plan.eval["calls"] == 4
    expected_call = plan.eval["tokens_per_call"] / plan.batch.tokens_per_step * plan.time["compute_s"] / 3
    assert plan.eval["call_s"] == pytest.approx(expected_call)
    assert plan.budget["wall_s"] == pytest.approx(20 * plan.time["step_s"] + 4 * expected_call)
    text = render_plan(plan, spec)
    assert "Evaluation (eval.every=5):" in text and "hellaswag 1,000 docs" in text and "(defaults)" in text
    assert f"tiny_mc 5 docs / {mc_requests} requests / {mc_requests} rows of {seq} tokens" in text
    assert "h of training steps and evaluation" in text
    assert build_plan(compose_spec(["+recipe=debug"])).eval == {}


def test_eval_jobs_are_planned_and_rendered_for_slurm(eval_inputs, tmp_path):
    """eval.job_every=2 with checkpoint.interval=5: the checkpoints of steps 10, 20 and the last (23)
    are evaluated; action=plan says so in one line; the training job's script runs the submitter
    beside the ranks and once at exit, and the evaluation job (slurm/eval.sh.j2) is one node, one
    task, running the job module on that step offline."""
    from launcher.launch.eval_submit import render_eval_script
    from launcher.launch.slurm import render_script
    from launcher.plan.decide.eval_jobs import eval_job_steps
    from launcher.plan.present.plan import build_plan
    from launcher.plan.present.report import render_plan

    model, tasks = eval_inputs
    spec = compose_spec(["+recipe=debug", "cluster=slurm", "trainer.steps=23", "checkpoint.interval=5",
                         "eval.on_checkpoint=[tiny_mc]", "eval.job=true", "eval.job_every=2",
                         f"eval.include_path=[{tasks}]", f"eval.tokenizer={model}"])
    assert eval_job_steps(spec) == [10, 20, 23]
    plan = build_plan(spec)
    text = render_plan(plan, spec)
    assert "Evaluation jobs (eval.job): tiny_mc on the HF export (bf16) of the checkpoints of steps 10, 20, 23: " \
           "a one-node SLURM job" in text, text
    script = render_script(spec, plan, tmp_path)
    assert f"-m launcher.launch.eval_submit watch {tmp_path}" in script and "trap eval_jobs_final EXIT" in script
    job = render_eval_script(spec, tmp_path, 20, tmp_path)
    assert '#SBATCH --nodes="1"' in job and '#SBATCH --ntasks="1"' in job and "HF_HUB_OFFLINE=1" in job
    assert f"-m launcher.launch.eval_job {tmp_path} 20" in job
    assert "eval_submit" not in render_script(compose_spec(["+recipe=debug", "cluster=slurm"]), plan, tmp_path)
    # Local jobs run after training: a due checkpoint that checkpoint.keep removes by then is named.
    local = render_plan(plan, dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, name="local"),
                                                  checkpoint=spec.checkpoint.with_changes(keep=2)))
    assert "after training ends" in local and "1 due checkpoint(s) (steps 10) will be recorded as skipped. " \
           "Fix: checkpoint.keep=4" in local, local
