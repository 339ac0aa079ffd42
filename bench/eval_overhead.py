"""In-loop evaluation (eval.*): the time of a call against the plan's figure, and its share of a run.

    .venv/bin/python bench/eval_overhead.py [--docs 200] [--steps 12] [--every 4]

1. Measured vs planned, in one run: a real `train +recipe=debug` (2 local ranks) with one local
   4-way multiple-choice task of `--docs` generated documents (a word-level tokenizer and the
   task's JSON-lines data are written into a temporary folder), evaluated every `--every` steps.
   From metrics.jsonl: `eval/seconds` per call and the median `step_time_s`; from plan.json:
   `eval.call_s` and `time.step_s`. The plan is for its `hardware` (a GPU), this machine is not,
   so the figure compared is the call's time in training steps, measured / planned
   (`eval call ratio R`; 1 = the plan's forward-at-a-third-of-a-step model holds here).
2. The share at the documented defaults: for a few recipes, `eval.tasks=[hellaswag]` (a built-in
   task: 1,000 documents x 4 requests x 128 tokens, docs/evaluation.md) every 1,000 steps, the
   plan's evaluation seconds over its wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

WORDS = ("the a cat dog bird fish sat ran flew swam on in under over mat tree sky sea red blue green big "
         "small is was it what where who question answer yes no and or with to from of at by").split()
TASK_YAML = """task: bench_mc
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
"""
DEFAULT_SHARE_RECIPES = ("llama8b", "qwen3_8b", "llama70b")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=200, help="documents of the generated task")
    p.add_argument("--steps", type=int, default=12, help="training steps of the run")
    p.add_argument("--every", type=int, default=4, help="eval.every")
    return p.parse_args(argv)


def write_inputs(folder: Path, docs: int) -> None:
    """A word-level tokenizer and a 4-way multiple-choice task of `docs` random documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS + ["?", "."])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="[UNK]").save_pretrained(str(folder))
    rng = random.Random(0)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    rows = [{"question": f"question : {words(12)} ?", "choices": [words(4) for _ in range(4)],
             "label": rng.randrange(4)} for _ in range(docs)]
    data = folder / "bench_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "bench_mc.yaml").write_text(TASK_YAML.format(data=data))


def measured_vs_planned(args: argparse.Namespace) -> float:
    """Run the debug recipe with evaluation; print and return R (call time in steps, measured / planned)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_inputs(folder, args.docs)
        run_dir = folder / "run"
        cmd = [str(Path(sys.executable).with_name("train")), "+recipe=debug", f"trainer.steps={args.steps}",
               "trainer.log_every=1", f"eval.every={args.every}", "eval.tasks=[bench_mc]",
               f"eval.include_path=[{folder}]", f"eval.tokenizer={folder}", "checkpoint.enabled=false",
               "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        plan = json.loads((run_dir / "plan.json").read_text())
    calls = [r["eval/seconds"] for r in records if "eval/seconds" in r]
    steps = [r["step_time_s"] for r in records if r["step"] > 2 and "eval/seconds" not in r]
    measured_call, step = statistics.median(calls), statistics.median(steps)
    planned_call, planned_step = plan["eval"]["call_s"], plan["time"]["step_s"]
    print(f"eval call: measured {measured_call:.3f} s = {measured_call / step:.1f} steps of {step:.3f} s "
          f"({len(calls)} calls, {args.docs} docs); planned {planned_call:.6f} s = {planned_call / planned_step:.1f} "
          f"steps of {planned_step:.6f} s ({plan['eval']['tokens_per_call']:,} tokens per call)")
    ratio = (measured_call / step) / (planned_call / planned_step)
    print(f"eval call ratio R = {ratio:.2f} (the call in training steps, measured / planned)")
    return ratio


def default_shares(recipes: Sequence[str] = DEFAULT_SHARE_RECIPES) -> List[str]:
    """The plan's evaluation share of the wall time at the documented defaults, per recipe."""
    from launcher.config.loader import compose_spec
    from launcher.plan.present.plan import build_plan

    lines = []
    for recipe in recipes:
        spec = compose_spec([f"+recipe={recipe}", "trainer.steps=10000", "eval.every=1000", "eval.tasks=[hellaswag]",
                             "eval.tokenizer=/unused"])
        plan = build_plan(spec)
        share = plan.budget["eval_s"] / plan.budget["wall_s"]
        lines.append(f"{recipe}: hellaswag (defaults) every 1,000 steps = {plan.eval['call_s']:.1f} s per call, "
                     f"{100 * share:.2f} % of the wall time")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    measured_vs_planned(args)
    for line in default_shares():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
