"""A real inverse-design problem: Google's ceviche-challenges (the waveguide bend and the
mode converter at invrs-gym's lightweight size), as `examples/inverse_design_ceviche.py`
writes it (the FDFD system assembled in JAX, solved by `dx.sparse_solve`), against the
challenge's own path: ceviche's `simulate` and the same loss, differentiated by autograd.
Counts the factorisations and solves of each step."""

import collections
import gc
import threading

import autograd  # with ceviche-challenges, in the tests extra
import autograd.numpy as npa
import jax
import numpy as np
import pytest

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import assert_tree_allclose, load_example

EXAMPLE = load_example("inverse_design_ceviche")


@pytest.fixture(scope="module", autouse=True)
def standard_promotion():
    """The example is written for JAX's default dtype promotion (the other tests run strict)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module", params=["waveguide_bend", "mode_converter"])
def problem(request):
    """The challenge's model, the example's loss, a random design, and the challenge's own
    value and gradient at it (ceviche's FDFD and port amplitudes, autograd's adjoint)."""
    model = EXAMPLE.challenge(request.param)
    design = np.random.default_rng(0).uniform(0.0, 1.0, model.design_variable_shape)
    expected = autograd.value_and_grad(lambda d: EXAMPLE.window_loss(model.simulate(d)[0], npa))(design)
    return model, EXAMPLE.make_loss(model), design, expected


class Tally:
    """Factorisations and solve calls of the default solver (`dx.AutoSparseSolver`, whichever
    solver it hands them to), as `dx.sparse_solve` runs them."""

    def __init__(self, monkeypatch):
        self.counts = collections.Counter()
        self.lock = threading.Lock()
        factor, solve = dx.AutoSparseSolver.factor, dx.AutoSparseSolver.solve

        def counted(name, fn):
            def run(*args):
                with self.lock:
                    self.counts[name] += 1
                return fn(*args)

            return run

        monkeypatch.setattr(dx.AutoSparseSolver, "factor", counted("factor", factor))
        monkeypatch.setattr(dx.AutoSparseSolver, "solve", counted("solve", solve))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_value_and_gradient_equal_the_challenge_s_own(problem, jit, monkeypatch):
    """No schedule options: the value and gradient of the challenge's own autograd path, and
    one factorisation per wavelength (the adjoint solve reuses the forward's)."""
    model, loss, design, expected = problem
    step = dx.filter_value_and_grad(loss)
    if jit:
        step = jax.jit(step)
        jax.block_until_ready(step(design))  # compiled
    tally = Tally(monkeypatch)
    _factorisations.FACTORISATIONS.clear()  # none kept by the compiling call
    with dx.record() as timeline:
        got = jax.block_until_ready(step(design))
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-9 * float(np.max(np.abs(expected[1]))))
    wavelengths = len(model.output_wavelengths)
    assert tally.counts == {"factor": wavelengths, "solve": 2 * wavelengths}  # forward and adjoint
    deferred = {site.schedule for site in dx.explain(loss, design).sites} != {"standard"}
    assert timeline.counts() == ({"fused_batch": wavelengths} if deferred else {"fwd": wavelengths, "bwd": wavelengths})
    gc.collect()  # (eagerly, kept until the forward's output is collected: a cycle on jax 0.12)
    assert len(_factorisations.FACTORISATIONS) == 0  # none left behind


def test_plan_names_the_user_s_line(problem):
    """Each wavelength's loss sees the field through three complex amplitudes (k = 6); a site
    that is not deferred says why at a line of the example, not of a library."""
    _, loss, design, _ = problem
    plan = dx.explain(loss, design)
    assert [site.name for site in plan.sites] == ["sparse_solve", "sparse_solve"]
    for site in plan.sites:
        assert site.k == 6
        if site.schedule == "standard":
            assert "examples/inverse_design_ceviche.py:" in site.reason and "site-packages" not in site.reason


def test_the_example_improves_the_bend():
    """Three Adam steps of the example lower the bend's loss."""
    losses, design = EXAMPLE.optimise(EXAMPLE.challenge("waveguide_bend"), steps=3, verbose=False)
    assert losses[-1] < losses[0] and design.shape == (40, 40)
