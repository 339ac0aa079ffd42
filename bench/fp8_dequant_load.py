"""Seconds per GB of the dequantizing load of an FP8 block-quantized Hugging Face folder.

    .venv/bin/python bench/fp8_dequant_load.py [--gb 0.5] [--dir /tmp] [--repeats 3]

Writes a synthetic folder shaped like DeepSeek-V3's FP8 release: config.json with its
`quantization_config` (e4m3, 128 x 128 blocks) and one model.safetensors of routed-expert weights
(2048 x 7168 and 7168 x 2048, e4m3, random bytes) and kv_a_proj_with_mqa weights (576 x 7168,
576 not a multiple of 128), each with its float32 `weight_scale_inv`, `--gb` GB of e4m3 in all.
Then, through the loader's own reader (launcher.hf.weights.HfReader, what model.init_from uses),
reads every weight the way a rank fills its shard: dequantized and copied into a bf16 parameter.
Three boxes: the whole tensor (one rank), the first half of the rows (tp=2: aligned to the
blocks) and rows 100 to 100 + N/2 (a shard that cuts the blocks). As a baseline, the same
weights read without dequantizing (the raw e4m3 bytes copied into a bf16 tensor: what the loader
did before it read the scales, a wrong value at the same I/O).

The file was just written, so it is read from the page cache: the numbers are the CPU cost of
dequantizing (what the load adds per GB), not the disk's. Prints one markdown table; seconds per
GB are per GB of e4m3 weights read (a 671B release holds about 650 GB of them).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SHAPES = ((2048, 7168), (7168, 2048), (576, 7168))  # expert w1/w3, w2, MLA's kv_a_proj_with_mqa


def write_folder(folder: Path, gb: float) -> list:
    """The synthetic FP8 folder; returns the weight names."""
    from safetensors.torch import save_file

    from launcher.hf.format import BlockQuant, scale_grid, scale_name

    quant = BlockQuant()
    tensors, names, total, i = {}, [], 0, 0
    gen = torch.Generator().manual_seed(0)
    while total < gb * 1e9:
        shape = SHAPES[i % len(SHAPES)]
        name = f"model.layers.{i}.weight"
        # Random bytes in e4m3's finite range: |x| <= 448 (0x7f / 0xff are NaN in e4m3fn).
        raw = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=gen)
        raw |= torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7
        tensors[name] = raw.view(torch.float8_e4m3fn)
        tensors[scale_name(name)] = torch.rand(scale_grid(shape, quant.block), generator=gen) * 1e-3
        names.append(name)
        total += raw.numel()
        i += 1
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": quant.config()}))
    return names


def timed_read(reader, names: list, box_of, dequantize: bool) -> tuple:
    """(seconds, e4m3 bytes) to fill bf16 parameters with each weight's box."""
    start, nbytes = time.perf_counter(), 0
    for name in names:
        shape = tuple(reader._handle(name).get_slice(name).get_shape())
        box = box_of(shape)
        value = reader.read(name, box) if dequantize else reader._slice(name, box)
        local = torch.empty(value.shape, dtype=torch.bfloat16)
        # Both paths go through float32 into the bf16 parameter (load_hf_weights' copy_ of the reader's value).
        local.copy_(value if dequantize else value.to(torch.float32))
        nbytes += value.numel()
    return time.perf_counter() - start, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=0.5, help="GB of e4m3 weights in the folder")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=3, help="the best of this many passes is reported")
    args = parser.parse_args()

    from launcher.hf.weights import HfReader

    folder = Path(tempfile.mkdtemp(prefix="fp8_dequant_", dir=args.dir))
    try:
        t0 = time.perf_counter()
        names = write_folder(folder, args.gb)
        written = time.perf_counter() - t0
        boxes = {
            "whole tensor": lambda s: [(0, s[0]), (0, s[1])],
            "rows 0..N/2 (tp=2)": lambda s: [(0, s[0] // 2), (0, s[1])],
            "rows 100..100+N/2 (cuts blocks)": lambda s: [(100, 100 + s[0] // 2), (0, s[1])],
        }
        print(f"# {len(names)} weights, {folder} written in {written:.1f} s; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, Python "
              f"{platform.python_version()}\n")
        print("| box | path | GB of e4m3 read | best s | s per GB | GB/s |")
        print("|---|---|---:|---:|---:|---:|")
        for label, box_of in boxes.items():
            for path, dequantize in (("raw e4m3 -> bf16 (no scales, wrong)", False), ("dequantize -> bf16", True)):
                best, nbytes = None, 0
                for _ in range(args.repeats):
                    seconds, nbytes = timed_read(HfReader(str(folder)), names, box_of, dequantize)
                    best = seconds if best is None else min(best, seconds)
                gb = nbytes / 1e9
                print(f"| {label} | {path} | {gb:.3f} | {best:.2f} | {best / gb:.2f} | {gb / best:.2f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
