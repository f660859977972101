"""Inverse design on Google's ceviche-challenges: the waveguide bend and the mode converter.

The challenge (`ceviche_challenges`) gives the geometry, the ports and their modes; the
loss is invrs-gym's: a smooth window on the transmissions |S|^2, averaged over two
wavelengths. The 2D FDFD system (Ez polarisation, as `ceviche.fdfd_ez` builds it) is
assembled here in JAX from the design, `A(design) Ez = 1j omega J`, and solved with
`dx.sparse_solve`, which factors `A` once per wavelength and step and solves the forward
and the adjoint right-hand sides with that factorisation. Optax's Adam runs the design.

    pip install -e ".[examples]"      # ceviche-challenges, optax, tqdm
    python examples/inverse_design_ceviche.py                      # the bend, 5 steps
    python examples/inverse_design_ceviche.py --steps 60           # a real run
    python examples/inverse_design_ceviche.py --challenge mode_converter
"""

from __future__ import annotations

import argparse

import ceviche
import ceviche_challenges as cc
import jax
import jax.numpy as jnp
import numpy as np
import optax
from ceviche.constants import EPSILON_0, MU_0
from ceviche_challenges import ops
from ceviche_challenges import units as u
from tqdm import tqdm

import deferax as dx

jax.config.update("jax_enable_x64", True)

# invrs-gym's "lightweight" challenges: 40 nm grid, two wavelengths, its port and waveguide sizes.
SIM = cc.params.CevicheSimParams(resolution=40 * u.nm, wavelengths=u.Array([1270.0, 1290.0], u.nm))
SIZES = dict(wg_length=720 * u.nm, padding=400 * u.nm, port_pml_offset=40 * u.nm, input_monitor_offset=40 * u.nm)
SIZES |= dict(variable_region_size=(1600 * u.nm, 1600 * u.nm), pml_width=20)
SIZES |= dict(cladding_permittivity=2.25, slab_permittivity=12.25)
# Transmission windows (|S11|^2, |S21|^2): reflection below -20 dB, transmission above -0.5 dB.
LOWER, UPPER = np.array([0.0, 10**-0.05]), np.array([10**-2.0, 1.0])


def challenge(name: str, sim=SIM):
    """The `ceviche_challenges` model of the challenge `name`."""
    if name == "waveguide_bend":
        spec = cc.waveguide_bend.spec.WaveguideBendSpec(wg_width=400 * u.nm, wg_mode_padding=520 * u.nm, **SIZES)
        return cc.waveguide_bend.model.WaveguideBendModel(sim, spec)
    wg = dict(wg_width=400 * u.nm, wg_mode_padding=520 * u.nm)
    spec = cc.mode_converter.spec.ModeConverterSpec(
        **{f"{side}_{k}": v for side in ("left", "right") for k, v in wg.items()},
        left_wg_mode_order=1,  # in: the fundamental mode; out: the second mode
        right_wg_mode_order=2,
        **SIZES,
    )
    return cc.mode_converter.model.ModeConverterModel(sim, spec)


def window_loss(s, xp=jnp):
    """invrs-gym's loss of the S-parameters `s` (wavelength, 1, port): a softplus of the
    signed distance to the transmission window, squared, summed over ports, averaged
    over wavelengths. `xp` is `jax.numpy`, or `autograd.numpy` for ceviche's own gradient."""
    t = xp.abs(s) ** 2
    d = xp.maximum(xp.where(LOWER > 0, LOWER - t, -1.0), xp.where(UPPER < 1, t - UPPER, -1.0)) / np.min(UPPER - LOWER)
    return xp.mean(xp.sum(xp.logaddexp(0.0, d) ** 2, axis=(1, 2)))


