"""A rank's downstream evaluation from the job: tokenizer, tasks (built once), the live-model LM."""

from __future__ import annotations

import logging
from typing import Optional

from launcher.config.schema import JobConfig
from launcher.data.eval_inputs import eval_tokenizer_folder
from launcher.eval.rows import RowScorer, RowShape
from launcher.eval.tasks import load_tasks, set_offline_env
from launcher.plan.decide.resolve import eval_rows_per_rank
from launcher.plan.layout import Layout

log = logging.getLogger(__name__)


def build_downstream_eval(spec: JobConfig, layout: Layout, dp_rank: int, engine) -> Optional["DownstreamEval"]:
    """eval.tasks every eval.every steps on `engine`'s model (None when off). Collective-free:
    every rank builds the same tasks and requests."""
    e = spec.eval
    if not e.tasks or e.every <= 0:
        return None
    set_offline_env()  # before lm-eval / datasets are imported
    from transformers import AutoTokenizer  # lazy: lm-eval's dependency, with the optional extra

    from launcher.eval.lm import LiveModelLM  # lazy: imports lm-eval, the optional extra
    from launcher.eval.loop import DownstreamEval  # lazy: only when evaluation is on

    folder, _ = eval_tokenizer_folder(spec)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rows = eval_rows_per_rank(spec.trainer, e.batch_tokens, layout)
    mbs = layout.batch.micro_batch_size
    shape = RowShape(seq_len=spec.trainer.seq_len, micro_batch_size=mbs, microbatches=rows // mbs,
                     dp_rank=dp_rank, dp_size=layout.mesh.dp)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    lm = LiveModelLM(RowScorer(engine, shape, pad), tokenizer, max_length=spec.trainer.seq_len)
    tasks = load_tasks(e.tasks, e.include_path, e.num_fewshot)
    log.info("downstream evaluation: %s every %d steps (%s documents per task, %d-shot), %d rows of %d tokens per "
             "forward call on each of %d data-parallel ranks, tokenizer %s", ", ".join(tasks["tasks"]), e.every,
             e.limit or "all", e.num_fewshot, shape.rows_per_rank, shape.seq_len, shape.dp_size, folder)
    return DownstreamEval(lm, tasks, e.every, e.limit, model_parts=getattr(engine, "model_parts", ()))
