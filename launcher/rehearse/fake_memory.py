"""Where the rehearsal's fake step would see other memory than a real step, and the corrections.

    with fake_step_as_real():
        measured = track_step_memory(engine.model_parts, engine.optimizers, step)

The rehearsal (launcher/rehearse/rank.py) runs the rank's real step on fake tensors under
its own FakeTensorMode, on a fake process group, and tracks it with torch's MemTracker. Two
things then differ from a real run (found op by op with bench/rehearse_activations.py --multi;
numbers in docs/notes/2026-11-rehearsal-findings.md), and both are corrected here, for the
tracked step only:

1. DTensor's sharding propagation (tensor parallelism, loss parallel). For every DTensor op
   torch runs the op once more on fake tensors of the *global* shapes to learn the output's
   shape and stride (``ShardingPropagator._propagate_tensor_meta_non_cached``: ``fake_mode =
   detect_fake_mode() or FakeTensorMode()``). In a real run no fake mode is active: it uses a
   private one, and MemTracker skips ops run under a fake mode other than the one active when
   tracking began. In the rehearsal the rank's own fake mode is active, ``detect_fake_mode()``
   returns it, and MemTracker counts the propagation's global-shape tensors as activations
   (forward) and temporaries (backward); a fake mode also makes torch believe it is tracing
   (``_are_we_tracing()``), so it skips its propagation cache and this happens for every
   DTensor op. The largest are loss parallel's: the global [tokens, vocab] fp32 log-softmax
   input and output at the end of the forward (the activation peak) and nll_loss_backward's
   global [tokens, vocab] gradient. No real run, GPU or CPU, allocates them.
   Correction: the propagation runs under a FakeTensorMode of its own, as in a real run.

2. Pipeline sends. A real process group's Work (gloo's, and NCCL's, whose WorkNCCL keeps its
   tensors in ``outputs_``) holds the tensors it sends or receives for as long as the Work
   object lives, and torch's schedules keep some Works after waiting on them: 1F1B keeps the
   first stage's first forward send in ``send_work`` until its cool-down, the looped
   schedules (interleaved 1F1B, zero bubble, ...) keep every send's Work in ``send_ops`` until
   the end of the step. So a stage output whose backward is done stays allocated until then.
   The fake group's Work holds nothing, so the rehearsal freed it at once.
   Correction: the schedules' Works are wrapped so that they hold their ops' tensors.

Private torch APIs: where one is missing, that correction is skipped (measured as before).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, List

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import schedules


@contextmanager
def sharding_propagation_apart() -> Iterator[None]:
    """Run DTensor's shape propagation under a private FakeTensorMode while the block runs
    (the rank's own fake mode stays active for everything else)."""
    try:
        # lazy: a private torch module, tried here so that where it moved this correction is skipped
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover - torch without DTensor
        yield
        return
    original = ShardingPropagator.__dict__.get("_propagate_tensor_meta_non_cached")
    if original is None:  # pragma: no cover - torch moved it: measure as before
        yield
        return
    own = FakeTensorMode()  # one private mode for the whole block, like torch's fallback

    @functools.wraps(original)
    def apart(self, op_schema):
        # Entering a fake mode other than the active one replaces it until the block exits;
        # inside, torch's detect_fake_mode() finds `own` and uses it.
        with own:
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = apart
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


class HeldWork:
    """A fake group's Work that also holds the tensors of its P2P ops, as a real Work does."""

    __slots__ = ("work", "tensors")

    def __init__(self, work: Any, tensors: List[Any]) -> None:
        self.work = work
        self.tensors = tensors

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


@contextmanager
def p2p_works_hold_tensors() -> Iterator[None]:
    """While the block runs, the Works torch's pipeline schedules get from their P2P batches
    (``schedules._batch_p2p``, which ``_sorted_batch_p2p`` calls too) hold the ops' tensors."""
    original = getattr(schedules, "_batch_p2p", None)
    if original is None:  # pragma: no cover - torch moved it: measure as before
        yield
        return

    @functools.wraps(original)
    def holding(p2p_ops, *args, **kwargs):
        works = original(p2p_ops, *args, **kwargs)
        tensors = [op.tensor for op in p2p_ops]
        return [HeldWork(w, tensors) for w in works]

    schedules._batch_p2p = holding
    try:
        yield
    finally:
        schedules._batch_p2p = original


@contextmanager
def fake_step_as_real() -> Iterator[None]:
    """Both corrections, for the rehearsal's tracked fake step."""
    with ExitStack() as stack:
        stack.enter_context(sharding_propagation_apart())
        stack.enter_context(p2p_works_hold_tensors())
        yield
