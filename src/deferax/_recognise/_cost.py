"""Whether rewriting a call pays: "never slower", decided by cost as the schedules are.

The original call factors the matrix `F` times per value and gradient and makes `R` host
round trips; the rewritten one factors once, and a host site costs a round trip per stage
(two on the standard schedule, the most it gets). With `t` one factorisation's time and
`S` a round trip's (`_plan._cost.STAGE_SECONDS`):

    original   = F * t + R * S
    rewritten  = t + 2 * S

and the call is rewritten only when `rewritten < original`. `t` is measured once per
pattern (`_sparse/_solver.py: trial_seconds`: SuperLU on random values with a dominant diagonal;
not needed when `R >= 2` and `F >= 2`: then the rewrite always pays).
"""

from __future__ import annotations

from .._plan import _cost
from .._sparse._solver import trial_seconds


def refusal(recognition, complex_: bool) -> str | None:
    """Why rewriting the call would not pay (None when it would)."""
    f, r, s = recognition.factorisations, recognition.round_trips, _cost.STAGE_SECONDS
    if f >= 2 and r >= 2:
        return None
    t = trial_seconds(recognition.pattern, complex_)
    if t is None:
        return "a trial factorisation of its pattern failed (the pattern is structurally singular)"
    if t + 2 * s < f * t + r * s:
        return None
    return (
        f"left in place by cost: one factorisation takes about {_ms(t)} here, so the {f - 1} it saves "
        f'cannot pay for a host site\'s round trips (about {_ms(s)} each); `recognise="always"` '
        "rewrites it anyway"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2g} ms"
