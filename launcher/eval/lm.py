"""lm-eval's model interface over the live model (`LiveModelLM`, a `TemplateLM`).

`TemplateLM` gives HFLM's context/continuation encoding (trailing spaces move to the
continuation, an empty context gets the prefix token); this class tokenizes as HFLM does and
scores through `RowScorer`, so its numbers are HFLM's on the same weights: a request keeps its
last seq_len + 1 tokens (HFLM's left truncation at max_length), and a rolling text is cut into
lm-eval's own disjoint windows of max_length tokens.

lm-eval sees rank 0 of 1 on every rank: each rank builds the same requests and the data-parallel
split happens below, per forward call (RowScorer), so the number of forward calls is the same on
every rank by construction and no object is gathered through lm-eval.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

from launcher.eval.rows import RowScorer


class GenerationNotBuilt(RuntimeError):
    """generate_until was asked for: greedy generation is not built on the live model."""


class LiveModelLM(TemplateLM):
    """loglikelihood and loglikelihood_rolling on the training model (collective)."""

    def __init__(self, scorer: RowScorer, tokenizer, max_length: int):
        super().__init__()
        self.scorer = scorer
        self.tokenizer = tokenizer  # a transformers tokenizer (HF folder, eval.tokenizer)
        self._max_length = max_length
        self.add_bos_token: Optional[bool] = None  # HFLM's default: the tokenizer's own special tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # HFLM's: BOS when the tokenizer has one, else EOS
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        """HFLM.tok_encode: the tokenizer's special tokens unless told, none before an explicit BOS."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        rows = [self._row(context_enc, continuation_enc) for _, context_enc, continuation_enc in requests]
        return [(ll, greedy) for ll, greedy in self.scorer.score(rows)]  # (loglikelihood, is_greedy)

    def _row(self, context_enc: Sequence[int], continuation_enc: Sequence[int]) -> Tuple[List[int], int]:
        """HFLM's model input: the last max_length + 1 tokens of context + continuation."""
        return list(context_enc + continuation_enc)[-(self._max_length + 1):], len(continuation_enc)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        rows: List[Tuple[Sequence[int], int]] = []
        counts = []
        for (string,) in [req.args for req in requests]:
            windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length, context_len=1)]
            rows.extend(self._row(context, continuation) for context, continuation in windows)
            counts.append(len(windows))
        scores = [ll for ll, _ in self.scorer.score(rows, greedy=False)]
        out, at = [], 0
        for n in counts:
            out.append(sum(scores[at:at + n]))
            at += n
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        names = sorted({getattr(r, "task_name", "?") for r in requests})
        raise GenerationNotBuilt(
            f"eval.tasks: task(s) {', '.join(names)} generate text (output_type generate_until), which in-loop "
            f"evaluation does not build. Fix: drop them from eval.tasks; run them on an HF export with lm-eval.")
