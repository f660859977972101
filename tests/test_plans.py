"""Plans that must not wander: a site's timings are its own (not its name's), settling them
recompiles only the programs that contain the site, a plan changes at most once (also
under `vmap`), a `linear_adjoint` site is planned by the cost model, and `dx.Cost` checks
its `workers`."""

import re

import numpy as np
import pytest

import deferax as dx

# ----------------------------------------------------------------------------- `dx.Cost(workers=...)`


@pytest.mark.parametrize("workers", [2.5, True, 2.0, "2"])
def test_error_cost_workers_not_a_positive_int(workers):
    message = (
        f"`dx.Cost`: `workers` must be a positive int or None (taken from the executor), but got {workers!r}.\n"
        "Give seconds"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        dx.Cost(workers=workers)


def test_cost_workers_takes_a_numpy_int():
    assert dx.Cost(workers=np.int64(3)).workers == 3
