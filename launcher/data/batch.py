"""What one micro-batch carries from the data side to an engine.

`inputs` and `labels` are always there. The optional fields are None unless the run asks for
them, so a plain run pays nothing:

- `positions`: RoPE positions per token, restarting at 0 at each document start
  (data.reset_positions=true); None means 0..seq_len-1 in every row.
- `document_ids`: which document of the packed row each token belongs to, numbered from 0 in
  each row (data.document_masking=true): attention stays inside a document (block-causal).
- `sources`: the index of the mixture source each row was drawn from (data.mix), so the engine
  can report the loss per source.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Microbatch(NamedTuple):
    inputs: torch.Tensor  # int64 [micro_batch, seq_len]
    labels: torch.Tensor  # int64 [micro_batch, seq_len]; -100 = not counted
    positions: Optional[torch.Tensor] = None  # int64 [micro_batch, seq_len]
    document_ids: Optional[torch.Tensor] = None  # int32 [micro_batch, seq_len]
    sources: Optional[torch.Tensor] = None  # int64 [micro_batch]
