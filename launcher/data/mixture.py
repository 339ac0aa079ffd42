"""Which source each sample of a mixture comes from: deterministic, exact to within one sample.

Sample t (1-based, counted since the weights took effect) goes to a source so that after every
sample, hence after every step, each source's count c_i stays strictly within one sample of
w_i * t. Seen as scheduling, source i's j-th sample must land at a time t with
(j - 1) / w_i < t < j / w_i; earliest-deadline-first (among the sources whose next sample is
due, w_i * t > c_i, take the one whose deadline j / w_i comes first; ties: the lower index)
meets every such window whenever any schedule can, and Tijdeman's chairman-assignment theorem
says one can (the bound 1 - 1/(2k - 2) is attainable). The simpler "largest deficit" rule does
not: with 7 sources it drifts past 1.19 samples.

Weights are exact fractions of the decimal the user wrote (0.7 is 7/10), so the comparisons are
integer arithmetic: identical on every rank and machine, at any sample count. The assignment of
a whole global batch is computed on every rank (O(global batch x sources) per step) and each
data-parallel rank takes its slice, so the stream does not depend on the layout.

The state is the count drawn from each source ever (its read position) plus the counts and the
total when the current weights took effect. The checkpoint stores it; resuming with other
weights starts a new segment at the stored counts, so the new shares hold from the resume on
(no source is starved to "catch up" with the old weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Dict, List, Sequence, Tuple


def exact_weights(weights: Sequence[float]) -> Tuple[List[int], int]:
    """(numerators, denominator) of the normalised weights, from each weight's shortest decimal."""
    fracs = [Fraction(repr(float(w))) for w in weights]
    total = sum(fracs)
    if not fracs or any(f <= 0 for f in fracs) or total <= 0:
        raise ValueError(f"mixture weights must all be > 0, got {list(weights)}. Fix: give every source a positive weight.")
    shares = [f / total for f in fracs]
    denominator = 1
    for s in shares:
        denominator = denominator * s.denominator // _gcd(denominator, s.denominator)
    return [int(s * denominator) for s in shares], denominator


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@dataclass
class MixtureState:
    """Read positions of a mixture and the segment of the current weights."""

    names: List[str]
    weights: List[float]
    counts: List[int]  # samples drawn from each source since the run began (its read position)
    base: List[int] = field(default_factory=list)  # counts when the current weights took effect
    _num: List[int] = field(default_factory=list, repr=False)
    _den: int = field(default=1, repr=False)

    def __post_init__(self):
        if not self.base:
            self.base = list(self.counts)
        self._num, self._den = exact_weights(self.weights)

    @classmethod
    def fresh(cls, names: Sequence[str], weights: Sequence[float]) -> "MixtureState":
        return cls(list(names), [float(w) for w in weights], [0] * len(names))

    def copy(self) -> "MixtureState":
        return MixtureState(list(self.names), list(self.weights), list(self.counts), list(self.base))

    @property
    def total(self) -> int:
        return sum(self.counts)

    def assign(self, n: int) -> Tuple[List[int], List[int]]:
        """The next `n` samples: (source of each, that source's read position for it); advances."""
        num, den = self._num, self._den
        k = len(num)
        drawn = [c - b for c, b in zip(self.counts, self.base)]  # in this segment
        t = sum(drawn)
        sources, positions = [], []
        for _ in range(n):
            t += 1
            best = -1
            for i in range(k):
                # due: w_i * t > drawn_i; deadline (drawn_i + 1) / w_i, compared by cross-multiplying
                if num[i] * t > drawn[i] * den and (
                        best < 0 or (drawn[i] + 1) * num[best] < (drawn[best] + 1) * num[i]):
                    best = i
            sources.append(best)
            positions.append(self.counts[best])
            drawn[best] += 1
            self.counts[best] += 1
        return sources, positions

    def to_dict(self) -> Dict[str, object]:
        return {"names": list(self.names), "weights": list(self.weights), "counts": list(self.counts),
                "base": list(self.base)}

    @classmethod
    def resumed(cls, stored: Dict[str, object], names: Sequence[str],
                weights: Sequence[float]) -> Tuple["MixtureState", List[str]]:
        """The state to continue from a checkpoint's `stored` state with this run's sources and
        weights, plus what changed (for a warning): the counts carry over by source name; other
        weights or sources start a new segment at the stored counts."""
        old_names = list(stored["names"])
        old = dict(zip(old_names, stored["counts"]))
        counts = [int(old.get(name, 0)) for name in names]
        notes = []
        same = old_names == list(names) and [float(w) for w in stored["weights"]] == [float(w) for w in weights]
        if same:
            return cls(list(names), [float(w) for w in weights], counts, [int(b) for b in stored["base"]]), notes
        old_w = dict(zip(old_names, stored["weights"]))
        for name, w in zip(names, weights):
            if name not in old:
                notes.append(f"{name}: new source (weight {w:g}), read from its start")
            elif float(old_w[name]) != float(w):
                notes.append(f"{name}: weight {float(old_w[name]):g} -> {w:g}")
        for name in old_names:
            if name not in names:
                notes.append(f"{name}: dropped from the mix (it had drawn {old[name]} samples)")
        return cls(list(names), [float(w) for w in weights], counts, list(counts)), notes
