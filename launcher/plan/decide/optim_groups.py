"""Which optimizer, learning rate and weight decay each parameter gets: `optim.groups` and the
defaults of `optim.name`, decided once on canonical parameter names and full shapes.

Pure Python (names and shapes in, choices out): the engine builds its optimizer groups from it,
the launch checks it before any rank starts (`launcher/launch/preflight.py`) and `action=plan`
prints its counts and bytes. docs/optimizers.md describes the rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from launcher.models.param_list import trainable_parameters
from launcher.plan.estimate.muon import WITH_EMBEDDING, WITH_OUTPUT

# AdamW under optim=muon whatever their shape: the input embedding, the output head and the MoE
# router's weight (Muon is for hidden matrices; the router's rows are per-expert logits).
ADAMW_BY_DEFAULT = re.compile(r"(^|\.)(tok_embeddings|output|router)\.")


@dataclass(frozen=True)
class GroupChoice:
    """One optimizer group: who made it, its optimizer and hyper-parameters."""

    label: str  # "optim.groups[0] 'regex'" or "default muon" / "default adamw" / "default adamw, no decay"
    optimizer: str  # adamw | muon
    lr: float
    weight_decay: float


@dataclass(frozen=True)
class Assignment:
    """Every parameter's group (index into `groups`), with the problems found."""

    groups: Tuple[GroupChoice, ...]
    members: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (canonical name, full shape, group index)
    problems: Tuple[str, ...]

    def by_group(self) -> Dict[int, List[Tuple[str, Tuple[int, ...]]]]:
        """group index -> its (name, shape) members, in model order."""
        out: Dict[int, List[Tuple[str, Tuple[int, ...]]]] = {}
        for name, shape, g in self.members:
            out.setdefault(g, []).append((name, shape))
        return out


def uses_groups(optim) -> bool:
    """Whether `optim` needs the grouped optimizer (Muon with AdamW): optim=muon or any optim.groups.
    Otherwise the engines build plain AdamW, as before Muon."""
    return optim.name == "muon" or bool(getattr(optim, "groups", None))


def has_muon(optim) -> bool:
    """Whether some parameter may get Muon: optim=muon, or a group with optimizer muon."""
    return optim.name == "muon" or any(g.optimizer == "muon" for g in getattr(optim, "groups", ()) or ())


def is_muon_matrix(shape: Sequence[int]) -> bool:
    """A 2-D matrix, or a 3-D stack of expert matrices (E separate (out, in) matrices)."""
    return len(shape) in (2, 3)


def matrices(shape: Sequence[int]) -> List[Tuple[int, int]]:
    """The (rows, cols) of each matrix Muon orthogonalises in a parameter of this full shape."""
    if len(shape) == 2:
        return [(int(shape[0]), int(shape[1]))]
    return [(int(shape[1]), int(shape[2]))] * int(shape[0])


def assign_groups(params: Sequence[Tuple[str, Sequence[int]]], optim) -> Assignment:
    """Assign each (canonical name, full shape) to a group: the first `optim.groups` entry whose
    `match` finds the name (re.search), else the default of `optim.name` (adamw: every parameter;
    muon: Muon for hidden matrices, AdamW for embeddings, head, router and 1-D parameters).
    AdamW's default weight decay skips 1-D parameters (norm gains), as it always has."""
    muon_cfg = getattr(optim, "muon", None)
    groups: List[GroupChoice] = []
    index: Dict[GroupChoice, int] = {}
    problems: List[str] = []
    hits = [0] * len(optim.groups)
    non_matrix: Dict[int, List[Tuple[str, Tuple[int, ...]]]] = {}

    def pick(choice: GroupChoice) -> int:
        if choice not in index:
            index[choice] = len(groups)
            groups.append(choice)
        return index[choice]

    def default_lr_wd(kind: str, ndim: int) -> Tuple[float, float]:
        if kind == "muon":
            return float(muon_cfg.lr), float(muon_cfg.weight_decay)
        return float(optim.lr), float(optim.weight_decay) if ndim >= 2 else 0.0

    members = []
    for name, shape in params:
        shape = tuple(int(d) for d in shape)
        chosen = None
        for i, g in enumerate(optim.groups):
            if re.search(g.match, name):
                hits[i] += 1
                lr, wd = default_lr_wd(g.optimizer, len(shape))
                lr = lr if g.lr is None else float(g.lr)
                wd = wd if g.weight_decay is None else float(g.weight_decay)
                if g.optimizer == "muon" and not is_muon_matrix(shape):
                    non_matrix.setdefault(i, []).append((name, shape))
                chosen = pick(GroupChoice(f"optim.groups[{i}] '{g.match}'", g.optimizer, lr, wd))
                break
        if chosen is None:
            kind = ("muon" if optim.name == "muon" and is_muon_matrix(shape) and not ADAMW_BY_DEFAULT.search(name)
                    else "adamw")
            lr, wd = default_lr_wd(kind, len(shape))
            label = f"default {kind}" + (", no decay" if kind == "adamw" and wd == 0.0 and len(shape) < 2 else "")
            chosen = pick(GroupChoice(label, kind, lr, wd))
        members.append((name, shape, chosen))
    for i, caught in non_matrix.items():
        g = optim.groups[i]
        name, shape = caught[0]
        problems.append(
            f"optim.groups[{i}] (match {g.match!r}, optimizer muon) catches {len(caught)} parameter(s) that are not "
            f"matrices, e.g. {name} of shape {list(shape)}: Muon orthogonalises 2-D matrices (or 3-D expert stacks) "
            f"only. Fix: narrow the pattern (e.g. end it with '\\.weight$' and leave out norms), or put an adamw "
            f"group for them first.")
    for i, (g, n) in enumerate(zip(optim.groups, hits)):
        if n == 0:
            problems.append(f"optim.groups[{i}] (match {g.match!r}) matches none of the model's {len(params)} parameters. "
                            f"Fix: match canonical names such as {', '.join(_examples(params))} "
                            f"(`train ... optim=muon action=plan` lists the groups), or remove the entry.")
    return Assignment(tuple(groups), tuple(members), tuple(problems))


