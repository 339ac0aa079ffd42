"""Layout-independent init whose cost per rank is its own shard (launcher/models/init.py).

In one process, each rank of several 4-rank layouts is built on a fake process group (torch's
FakeStore: no other rank runs; the init needs no communication) with a small tile (16 x 16), so
the debug models' parameters span many tiles and shards cut through them. For every rank:
- every parameter's local shard equals the full initial value redistributed to the parameter's
  placements (DTensor's own slicing, independent of the init's box arithmetic);
- the init's live allocations stay within one tile (and trunc_normal_'s temporaries on it), not
  a full parameter, and it draws the numbers of its own shard rounded out to whole tiles, not
  the whole model's.
The real-run check that layouts start from identical weights is the layout matrix
(tests/test_parallel_layouts.py), whose losses equal the 1-rank run's.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from launcher.models import init as init_mod
from tests.test_models import model_cfg

TILE = 16
TILE_BYTES = TILE * TILE * 4
# One tile plus trunc_normal_'s own temporaries on it (torch's rejection sampling: a tile for the
# redraw, bool masks, indices): measured up to 4.3 tiles live at once. The embedding the old init
# drew whole is 63 tiles here.
BOUND_BYTES = 8 * TILE_BYTES
ODD = {"vocab_size": 251, "ffn_dim": 191, "moe_ffn_dim": 45, "n_experts": 3}
# name: (model, model overrides, mesh, extra dotted keys)
LAYOUTS = {
    "fsdp4_odd": ("debug_moe", ODD, {"dp_shard": 4}, {}),
    "fsdp2_tp2_sp": ("debug_moe", {}, {"dp_shard": 2, "tp": 2}, {"parallel.sp": True}),
    "ep2_fsdp4_2experts": ("debug_moe", {"n_experts": 2}, {"dp_shard": 4, "ep": 2}, {}),
    "pp2_tp2": ("debug", {}, {"pp": 2, "tp": 2}, {}),
}


class _AllocTracker(TorchDispatchMode):
    """Live bytes of the plain tensors allocated under it (views and in-place results excluded),
    and the elements of the tensors created with torch.empty (the tiles, or full parameters)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.drawn = 0
        self.seen = set()

    def _free(self, key, n):
        self.seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.empty.memory_format:  # what is generated is first allocated so
            self.drawn += out.numel()  # (trunc_normal_'s redraws use empty_like: not counted)
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                  if type(a) is torch.Tensor}
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor:
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n and key not in self.seen and key not in inputs:  # views and in-place results share an input's
                self.seen.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key, n)
        return out


def _tiles_numel(shape, box) -> int:
    """Elements of the tiles (extent 1 on leading dims, TILE on the last two) overlapping `box`."""
    n = 1
    for d, ((a, b), size) in enumerate(zip(box, shape)):
        t = 1 if d < len(shape) - 2 else TILE
        if b <= a:
            return 0
        n *= min(size, ((b - 1) // t + 1) * t) - (a // t) * t
    return n


def _build_rank(cfg, mesh: dict, extra: dict, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from tests.layout_for import layout_for

    world = 4
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    layout = layout_for(cfg, world, **{f"parallel.{k}": v for k, v in mesh.items()}, **extra)
    return NativeEngine(cfg, OptimConfig(lr=1e-3, warmup_steps=0), layout, torch.device("cpu"),
                        EngineOptions(total_steps=1, seed=5))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_draws_its_own_shard_with_the_same_values(name, monkeypatch):
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    monkeypatch.setattr(init_mod, "TILE", TILE, raising=False)
    # The RoPE table (recomputed whole by every init, whatever the layout) is not a parameter's cost.
    no_table = lambda cfg, device=None: torch.empty(0)  # noqa: E731
    monkeypatch.setattr("launcher.models.layers.model_rope_table", no_table)
    monkeypatch.setattr(init_mod, "model_rope_table", no_table)  # the name init.py imported
    model, overrides, mesh, extra = LAYOUTS[name]
    cfg = replace(model_cfg(model), **overrides)
    if dist.is_initialized():  # another test module left one
        dist.destroy_process_group()
    full_cache = {}
    for rank in (1, 3):  # a shard at an offset and the last (short, for uneven sizes) one
        engine = _build_rank(cfg, mesh, extra, rank)
        try:
            total = drawn_full = own_tiles = 0
            tracker = _AllocTracker()
            with tracker:
                for part in engine.model_parts:
                    init_mod.init_model_weights(part, 5)
            for part in engine.model_parts:
                for pname, p in part.named_parameters():
                    cname = init_mod.canonical_name(pname)
                    if cname not in full_cache:
                        full_cache[cname] = init_mod.full_init_value(cname, tuple(p.shape), cfg, 5,
                                                                     torch.device("cpu"))
                    full = full_cache[cname]
                    if not cname.endswith("norm.weight"):
                        drawn_full += full.numel()
                        own_tiles += _tiles_numel(tuple(p.shape), init_mod.local_box(p)[1])
                    total += full.numel()
                    if isinstance(p, DTensor):
                        rep = DTensor.from_local(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                                 run_check=False)
                        want = rep.redistribute(p.device_mesh, p.placements).to_local()
                        got = p.to_local()[tuple(slice(0, s) for s in want.shape)]
                    else:
                        want, got = full, p.detach()
                    assert torch.equal(got, want), f"{name} rank {rank}: {cname} differs from the full init's shard"
            assert tracker.peak <= BOUND_BYTES, (
                f"{name} rank {rank}: the init held {tracker.peak} B at once (> {BOUND_BYTES} B: one {TILE}x{TILE} "
                f"tile and trunc_normal_'s temporaries): it materialised more than a tile at a time")
            assert tracker.drawn <= own_tiles < drawn_full, (
                f"{name} rank {rank}: drew {tracker.drawn} numbers; its shard, rounded out to whole tiles, has "
                f"{own_tiles} (the whole model: {drawn_full}): not its own shard")
        finally:
            dist.destroy_process_group()
            # DTensor's sharding-propagation caches key meshes by shape and names, not rank: the next
            # rank in this process would get this rank's mesh objects (and coordinates) back.
            _clear_sharding_prop_cache()
