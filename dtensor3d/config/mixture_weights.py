"""A mixture's weights as whole numbers of samples per block (datasets/mixture.py draws each
block of B = sum(counts) samples with exactly counts[k] from source k).

Every positive weight gets its share:

1. Exact where a block can hold it: each weight read as the fraction it is (a decimal such
   as 0.0001 is 1/10000, a float such as 1/3 is 1/3: the nearest fraction of denominator
   <= MAX_BLOCK, kept when it equals the weight to 1e-12), all scaled to whole numbers and
   divided by their common factor: 0.7 / 0.2 / 0.1 -> 7 / 2 / 1, 0.0001 / 0.9999 -> 1 / 9999.
   Kept when the block is at most MAX_BLOCK samples.
2. Else the smallest block found that gives every source its share to within REL_TOL of its
   weight (relative: a share of 1e-4 becomes 1e-4 +- 1e-7), scaling the shares up one sample
   at a time (counts = max(1, round(share * S)) for S = 1, 2, ...; `_approximate` skips the
   scales at which the smallest share cannot be honoured).
3. Else (a share below about 1 / MAX_BLOCK, or tiny shares that no block of MAX_BLOCK can
   tell apart) the weights cannot be honoured: `weights_problem` names the source and the
   smallest weight that can be.

Pure Python: the door (config/checks.py) and the sampler share it.
"""

from __future__ import annotations

import math
from fractions import Fraction

MAX_BLOCK = 1_000_000  # samples per block at most: a keyed permutation of the block costs no memory
REL_TOL = 1e-3  # a share honoured approximately (step 2) is within 0.1% of the weight's
EXACT_TOL = 1e-12  # a weight equals a fraction when they differ by this, relatively (float rounding)


def _exact(weights: list[float]) -> list[int] | None:
    """Step 1, or None where it would need a block of more than MAX_BLOCK samples."""
    fractions = [Fraction(w).limit_denominator(MAX_BLOCK) for w in weights]
    if any(f <= 0 or abs(float(f) - w) > EXACT_TOL * w for f, w in zip(fractions, weights)):
        return None
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    common = math.gcd(*ints)
    ints = [n // common for n in ints]
    return ints if sum(ints) <= MAX_BLOCK else None


def _honours(counts: list[int], shares: list[float]) -> bool:
    block = sum(counts)
    return all(abs(c / block - p) <= REL_TOL * p for c, p in zip(counts, shares))


def _approximate(weights: list[float]) -> list[int] | None:
    """Step 2, or None when no block of at most MAX_BLOCK samples honours every share. Only
    the scales S that can honour the smallest share p are tried: its count c = 1, 2, ... needs
    a block within c / (p (1 +- REL_TOL)), and a block differs from S by less than the count
    of sources."""
    total = math.fsum(weights)
    shares = [w / total for w in weights]
    p, margin, tried = min(shares), len(shares), 0
    for c in range(1, MAX_BLOCK + 1):
        lo = max(tried + 1, math.floor(c / (p * (1 + REL_TOL))) - margin, 1)
        hi = min(math.ceil(c / (p * (1 - REL_TOL))) + margin, MAX_BLOCK)
        if lo > MAX_BLOCK:
            return None
        for scale in range(lo, hi + 1):
            counts = [max(1, round(q * scale)) for q in shares]
            if sum(counts) <= MAX_BLOCK and _honours(counts, shares):
                return counts
        tried = max(tried, hi)
    return None


def integer_weights(weights: list[float]) -> list[int] | None:
    """The samples of each source in a block (module docstring); None where the weights
    cannot be honoured (`weights_problem` says why)."""
    return _exact(weights) or _approximate(weights)


def _round_up(x: float) -> float:
    """x rounded up to 2 significant digits."""
    unit = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / unit * (1 - 1e-12)) * unit


def smallest_weight(weights: list[float], k: int) -> float:
    """About the smallest weight source k could have, the others unchanged, that a block
    honours: a share of 1 / MAX_BLOCK, raised until it is honoured (2 significant digits)."""
    bound = (math.fsum(weights) - weights[k]) / (MAX_BLOCK - 1)
    for factor in (1, 2, 5, 10, 20, 50, 100, 200, 500):
        w = float(f"{_round_up(bound * factor):.2g}")
        if integer_weights([*weights[:k], w, *weights[k + 1 :]]) is not None:
            return w
    return float(f"{_round_up(bound * 1000):.2g}")


def weights_problem(where: str, sources) -> str | None:
    """None when the mixture's weights can be honoured, else the line naming the smallest
    share's source, its weight and the smallest weight that can be honoured."""
    weights = [s.weight for s in sources]
    if integer_weights(weights) is not None:
        return None
    k = min(range(len(weights)), key=lambda i: weights[i])
    share = weights[k] / math.fsum(weights)
    return (
        f"{where}[{k}].weight={weights[k]:g} (source {sources[k].name!r}) is a share of {share:.3g} of the mixture; "
        f"no block of at most {MAX_BLOCK:,} samples gives every source its share to within {REL_TOL:.1%}: the "
        f"smallest weight that can be honoured there is {smallest_weight(weights, k):g} (or drop the source)"
    )