class Wavelength:
    """One wavelength's FDFD problem of `model`, excited at port 1: what does not depend on
    the design is computed once, with ceviche, in NumPy. The solves run on `executor`
    (default: deferax's thread pool; a process pool or a Dask client's executor also do)."""

    def __init__(self, model, wavelength_nm: float, executor=None):
        self.model, self.executor, dl = model, executor, model.dl
        self.omega = 2 * np.pi * u.c.to_value("nm/s") / wavelength_nm  # as ceviche_challenges converts it
        eps_bg = model.epsilon_r_bg()
        sim = ceviche.fdfd_ez(self.omega, dl, eps_bg, [model.pml_width] * 2)  # PML and derivative matrices
        n = eps_bg.size
        curl = (-(sim.Dxf @ sim.Dxb + sim.Dyf @ sim.Dyb) / MU_0).tocoo()
        self.curl = jnp.asarray(curl.data)  # A = curl - EPSILON_0 omega^2 diag(eps): diagonal first, then curl
        self.pattern = dx.SparsePattern(np.r_[np.arange(n), curl.row], np.r_[np.arange(n), curl.col], n)
        self.source = jnp.asarray(1j * self.omega * model.ports[0].source_fdfd(self.omega, dl, eps_bg).ravel())
        # ceviche's backward differences (Dxb, Dyb: a PML factor / dl on the diagonal), for H from Ez
        self.dxb, self.dyb = sim.Dxb.diagonal().reshape(eps_bg.shape), sim.Dyb.diagonal().reshape(eps_bg.shape)
        self.modes = [port.field_profiles(eps_bg[port.coords()], self.omega, dl) for port in model.ports]

    def solve(self, values):
        """`Ez = A^-1 b` for the entries `values` of `A`: the expensive step."""
        return dx.sparse_solve(values, self.pattern, self.source, executor=self.executor)

    def s_params(self, eps):
        """S_j1 = b_j / a_1 for each port `j`: the field, then each port's mode amplitudes
        (`ceviche_challenges.scattering.calculate_amplitudes`, in JAX)."""
        values = jnp.concatenate([-EPSILON_0 * self.omega**2 * eps.ravel(), self.curl])
        ez = self.solve(values).reshape(eps.shape)
        hx = -self.dyb * (ez - jnp.roll(ez, 1, axis=1)) / (1j * self.omega * MU_0)
        hy = self.dxb * (ez - jnp.roll(ez, 1, axis=0)) / (1j * self.omega * MU_0)
        a, b = [], []
        for port, (e_m, h_m, _) in zip(self.model.ports, self.modes, strict=True):
            i, j = port.coords()
            if port.dir.is_along_x:
                i = i + port.signed_offset()
                h, h_mode, e = (0.0, hy[i, j], 0.0), (0.0, h_m, 0.0), 0.5 * (ez[i - 1, j] + ez[i, j])
            else:
                j = j + port.signed_offset()
                h, h_mode, e = (hx[i, j], 0.0, 0.0), (-h_m, 0.0, 0.0), 0.5 * (ez[i, j - 1] + ez[i, j])
            e, e_mode = (0.0, 0.0, e), (0.0, 0.0, e_m)
            overlap_eh, overlap_he = overlap(e_mode, h, port.dir), overlap(h_mode, e, port.dir)
            norm = np.sqrt(2 * ops.overlap(e_mode, h_mode, port.dir))  # NumPy: the modes are fixed
            sign = port.dir.sign
            a.append((overlap_eh + sign * overlap_he) / 2 / norm)
            b.append((overlap_eh - sign * overlap_he) / 2 / norm)
        return jnp.stack(b) / a[0]


def overlap(a, b, normal):
    """`ceviche_challenges.ops.overlap` in JAX: the overlap integral of two vector fields."""
    return jnp.sum(ops.cross(tuple(jnp.conj(x) for x in a), b)[normal.index])


def make_loss(model, wavelengths=None):
    """`design -> loss`: the design (densities in [0, 1]) inlaid in the background, the
    permittivity, the S-parameters at each wavelength, the window loss. `wavelengths`:
    `Wavelength`s of `model` (default: each of its wavelengths, solved on deferax's threads)."""
    wavelengths = wavelengths or [Wavelength(model, w) for w in model.output_wavelengths]
    (x0, y0, x1, y1), lo, hi = model.design_region_coords, model.cladding_permittivity, model.slab_permittivity

    def loss(design):
        density = jnp.asarray(model.density_bg).at[x0:x1, y0:y1].set(design)
        eps = lo + (hi - lo) * density
        return window_loss(jnp.stack([w.s_params(eps) for w in wavelengths])[:, None, :])

    return loss


def optimise(model, steps: int, learning_rate: float = 0.05, verbose: bool = True):
    """Adam on `theta`, the design being `sigmoid(theta)`; returns the losses and the design."""
    loss = make_loss(model)
    value_and_grad = jax.jit(dx.filter_value_and_grad(lambda theta: loss(jax.nn.sigmoid(theta))))
    theta = jnp.zeros(model.design_variable_shape)  # every density 0.5
    optimiser = optax.adam(learning_rate)
    state, losses = optimiser.init(theta), []
    for _ in (bar := tqdm(range(steps), disable=not verbose)):
        value, grad = value_and_grad(theta)
        updates, state = optimiser.update(grad, state)
        theta = optax.apply_updates(theta, updates)
        losses.append(float(value))
        bar.set_postfix(loss=f"{losses[-1]:.4g}")
    return losses, jax.nn.sigmoid(theta)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--challenge", choices=["waveguide_bend", "mode_converter"], default="waveguide_bend")
    parser.add_argument("--steps", type=int, default=5, help="Adam steps (default 5)")
    args = parser.parse_args()
    model = challenge(args.challenge)
    loss = make_loss(model)
    design = jnp.full(model.design_variable_shape, 0.5)
    (nx, ny), (mx, my) = model.shape, model.design_variable_shape
    print(f"{args.challenge}: {nx} x {ny} grid, design region {mx} x {my}, wavelengths {model.output_wavelengths} nm")
    print(dx.explain(loss, design))
    step = jax.jit(dx.filter_value_and_grad(loss))
    jax.block_until_ready(step(design))  # compiled
    with dx.record() as timeline:
        jax.block_until_ready(step(design))
    # fwd: factor A and solve; bwd: the adjoint solve with fwd's factorisation (kept for it)
    print("one step runs:", timeline.counts())
    losses, _ = optimise(model, args.steps)
    print(f"loss: {losses[0]:.4g} -> {losses[-1]:.4g} in {args.steps} steps")


if __name__ == "__main__":
    main()
