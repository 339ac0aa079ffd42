"""Parallel degrees and rank layout. Pure Python (no torch): used by the planner and the runtime.

Rank order, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp. TP is the
fastest-varying dimension so a TP group is a set of consecutive ranks, i.e. inside one
node on NVLink; PP is outermost so its point-to-point traffic is what crosses nodes.
Expert parallelism does not add a dimension: the ep ranks are taken from dp_shard * cp, times
tp when an MoE model's experts are folded over TP (Layout.experts_folded), the experts of one
MoE layer spread over ep ranks and each expert sharded by FSDP over the remaining ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Tuple

MESH_DIM_NAMES: Tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class MeshPlan:
    """The degrees the runtime builds its DeviceMesh from."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    def shape(self) -> Tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIM_NAMES)

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)

    def coordinates(self, rank: int) -> Dict[str, int]:
        """Position of a global rank along each named mesh dimension."""
        coords: Dict[str, int] = {}
        rest = rank
        for name in reversed(MESH_DIM_NAMES):
            size = getattr(self, name)
            coords[name] = rest % size
            rest //= size
        return coords

    def rank_of(self, coords: Dict[str, int]) -> int:
        """Global rank at these mesh coordinates (missing dimensions: 0); inverse of `coordinates`."""
        rank = 0
        for name in MESH_DIM_NAMES:
            rank = rank * getattr(self, name) + coords.get(name, 0)
        return rank
