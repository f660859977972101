"""A real third-party program: a tiny fdtdx simulation (a JAX FDTD library for photonic
inverse design) in a loss, with no site and wrapped as an `ExpensiveFn`, against Equinox
and plain JAX."""

import re

import equinox as eqx
import fdtdx  # in the tests extra
import jax
import jax.numpy as jnp
import pytest

import deferax as dx

from .helpers import assert_tree_allclose


@pytest.fixture(scope="module", autouse=True)
def standard_promotion():
    """fdtdx is written for JAX's default dtype promotion (the other tests run strict)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


# The flux is about 1e-14 W in SI units: scaled to order one, so that tolerances mean something.
SCALE = 1e14


def build(method: str):
    """A 20 x 20 x 1 cell periodic 2D domain, 210 time steps: a dipole source, a 6 x 4 cell
    design region (permittivity between 1 and 4) and a Poynting flux detector across the
    domain. `method`: fdtdx's gradient, "checkpointed" (JAX autodiff through a
    checkpointed loop) or "reversible" (its time-reversal `custom_vjp`)."""
    config = fdtdx.SimulationConfig(
        time=20e-15, grid=fdtdx.UniformGrid(spacing=50e-9), backend="cpu", dtype=jnp.float64
    )
    if method == "checkpointed":
        gradient = fdtdx.GradientConfig(method="checkpointed", num_checkpoints=10)
    else:
        gradient = fdtdx.GradientConfig(method="reversible", recorder=fdtdx.Recorder(modules=[]))
    config = config.aset("gradient_config", gradient)
    volume = fdtdx.SimulationVolume(partial_grid_shape=(20, 20, 1))
    bounds, constraints = fdtdx.boundary_objects_from_config(
        fdtdx.BoundaryConfig.from_uniform_bound(boundary_type="periodic"), volume
    )
    source = fdtdx.PointDipoleSource(
        partial_grid_shape=(1, 1, 1), polarization=2, wave_character=fdtdx.WaveCharacter(wavelength=500e-9)
    )
    device = fdtdx.Device(
        name="design",
        partial_grid_shape=(6, 4, 1),
        partial_voxel_grid_shape=(1, 1, 1),
        materials={"air": fdtdx.Material(permittivity=1.0), "dielectric": fdtdx.Material(permittivity=4.0)},
        param_transforms=[],
    )
    flux = fdtdx.PoyntingFluxDetector(
        name="flux", partial_grid_shape=(None, 1, None), direction="+", fixed_propagation_axis=1, plot=False
    )
    constraints = [
        *constraints,
        source.place_relative_to(
            volume, axes=(0, 1, 2), own_positions=(0, -1, 0), other_positions=(0, -1, 0), grid_margins=(0, 5, 0)
        ),
        device.place_at_center(volume, axes=(0, 1, 2)),
        flux.place_relative_to(volume, axes=1, own_positions=1, other_positions=1, grid_margins=-5),
    ]
    objects, arrays, params, config, _ = fdtdx.place_objects(
        [volume, *bounds.values(), source, device, flux],
        config=config,
        constraints=constraints,
        key=jax.random.PRNGKey(0),
    )
    key = jax.random.PRNGKey(1)

    def simulate(params):
        """The flux through the detector at each time step, shape (210, 1)."""
        a, placed, _ = fdtdx.apply_params(arrays, objects, params, key)
        _, a = fdtdx.run_fdtd(arrays=a, objects=placed, config=config, key=key, show_progress=False)
        return SCALE * a.detector_states["flux"]["poynting_flux"].astype(jnp.float64)

    return simulate, params


def weighted(flux):
    """The linear loss: a weighted sum of the detector's time series."""
    return jnp.sum(jnp.linspace(0.0, 1.0, flux.shape[0])[:, None] * flux)


def vjp_site(simulate, counter):
    """The simulation as an `ExpensiveFn`: `fwd` the simulation, `bwd` and `fused` through
    `jax.vjp` of it (fdtdx's own gradient inside)."""

    def fwd(params):
        counter.tick("fwd")
        return simulate(params)

    def bwd(params, flux, ct):
        counter.tick("bwd")
        return jax.vjp(simulate, params)[1](ct)[0]

    def fused(params, ct):
        counter.tick("fused")
        flux, pull = jax.vjp(simulate, params)
        return flux, pull(ct)[0]

    return dx.ExpensiveFn(fwd=fwd, bwd=bwd, fused=fused, name="fdtdx")


@pytest.fixture(scope="module")
def checkpointed():
    simulate, params = build("checkpointed")
    loss = lambda p: weighted(simulate(p))  # noqa: E731
    expected = jax.jit(jax.value_and_grad(loss))(params)
    assert_tree_allclose(eqx.filter_jit(eqx.filter_value_and_grad(loss))(params), expected, rtol=1e-9, atol=1e-12)
    return simulate, params, expected


def test_fdtdx_in_a_loss_without_a_site(checkpointed):
    simulate, params, expected = checkpointed
    loss = lambda p: weighted(simulate(p))  # noqa: E731
    assert dx.explain(loss, params).sites == ()
    assert_tree_allclose(eqx.filter_jit(dx.filter_value_and_grad(loss))(params), expected, rtol=1e-9, atol=1e-12)


def test_fdtdx_as_an_expensive_function_is_deferred(checkpointed, counter):
    simulate, params, expected = checkpointed
    loss = lambda p: weighted(vjp_site(simulate, counter)(p))  # noqa: E731
    site = dx.explain(loss, params).sites[0]
    assert (site.schedule, site.out_shapes) == ("deferred", "float64[210, 1]")
    got = eqx.filter_jit(dx.filter_value_and_grad(loss))(params)
    jax.effects_barrier()
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-12)
    assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}


def test_fdtdx_time_reversal_gradient_without_a_site():
    """fdtdx's default gradient, the time-reversal `custom_vjp`: its `bwd` closes over the
    simulation's arrays, whose fields and permittivities are computed from the parameters in
    the loss (a real closure over values of the function, not over module-level constants):
    the call runs as Equinox's would, and the plan says why."""
    simulate, params = build("reversible")
    loss = lambda p: weighted(simulate(p))  # noqa: E731
    plan = dx.explain(loss, params)
    assert plan.sites == () and "closes over a value computed in the function" in plan.fallback
    # its custom_vjp is not a site: nothing of its backward can start before the forward ends
    # (the time reversal starts from the final fields), and its rules close over the arrays
    [call] = plan.recognised
    assert (call.call, call.site) == ("custom_vjp `reversible_fdtd_primal`", None)
    if jax.__version_info__ < (0, 12, 1):  # (from 0.12.1 JAX refuses to trace such a forward rule at all)
        assert re.match(
            r"its backward's work \(about .* ms\) needs the residuals `res\[0\]\[1\]` \(float64\[3, 20, 20, 1\]\), "
            r"`res\[0\]\[2\]` \(float64\[3, 20, 20, 1\]\)",
            call.reason,
        ), call.reason
        assert "so it cannot start before the forward ends: left as is (the standard schedule)" in call.reason
    assert call.reason.endswith(
        "its forward rule closes over a value computed in the function (a tracer of the "
        "loss's trace), which cannot be evaluated outside it"
    )
    got = eqx.filter_jit(dx.filter_value_and_grad(loss))(params)
    assert_tree_allclose(got, jax.jit(jax.value_and_grad(loss))(params), rtol=1e-9, atol=1e-12)
    assert_tree_allclose(got, eqx.filter_jit(eqx.filter_value_and_grad(loss))(params), rtol=1e-9, atol=1e-12)
