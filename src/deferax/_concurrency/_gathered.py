"""The state of the one callback that gathers several sites under `jit` (`_stages.stage2`).

While the sites' shapes are traced, each site's halves made from `fwd` and `bwd` are
traced and kept by slot in a dict (`preparing`); the callback then runs them as they were
traced (`running_prepared`)."""

from __future__ import annotations

from typing import Any

from .. import _jaxpr, _runtime

_PREPARING = _runtime.PREPARING
_PREPARED = _runtime.PREPARED


def preparing(prepared: dict):
    """Inside: the halves traced here for made-from-`fwd`-and-`bwd` sites are kept in `prepared`."""
    return _jaxpr.setting(_PREPARING, prepared)


def keep(index: int, halves: Any) -> None:
    """Keep the traced `halves` of slot `index`, when preparing (a second call of one slot
    cannot run from the gathered callback: then None)."""
    prepared = _PREPARING.get()
    if prepared is not None:
        prepared[index] = None if index in prepared else halves


def all_runnable(prepared: dict) -> bool:
    """Whether every half kept in `prepared` can run from the gathered callback: traced once
    for its site, and closing over no value of the surrounding trace."""
    return all(h is not None and not h[0].consts and not h[1].consts for h in prepared.values())


def running_prepared(prepared: dict):
    """Inside (the gathered callback): the halves kept in `prepared` run as they were traced."""
    return _jaxpr.setting(_PREPARED, prepared)


def prepared_halves(index: int) -> Any:
    """The halves traced for slot `index`, inside the gathered callback; None elsewhere."""
    prepared = _PREPARED.get()
    return None if prepared is None else prepared.get(index)
