"""The deferred schedule: one `fused(x, ct_y)` call in stage 2 for the output and the input
cotangent, from the cotangent stage 1 computed ahead of the value (the static check proved
that it needs no expensive output); stage 3 replays both."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _site
from .._concurrency._threads import NEEDS_Y
from .._implementation._abstract import AbstractFused, AbstractImplementation
from .._jaxpr import zero_like
from .._plan import _cost
from .._plan._cost import Estimates
from .._plan._plan import Schedule
from .._site import Spec
from ._abstract import AbstractDeferring, halves_text, leaves_program, returning, stage_label


def _replayed_cotangents(args, ct_y):
    _, y, ct_operands = args
    # The static check proved that `ct_y` equals the cotangent `fused` was given.
    return ct_operands, jtu.tree_map(zero_like, y), jtu.tree_map(zero_like, ct_operands)


# `replay(operands, y, ct_operands)`: a deferred site's output `y`, computed in stage 2; the
# backward pass gives the operands the cotangents stage 2 computed with them.
replay = returning(1, _replayed_cotangents)


def peers(spec: _site.Spec, others: Sequence[_site.Spec]) -> int:
    """How many of `others` (the program's sites that may run ahead of the value, `spec`
    among them) are like `spec`: the same timed host functions (`timings_key`: for
    `dx.sparse_solve`, the same pattern and solver) on inputs of the same shapes. Their
    deferred jobs run at once in one stage (`estimate`'s `peers`)."""
    key = spec.static.timings_key
    if key is None:
        return 1
    shapes = tuple(s.shape for s in spec.x_structs)
    alike = sum(1 for o in others if o.static.timings_key == key and tuple(s.shape for s in o.x_structs) == shapes)
    return max(alike, 1)


def estimate(spec: _site.Spec, k: int, peers: int = 1, per_example: bool = False) -> _cost.Estimates:
    """The estimates for site `spec` on `k` cotangents (`k = 1`: the plain deferred
    schedule): its standard schedule (`_cost.standard_seconds`) and its deferred jobs
    (`jobs`) at once (`_cost.at_once`): one job when its forward and adjoints share one call
    (`fused_batch`, or a traced `fused` batched over them), else separate jobs of which the
    executor runs `workers` at once (unless the hint says how many), with `peers` sites like
    it running their jobs at once in one stage (see `peers`), the estimate this site's share.

    Under `vmap`, each example's job gets all `k`, of which those of the other examples
    are zero there when the frontier is batched like the output (a loss of each example's
    overlaps): a site that solves only rows that are not multiples of others (`linear`
    in its `cost`, as `dx.sparse_solve`) is estimated on its example's share, like one
    site of the loop over the examples (`per_example`: `k` is counted per example
    already); a host site's examples are jobs run at once, as the loop's sites are
    (`peers`)."""
    static = spec.static
    if spec.axes and static.cost is not None and static.cost.linear and not per_example:
        k = math.ceil(k / math.prod(spec.sizes))
    fused = static.fused
    if spec.axes and isinstance(fused, AbstractImplementation):  # (a host site: a job per example, all at once)
        peers *= math.prod(spec.sizes)
    one_job = not isinstance(fused, AbstractImplementation) or fused.batch_in_one_job
    # (the jobs the executor runs at once: the site's own separate jobs, or its peers' one jobs)
    workers = fused.jobs_at_once if isinstance(fused, AbstractImplementation) and (not one_job or peers > 1) else 1
    complex_out = any(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in spec.y_structs)
    shapes = tuple(s.shape for s in spec.x_structs)
    fused_only = static.fwd is None and static.bwd is None and static.adjoint is None
    fused_jobs = fused_only or (isinstance(fused, AbstractImplementation) and fused.batch_jobs_are_fused)
    hint = _cost.Cost() if static.cost is None else static.cost
    workers = workers if hint.workers is None else hint.workers
    setup, fwd, bwd, stage, source = _cost.numbers(static.timings_key, shapes, hint)
    return _cost.Estimates(
        standard=_cost.standard_seconds(setup, fwd, bwd, stage, hint, fused_only),
        deferred=_cost.at_once(
            jobs(setup, fwd, bwd, k, hint, complex_out=complex_out, one_job=one_job, fused_jobs=fused_jobs),
            workers,
            stage,
            peers,
        ),
        source=source,
        note=hint.note,
    )


def jobs(
    setup: float,
    fwd: float,
    bwd: float,
    k: int,
    hint: _cost.Cost,
    *,
    complex_out: bool,
    one_job: bool,
    fused_jobs: bool,
) -> list[float]:
    """The seconds of the jobs of a deferred site on `k` cotangents (`k = 1`: the plain
    deferred schedule), from its numbers (`_cost.numbers`):

        one job:        setup + fwd + m * bwd          (`fused_batch`, or a traced `fused`
                                                        batched over the cotangents)
        separate jobs:  setup + fwd, and m of setup + bwd   (`fwd` and an `adjoint` each)
                        or m of setup + fwd + bwd      (`fused` once a cotangent, each
                                                        computing the forward too)

    where `m = k`, or `ceil(k / 2)` for a complex output whose adjoint is linear (`m` and
    `1j m` one solve: the hint's `linear`)."""
    m = math.ceil(k / 2) if hint.linear and complex_out else k
    if one_job:
        return [setup + fwd + m * bwd]
    return [setup + fwd + bwd] * m if fused_jobs else [setup + fwd] + [setup + bwd] * m


def fused_is_derived(spec: Spec) -> bool:
    """Whether a deferred site's `fused` is made from its `fwd` and its `adjoint` or `y`-free
    `bwd` (it has none of its own)."""
    return spec.static.fused is None and spec.static.fused_batch is None


def fused_label(spec: Spec) -> str:
    """How the plan's stages name a deferred site's call: its `fused`, or the halves it is
    made from."""
    static = spec.static
    if fused_is_derived(spec):
        return stage_label(spec, "fwd + " + ("adjoint" if static.adjoint is not None else "bwd"))
    return stage_label(spec, "fused")


class Deferred(AbstractDeferring):
    """A site on the deferred schedule."""

    spec: Spec
    position: int
    reason: None = None
    location: None = None
    k: None = None
    n: None = None
    estimates: Estimates = eqx.field(kw_only=True)
    label: ClassVar[Schedule] = "deferred"  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    from_backward: ClassVar[tuple[str, ...]] = ("ct", "op")  # pyright: ignore[reportIncompatibleVariableOverride]

    @staticmethod
    def estimate(spec: Spec, peers: int = 1) -> Estimates:
        """The estimates of the standard and the deferred schedule, with `peers` sites like
        it deferred at once."""
        return estimate(spec, 1, peers)

    def stage_rows(self) -> tuple[str | None, str | None, str | None]:
        return fused_label(self.spec), None, None

    def stage1_cotangents(self, ins: list, ys: list, traced: list | None) -> Any:
        return traced

    @property
    def impl(self) -> Any:
        return None if fused_is_derived(self.spec) else self.spec.static.fused

    @property
    def leaves_program(self) -> bool:
        return leaves_program(self.impl, fused_is_derived(self.spec))

    @property
    def halves(self) -> str | None:
        return halves_text(self.impl, fused_is_derived(self.spec))

    def call(self, operands: list, cts: Any) -> tuple:
        """`fused(x, ct_y)` over every batch level: output leaves, and the cotangents of the
        differentiable leaves of `x` shaped like their operands. A site without a `fused`
        (`is_derived`) gets one made from its `fwd` and `adjoint` (or `y`-free `bwd`)."""
        spec, is_derived = self.spec, fused_is_derived(self.spec)
        n_fn = spec.n_fn
        diff = spec.diff

        def one(fn_leaves, x_leaves, ct_leaves):
            fn = spec.fn(fn_leaves)
            y, ct_x = fn.run_fused(spec.x(x_leaves), jtu.tree_unflatten(spec.y_tree, list(ct_leaves)))
            return jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_x), diff, strict=True) if d]

        def axes_of(level):
            return (list(level[:n_fn]), list(level[n_fn:]), [0] * len(spec.y_structs))

        batched_impl = any(a is not None for level, _ in spec.axes for a in level[:n_fn])
        concurrent = is_derived or isinstance(spec.static.fused, AbstractFused)
        # (a `bwd` not read for this call: checked where its half runs, or here under `vmap`;
        # one that reads `y` now runs after the forward, on its `y`)
        check = _site.unread_bwd_check(spec, operands[:n_fn]) if is_derived and not batched_impl else None
        if check is not None and spec.axes:
            concurrent = check() is None
            check = None
        if concurrent and not batched_impl:
            # `dx.fuse` (or one made here): the whole batch's forward and adjoint on two threads
            fn = spec.fn(operands[:n_fn])
            impl = fn.derived_fused() if is_derived else fn.fused
            assert isinstance(impl, AbstractFused)  # (as `concurrent` says)
            x, ct_tree = spec.x(operands[n_fn:]), jtu.tree_unflatten(spec.y_tree, list(cts))
            if spec.axes:
                x_axes = [jtu.tree_unflatten(spec.x_tree, list(level[n_fn:])) for level, _ in spec.axes]
                y, ct_x = impl.under_vmap(x, ct_tree, x_axes)
            else:
                y, ct_x = fn.run_fused(x, ct_tree) if not is_derived else impl(x, ct_tree, check)
                if ct_x is NEEDS_Y:
                    ct_x = fn.cotangent(x, y, ct_tree)
            y, ct_x = jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_x), diff, strict=True) if d]
        else:
            y, ct_x = spec.over_levels(one, axes_of)(list(operands[:n_fn]), list(operands[n_fn:]), list(cts))
        return y, _site.unbatch(spec, ct_x)

    def stage3(self, y: list, ct_x: Any) -> tuple:
        spec = self.spec
        return (lambda eqn, ops: replay(ops, y, _site.operand_cotangents(spec, ops, ct_x))), {}
