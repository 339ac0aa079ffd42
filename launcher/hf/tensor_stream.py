"""One tensor at a time out of a sharded model, into single files written as the tensors arrive.

- ``TensorGather``: the per-tensor gather every export uses (fp32, safetensors, hf). The pipeline
  stage that holds a tensor all-gathers it (DTensor.full_tensor, collective on its own mesh), the
  stage leaders pass it on over the pipeline dimension, and global rank 0 gets the full fp32 CPU
  value. No rank ever holds more than one full tensor.
- ``SafetensorsStreamWriter`` / ``TorchSaveStreamWriter``: one safetensors / torch.save file, its
  header written first from the names and shapes (known before any tensor is gathered), then each
  tensor's bytes at their place as it arrives. Written to ``NAME.tmp`` and renamed when complete,
  so a crash never leaves a half-written file under the final name.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from launcher.hf.format import SAFETENSORS_DTYPES

Shape = Tuple[int, ...]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype` as safetensors stores it (no padding)."""
    return _numel(shape) * dtype.itemsize


def _raw(t: torch.Tensor):
    """The bytes of `t` (CPU) as a buffer, without a copy when `t` is contiguous."""
    return t.contiguous().view(torch.uint8).numpy() if t.numel() else b""


class TensorGather:
    """Per-tensor gather over a (possibly pipelined) mesh `world` (None: one process, no mesh)."""

    def __init__(self, world):
        self.world = world
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pp_rank = world["pp"].get_local_rank() if world is not None else 0
        self.pp_size = world["pp"].size() if world is not None else 1
        # The ranks with coordinate 0 on every non-pipeline dimension: one per stage, rank 0 among them.
        self.leader = world is None or all(world[d].get_local_rank() == 0
                                           for d in ("dp_replicate", "dp_shard", "cp", "tp"))

    def stage_lists(self, mine: list) -> List[list]:
        """Every pipeline stage's `mine` (small metadata), in stage order, on every rank."""
        if self.pp_size == 1:
            return [mine]
        pp = self.world["pp"]
        gathered: List[Optional[list]] = [None] * self.pp_size
        dist.all_gather_object(gathered, mine, group=pp.get_group())
        return gathered

    def full(self, local: Optional[torch.Tensor], shape: Shape, owner: int) -> Optional[torch.Tensor]:
        """The full fp32 CPU value of one tensor on global rank 0 (None elsewhere). Collective over
        all ranks: the ranks of stage `owner` pass their `local` (a DTensor or plain tensor), the
        others None; `shape` is the full shape."""
        full = None
        if owner == self.pp_rank:
            full = local.full_tensor() if isinstance(local, DTensor) else local  # collective on its mesh
            full = full.detach().to("cpu", torch.float32) if self.leader else None
        if self.pp_size > 1 and self.leader:
            pp = self.world["pp"]
            if full is None:
                full = torch.empty(shape, dtype=torch.float32)
            dist.broadcast(full, src=dist.get_global_rank(pp.get_group(), owner), group=pp.get_group())
        return full if self.rank == 0 else None


class _TensorFileWriter:
    """What the streaming writers share: tensors arrive in the header's order with the header's
    shape and dtype, and the file appears under its name (an atomic rename of NAME.tmp) only
    once every tensor is written."""

    def __init__(self, path: Path, names: List[str], shapes: Dict[str, Shape], dtype: torch.dtype,
                 dtypes: Optional[Dict[str, torch.dtype]] = None):
        self.path, self.tmp = Path(path), Path(path).with_name(Path(path).name + ".tmp")
        self.order, self.next = list(names), 0
        self.dtype, self.shapes = dtype, shapes
        self.dtypes = dtypes or {}  # per-tensor exceptions to `dtype`

    def dtype_of(self, name: str) -> torch.dtype:
        return self.dtypes.get(name, self.dtype)

    def _accept(self, name: str, t: torch.Tensor) -> None:
        assert name == self.order[self.next], f"{name} out of order (expected {self.order[self.next]})"
        assert tuple(t.shape) == tuple(self.shapes[name]) and t.dtype == self.dtype_of(name), (
            f"{name}: {tuple(t.shape)} {t.dtype} does not match the header's {self.shapes[name]} {self.dtype_of(name)}")
        self.next += 1

    def close(self) -> None:
        assert self.next == len(self.order), f"{self.path}: {len(self.order) - self.next} tensors never written"
        self.fh.close()
        os.replace(self.tmp, self.path)


class SafetensorsStreamWriter(_TensorFileWriter):
    """Writes one safetensors file tensor by tensor: the header (shapes, dtype, offsets) is
    known up front, so each tensor's bytes are appended as it arrives."""

    def __init__(self, path: Path, names: List[str], shapes: Dict[str, Shape], dtype: torch.dtype,
                 dtypes: Optional[Dict[str, torch.dtype]] = None):
        super().__init__(path, names, shapes, dtype, dtypes)
        header, offset = {}, 0
        for n in names:
            nbytes = tensor_nbytes(shapes[n], self.dtype_of(n))
            header[n] = {"dtype": SAFETENSORS_DTYPES[str(self.dtype_of(n)).replace("torch.", "")],
                         "shape": list(shapes[n]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
        self.fh = open(self.tmp, "wb")
        self.fh.write(struct.pack("<Q", len(raw)))
        self.fh.write(raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        self._accept(name, t)
        self.fh.write(_raw(t))


class TorchSaveStreamWriter(_TensorFileWriter):
    """Writes the file torch.save(dict of fp32 CPU tensors) writes (torch.load reads it as
    usual, mmap=True included), tensor by tensor: torch.save runs first on fake tensors with
    ``torch.serialization.skip_data`` (the pickle and every storage record's place, no data);
    then each tensor's bytes go to its record's offset in the zip as it arrives."""

    def __init__(self, path: Path, names: List[str], shapes: Dict[str, Shape]):
        super().__init__(path, names, shapes, torch.float32)
        with FakeTensorMode():
            fake = {n: torch.empty(shapes[n], dtype=torch.float32) for n in names}
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fake, self.tmp)
        reader = torch._C.PyTorchFileReader(str(self.tmp))
        # torch.save numbers the storages in the order it pickles them: the dict's order.
        records = {r for r in reader.get_all_records() if r.startswith("data/")}
        if records != {f"data/{i}" for i in range(len(names))}:
            raise RuntimeError(f"torch.save laid out {sorted(records)[:4]}... for {len(names)} tensors: "
                               f"this torch version's format is not the one the streaming export knows")
        self.offsets = {n: reader.get_record_offset(f"data/{i}") for i, n in enumerate(names)}
        del reader
        self.fh = open(self.tmp, "r+b")

    def write(self, name: str, t: torch.Tensor) -> None:
        self._accept(name, t)
        self.fh.seek(self.offsets[name])
        self.fh.write(_raw(t))