def _examples(params: Sequence[Tuple[str, Sequence[int]]]) -> List[str]:
    names = [n for n, _ in params]
    picks = [n for n in names if ".0." in n][:3] or names[:3]
    return [repr(n) for n in picks + names[-1:]]


def render_groups(assignment: Assignment, bytes_per_element: int = 4) -> str:
    """The `action=plan` table: per group its optimizer, lr, weight decay, parameter count and
    bytes (fp32 master parameters), and for Muon the matrices it orthogonalises."""
    lines = ["optimizer groups (canonical names, first match wins):"]
    members = assignment.by_group()
    for i, g in enumerate(assignment.groups):
        ps = members.get(i, [])
        numel = sum(math.prod(s) for _, s in ps)
        extra = f", {sum(len(matrices(s)) for _, s in ps)} matrices" if g.optimizer == "muon" else ""
        lines.append(f"  {g.label:<32} {g.optimizer:<5} lr={g.lr:g} wd={g.weight_decay:g}: {len(ps)} tensors, "
                     f"{numel:,} parameters, {numel * bytes_per_element / 2**20:.2f} MiB{extra}")
    return "\n".join(lines)


_LAYER = re.compile(r"^layers\.(\d+)\.")
# Matrices tensor parallelism leaves whole on every rank ("whole" below): an MoE block's router and
# shared experts (launcher/parallel/tp.py), MLA's down-projections (launcher/models/deepseek_v3/tp.py;
# their Linear(split=False) in launcher/models/deepseek_v3/params.py).
TP_WHOLE = (".moe.router.", ".moe.shared_experts.", ".attention.wq_a.", ".attention.wkv_a.")


def muon_matrices(params: Sequence[Tuple[str, Sequence[int]]], optim) -> Tuple[Tuple[int, int, str, int, int, int], ...]:
    """The Muon matrices of a model (its (canonical name, full shape) list) under `optim`'s groups,
    compact for the Layout and plan.json: rows (first block, last block, kind, rows, cols, matrices
    per block), consecutive blocks with the same matrices in one row, in model order; block
    WITH_EMBEDDING / WITH_OUTPUT for the tables. Empty when no parameter gets Muon (or the groups
    have problems: those stop the launch, reported by `assign_groups`' callers)."""
    if not uses_groups(optim):
        return ()
    a = assign_groups(params, optim)
    if a.problems:
        return ()
    per_block: Dict[int, List[Tuple[str, int, int, int]]] = {}
    order: List[int] = []
    for name, shape, g in a.members:
        if a.groups[g].optimizer != "muon":
            continue
        m = _LAYER.match(name)
        block = int(m.group(1)) if m else (WITH_EMBEDDING if name.startswith("tok_embeddings.") else WITH_OUTPUT)
        kind = ("experts" if len(shape) == 3 else
                "whole" if any(part in name for part in TP_WHOLE) else "split")
        rows, cols = matrices(shape)[0]
        if block not in per_block:
            order.append(block)
        per_block.setdefault(block, []).append((kind, rows, cols, len(matrices(shape))))
    out: List[Tuple[int, int, str, int, int, int]] = []
    runs: List[Tuple[int, int, List[Tuple[str, int, int, int]]]] = []
    for block in order:
        mats = per_block[block]
        if runs and block >= 0 and runs[-1][0] >= 0 and runs[-1][1] == block - 1 and runs[-1][2] == mats:
            runs[-1] = (runs[-1][0], block, mats)
        else:
            runs.append((block, block, mats))
    for first, last, mats in runs:
        out += [(first, last, kind, r, c, n) for kind, r, c, n in mats]
    return tuple(out)


def model_group_assignment(model, optim) -> Assignment:
    """The groups of `optim` over the parameters of ModelConfig `model`, listed without torch
    (launcher/models/param_list.py): what the launch checks and `action=plan` prints."""
    return assign_groups(trainable_parameters(model), optim)


def _patterns_compile(optim) -> bool:
    """Whether every optim.groups pattern is a regular expression (launcher/config/validate.py
    reports the others, exit 2, before anything runs)."""
    try:
        for g in optim.groups:
            re.compile(g.match)
    except re.error:
        return False
    return True


def model_group_problems(model, optim) -> List[str]:
    """optim.groups' problems over the parameters of ModelConfig `model` (a pattern that matches
    nothing, Muon on a non-matrix), found before any rank starts, for every action; [] without
    groups or while a pattern does not compile."""
    if not uses_groups(optim) or not _patterns_compile(optim):
        return []
    return list(model_group_assignment(model, optim).problems)


def model_muon_matrices(model, optim) -> Tuple[Tuple[int, int, str, int, int, int], ...]:
    """`muon_matrices` of ModelConfig `model` (its parameters listed without torch:
    launcher/models/param_list.py); () at once when `optim` puts nothing under Muon."""
    if not has_muon(optim) or not _patterns_compile(optim):
        return ()
    return muon_matrices(trainable_parameters(model), optim)
