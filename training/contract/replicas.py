"""The value a rank publishes for a replica check (``rankscope_replica_fingerprint``), as the
rules and the console read it back: ``(step mod 2**STEP_BITS) * 2**FINGERPRINT_BITS + fold``.

One float holds the check's step and the fingerprint (the 64-bit sum of the replicated tensors'
bits, folded to FINGERPRINT_BITS), so that one scrape never pairs a step with another check's
sum, and two ranks agree on a check exactly when their values are equal. 26 + 27 bits stay
exact in a float64. The rules divide by ``STEP_UNIT`` (prometheus/rules_spec.py).
"""

from __future__ import annotations

FINGERPRINT_BITS = 26
STEP_BITS = 27                   # 2**27 steps before the step wraps (equality is all that is compared)
STEP_UNIT = 1 << FINGERPRINT_BITS
_FOLD_MASK = STEP_UNIT - 1


def encode(step: int, total: int) -> float:
    """One published value: the check's step and the 64-bit sum folded to FINGERPRINT_BITS."""
    x = total & 0xFFFF_FFFF_FFFF_FFFF
    folded = (x ^ (x >> FINGERPRINT_BITS) ^ (x >> 2 * FINGERPRINT_BITS)) & _FOLD_MASK
    return float(((step % (1 << STEP_BITS)) << FINGERPRINT_BITS) | folded)


def step_of(value: float) -> int:
    """The (wrapped) step of a published value."""
    return int(value) >> FINGERPRINT_BITS
