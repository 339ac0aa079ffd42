"""FP8 block quantization's arithmetic: dequantize a box of a weight, quantize a full weight.

The layout (launcher/hf/format.py, BlockQuant): a weight W (N, K) stored as float8_e4m3fn and
`W_scale_inv` (ceil(N/B0), ceil(K/B1)); the real value is W[i, j] * W_scale_inv[i // B0, j // B1],
the last row and column of blocks partial when N or K is not a multiple of the block. Scales may
be stored as float32, bf16 or float8_e8m0fnu (ue8m0); each converts to float32 exactly.

A reader dequantizes only the box its shard holds, so shards need not align to the blocks
(DeepSeek-V3's kv_a_proj_with_mqa is 576 x 7168: tp shards of rows cut blocks in two).
"""

from __future__ import annotations

from typing import Tuple

import torch

from launcher.hf.format import FP8_MAX, scale_grid


def dequantize(weight: torch.Tensor, scales: torch.Tensor, offset: Tuple[int, int],
               block: Tuple[int, int]) -> torch.Tensor:
    """float32 values of a box of an FP8 weight. `weight`: the box's e4m3 values; `scales`: the
    scale rows and columns that cover it (first block at the box's first block); `offset`: where
    the box starts inside that first block (rows, columns)."""
    b0, b1 = block
    r, c = offset
    rows, cols = weight.shape
    s = scales.to(torch.float32)
    # Expand the (small) scale grid along columns first, then rows: one box-sized temporary.
    s = s.repeat_interleave(b1, dim=1)[:, c:c + cols]
    s = s.repeat_interleave(b0, dim=0)[r:r + rows]
    return weight.to(torch.float32).mul_(s)


def quantize(full: torch.Tensor, block: Tuple[int, int], power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv) of a full 2-D weight: per block scale = amax / 448 (so the
    block's largest magnitude is e4m3's largest), rounded up to a power of two when
    `power_of_two` (ue8m0 scales, DeepSeek-V3.1); an all-zero block gets scale 1."""
    b0, b1 = block
    n, k = full.shape
    nb0, nb1 = scale_grid((n, k), block)
    padded = torch.zeros(nb0 * b0, nb1 * b1, dtype=torch.float32)
    padded[:n, :k] = full.to(torch.float32)
    blocks = padded.view(nb0, b0, nb1, b1)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    # Clamped: amax / (amax / 448) may round a hair above 448, and e4m3fn has no infinity.
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb0 * b0, nb1 * b1)[:n, :k].contiguous(), scale
