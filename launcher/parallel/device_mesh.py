"""The DeviceMesh every native parallelism is applied on, built from the plan's MeshPlan.

Rank order (row-major, outermost to innermost), as in launcher/plan/degrees.py:

    pp  ×  dp_replicate  ×  dp_shard  ×  cp  ×  tp

TP is innermost: a TP group is consecutive ranks, i.e. inside one node on NVLink. Then CP,
FSDP (dp_shard), the HSDP replicas, and PP outermost, whose point-to-point traffic is the
one that crosses nodes. Example with pp=2, dp_shard=2, tp=2 (8 ranks): tp groups {0,1}
{2,3}..., dp_shard groups {0,2} {1,3} {4,6} {5,7}, pp groups {0,4} {1,5} {2,6} {3,7}.

All five dimensions are kept, size-1 ones included, so ``mesh["tp"]`` always exists. The
flattened views the techniques need are registered on the same root mesh:

- ``dp``          = dp_replicate × dp_shard: ranks that see different data (data loader).
- ``dp_cp``       = dp_replicate × dp_shard × cp: ranks over which the loss is averaged.
- ``dp_shard_cp`` = dp_shard × cp: the FSDP sharding group (CP ranks shard parameters too).

Expert parallelism adds no dimension: ``expert_meshes`` splits dp_shard_cp into
(dp_shard_mod_ep, ep) with ep innermost, so the experts of one MoE layer are spread over
ep nearby ranks and each expert shard is FSDP-sharded over the remaining ranks. With experts
folded over TP (``Layout.experts_folded``: an MoE model with tp > 1, where each TP rank routes
its own tokens) the split is of dp_shard x cp x tp instead: the ep group may take the TP ranks,
and an expert shard's data-parallel ranks (its gradients summed over them) include them too.
``token_group`` is the (cp, tp) group of ranks holding slices of the same sequences, over
which the MoE's load-balancing statistics are summed.
"""

from __future__ import annotations

import logging
from typing import Tuple

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from launcher.plan.degrees import MESH_DIM_NAMES, MeshPlan

log = logging.getLogger(__name__)


def build_device_mesh(mesh: MeshPlan, device_type: str) -> DeviceMesh:
    """World DeviceMesh with named dims (pp, dp_replicate, dp_shard, cp, tp) + flattened views.

    The process group must already be initialised with world size == mesh.world_size.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != mesh.world_size:
        raise ValueError(
            f"the plan's mesh {mesh.to_dict()} needs {mesh.world_size} ranks but this job has "
            f"{world}; re-plan for this world size or start {mesh.world_size} ranks"
        )
    with _real_tensors():
        return _build_device_mesh(mesh, device_type)


def _real_tensors():
    """A DeviceMesh holds a real tensor of rank ids (it reads its values): build it outside any
    FakeTensorMode, which the rehearsal (launcher/rehearse/rank.py) runs the engine under.
    A no-op in real runs."""
    return unset_fake_temporarily()


def _build_device_mesh(mesh: MeshPlan, device_type: str) -> DeviceMesh:
    dm = init_device_mesh(device_type, mesh.shape(), mesh_dim_names=MESH_DIM_NAMES)
    # torch wants flattened meshes kept by the caller rather than sliced from the root
    # later: keep them on the root object, read them back with ``submesh``.
    views = {
        "dp": dm["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_cp": dm["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        "dp_shard_cp": dm["dp_shard", "cp"]._flatten("dp_shard_cp"),
    }
    # HSDP: 2-D (replicate, shard) mesh over the same ranks as dp_cp.
    views["hsdp"] = views["dp_cp"]._unflatten(
        0, (mesh.dp_replicate, mesh.dp_shard * mesh.cp), ("dp_replicate", "dp_shard_cp"))
    dm._launcher_views = views  # type: ignore[attr-defined]
    log.info("built device mesh %s on %s", dict(zip(MESH_DIM_NAMES, mesh.shape())), device_type)
    return dm


def submesh(world: DeviceMesh, name: str) -> DeviceMesh:
    """A named dimension (pp, dp_replicate, dp_shard, cp, tp) or view (dp, dp_cp, dp_shard_cp,
    hsdp = 2-D (dp_replicate, dp_shard_cp)) of a mesh made by ``build_device_mesh``."""
    views = getattr(world, "_launcher_views", {})
    if name in views:
        return views[name]
    if name in MESH_DIM_NAMES:
        return world[name]
    raise KeyError(f"unknown mesh view {name!r}; expected one of {MESH_DIM_NAMES + tuple(views)}")


def expert_meshes(world: DeviceMesh, ep: int, folded: bool = False) -> Tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, expert data-parallel mesh) for expert parallelism.

    The dp_cp ranks (``folded``: dp_cp x tp, the experts folded over TP) are viewed as
    (dp_replicate, dp_shard_mod_ep, ep), ep innermost: the routed experts are sharded over
    ``ep`` and FSDP-sharded over dp_shard_mod_ep (HSDP with dp_replicate when that is > 1, in
    which case the second mesh is 2-D).
    """
    views = world._launcher_views  # type: ignore[attr-defined]
    key = f"ep{ep}" + ("_folded" if folded else "")
    if key not in views:
        tp = world["tp"].size() if folded else 1
        fsdp = views["dp_shard_cp"].size() * tp
        if fsdp % ep:
            what = "dp_shard*cp*tp" if folded else "dp_shard*cp"
            raise ValueError(
                f"parallel.ep={ep} must divide {what}={fsdp}: expert-parallel ranks are "
                f"taken from those ranks; choose ep among the divisors of {fsdp}"
            )
        rep = world["dp_replicate"].size()
        with _real_tensors():
            ranks = world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp") if folded else views["dp_cp"]
            split = ranks._unflatten(0, (rep, fsdp // ep, ep), ("dp_replicate", "dp_shard_mod_ep", "ep"))
        dp = split["dp_replicate", "dp_shard_mod_ep"] if rep > 1 else split["dp_shard_mod_ep"]
        views[key] = (split["ep"], dp)
        views[key + "_grid"] = split["dp_shard_mod_ep", "ep"]
    return views[key]


def expert_grid(world: DeviceMesh, ep: int, folded: bool = False) -> DeviceMesh:
    """The 2-D (dp_shard_mod_ep, ep) mesh of ``expert_meshes`` (no dp_replicate: only used where no
    FSDP wraps the model, i.e. a single data-parallel rank)."""
    key = f"ep{ep}" + ("_folded" if folded else "")
    expert_meshes(world, ep, folded)
    return world._launcher_views[key + "_grid"]  # type: ignore[attr-defined]


def token_group(world: DeviceMesh) -> DeviceMesh:
    """The (cp, tp) ranks, flattened: with experts folded over TP (and under CP) they hold slices
    of the same sequences, so the MoE's load-balancing losses sum their statistics over it."""
    views = world._launcher_views  # type: ignore[attr-defined]
    if "cp_tp" not in views:
        with _real_tensors():
            views["cp_tp"] = world["cp", "tp"]._flatten("cp_tp")
    return views["cp_tp"]
