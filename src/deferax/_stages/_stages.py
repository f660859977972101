"""The three stages of a deferred schedule, as interpreters over the one traced program.

1. `stage1`: the deferred sites' operands and cotangents, from the backward program the
   analysis traced, with zeros standing in for every expensive output (the static check
   proved them unused) and nothing else of the program run (no user effects);
2. `stage2`: the expensive calls: one `fused` per deferred site (batched over its `vmap`
   levels, or over its basis cotangents), and the `fwd` of the standard sites that need no
   expensive output, concurrently;
3. `stage3`: value, aux and gradients: the program evaluated under `jax.vjp`, the deferred
   sites replaying their results and every other site on the standard schedule.
"""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jaxpr, _record
from .._analysis._analysis import Analysis, zeros
from .._concurrency._threads import Fused, all_runnable, preparing, running_prepared, serial, slot
from .._forward_basis import _tangents
from .._host import _executor
from .._site import _primitive as _site

# The threads that run the sites of one step together; each waits for its site's calls
# (which `dx.fuse` halves run on another pool, so that no thread waits for its own pool).
_SITES = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="deferax-site")

# ----------------------------------------------------------------------------- stage 1


def stage1(analysis: Analysis, ins: list) -> tuple[dict, dict]:
    """`(operands, cts)` of the sites that stage 2 runs, by position; for a basis site the
    cotangents are its `k` basis cotangents stacked on a leading axis."""
    ys = [zeros(_site.structs_of(analysis.spec(k).y_avals())) for k in range(len(analysis.sites))]
    operands: dict = {}
    cts: dict = {}
    if analysis.backward is not None:
        seed = jnp.ones((), analysis.program.jaxpr.outvars[0].aval.dtype)
        outs = _jaxpr.interpret(analysis.backward, [*ins, *jtu.tree_leaves(ys), seed])
        for (kind, k, _), value in zip(analysis.backward_out, outs, strict=True):
            (cts if kind == "ct" else operands).setdefault(k, []).append(value)
    for k, basis in analysis.basis.items():
        cts[k] = _basis_cotangents(basis.program, basis.variables, ins, ys, k)
    return operands, cts


def _basis_cotangents(program, variables, ins, ys, k):
    """The basis cotangents of a basis site: for each real number of each frontier variable
    (a complex number counts twice: its real, then its imaginary direction), the cotangent
    of the site's output that the variable's *direct* dependence on it gives, stacked.

    The frontier is linear in the output, so these are exact rows of a fixed Jacobian.
    "Direct": a frontier variable computed from another one sees it as a constant (its
    contribution travels through the other's cotangent in stage 3), so that
    `ct_y = sum_j ct_z[j] * row_j` holds with `ct_z` the variables' cotangents.
    """
    n_in = len(ins) + len(jtu.tree_leaves(ys))
    ns = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in program.jaxpr.invars[n_in:]]
    wanted = set(variables)

    def frontier_of(y_k):
        ys_ = list(ys)
        ys_[k] = y_k
        seen = {}

        def record(v):
            def f(value):
                seen[v] = value
                return jax.lax.stop_gradient(value)

            return f

        _jaxpr.interpret(program, [*ins, *jtu.tree_leaves(ys_), *ns], wrap={v: record(v) for v in wanted})
        return [seen[v] for v in variables]

    values, vjp = jax.vjp(frontier_of, ys[k])
    seeds = []
    for i, v in enumerate(values):
        units = [jnp.eye(v.size, dtype=v.dtype)]
        if jnp.iscomplexobj(v):
            units.append(1j * units[0])
        for unit in units:
            rows = unit.shape[0]
            seeds.append(
                [jnp.reshape(unit, (rows, *v.shape)) if j == i else jnp.zeros((rows, *w.shape), w.dtype) for j, w in enumerate(values)]
            )
    batch = [jnp.concatenate([s[j] for s in seeds]) for j in range(len(values))]
    (basis,) = jax.vmap(vjp)(batch)
    return basis


# ----------------------------------------------------------------------------- stage 2


def _stage2_impl(analysis: Analysis, k: int):
    """The implementation that site `k`'s stage-2 work calls (None for a `fused` made here)."""
    static = analysis.spec(k).static
    if k in analysis.early:
        return static.fwd
    if analysis.derived(k):
        return None
    return static.fused_batch if k in analysis.basis and static.fused_batch is not None else static.fused


def _on_host(analysis: Analysis, k: int) -> bool:
    """Whether site `k`'s stage-2 work is host functions (`dx.host`), whose callback takes a
    batch from `vmap` whole."""
    return getattr(getattr(_stage2_impl(analysis, k), "__self__", None), "runs_on_host", False)


def leaves_program(analysis: Analysis, k: int) -> bool:
    """Whether site `k`'s stage-2 work runs outside the XLA program anyway: on the host
    (`dx.host`), or as two compiled halves on threads (`dx.fuse`, or a `fused` made from
    `fwd` and `adjoint`/`bwd`). Such work leaves through a callback, which JAX cannot
    differentiate."""
    if analysis.derived(k) and k not in analysis.early:
        return True
    return isinstance(_stage2_impl(analysis, k), Fused) or _on_host(analysis, k)


def stage2(analysis: Analysis, operands: dict, cts: dict, eager: bool) -> tuple[dict, dict]:
    """`(ys, diff_cts)` by position: each site's output leaves and, for a deferred site, the
    cotangents of the differentiable leaves of its input (stacked for a basis site).

    Eagerly, the calls run concurrently on threads. Traced (under `jit` or `vmap`), each is
    part of the surrounding program, where XLA:CPU runs them one after another; when there
    are several and all of them leave the program anyway (host functions, `dx.fuse`, a
    `fused` made from `fwd` and `adjoint`), they leave it through one callback that runs
    them all concurrently; under a `vmap` of the whole step, on the whole batch (each host
    site's functions get it in one submission, other halves run one example after another).
    """
    positions = analysis.deferred + analysis.early

    def one(k, operands_, cts_, size=None):
        """Site `k`'s work; with `size`, for a batch of that many examples (from a `vmap`
        around the whole step) stacked on a leading axis."""
        if size is not None:
            site_args = (operands_[k], cts_[k])
            if k in on_host:  # the host functions get the whole batch in one submission
                return on_host[k](*site_args)
            each = [one(k, {k: o}, {k: c}) for o, c in (jtu.tree_map(lambda a, i=i: a[i], site_args) for i in range(size))]
            return jtu.tree_map(lambda *a: np.stack(a), *each)
        schedule = "standard" if k in analysis.early else "deferred-basis" if k in analysis.basis else "deferred"
        with _record.site(analysis.spec(k).name, schedule):
            return run_one(k, operands_, cts_)

    def run_one(k, operands_, cts_):
        spec = analysis.spec(k)
        if k in analysis.early:
            return _site.primal(spec, *operands_[k]), None
        if k in analysis.basis:
            fn = spec.fn(operands_[k][: spec.n_fn])
            cts_tree = jtu.tree_unflatten(spec.y_tree, cts_[k])
            x = spec.x(operands_[k][spec.n_fn :])
            y, ct_xs = fn.derived_fused().batched(x, cts_tree) if analysis.derived(k) else fn.run_fused_batch(x, cts_tree)
            return jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_xs), spec.diff, strict=True) if d]
        return fused(spec, operands_[k], cts_[k], analysis.derived(k))

    # (compiled once for this trace of the step, each batch size once)
    on_host = {k: jax.jit(jax.vmap(lambda o, c, k=k: one(k, {k: o}, {k: c}))) for k in positions if _on_host(analysis, k)}

    def guarded(k, operands_, cts_, size=None):
        """`one(k)`, one call at a time for a function that is not thread-safe, or while
        concurrency is switched off (which its halves read again when they run)."""
        if not analysis.spec(k).static.thread_safe:
            with _executor.SERIAL_LOCK, serial():
                return one(k, operands_, cts_, size)
        if _executor.concurrency_enabled():
            return one(k, operands_, cts_, size)
        with _executor.SERIAL_LOCK:
            return one(k, operands_, cts_, size)

    def placed(i, k, operands_, cts_, size=None):
        with slot(i):  # the i-th site's halves on the i-th pair of devices
            return guarded(k, operands_, cts_, size)

    def run_all(operands_, cts_, size=None):
        if len(positions) > 1:
            futures = [_SITES.submit(_jaxpr.carry_context(placed), i, k, operands_, cts_, size) for i, k in enumerate(positions[1:], 1)]
            try:
                first = placed(0, positions[0], operands_, cts_, size)  # this thread runs one site itself
            except BaseException:
                concurrent.futures.wait(futures)
                raise
            return [first, *(f.result() for f in futures)]
        return [guarded(k, operands_, cts_, size) for k in positions]

    gather = len(positions) > 1 and all(leaves_program(analysis, k) for k in positions)
    results = None
    if eager:
        results = run_all(operands, cts)
    elif gather:
        mine = ({k: operands[k] for k in positions}, {k: cts.get(k) for k in positions})

        def traced(i, k, m):
            with slot(i):
                return one(k, *m)

        # (traced in this thread: JAX's tracing state does not reach the pool's threads);
        # the halves made from `fwd` and `bwd` are traced here, with the program, and kept
        prepared: dict = {}
        with preparing(prepared):
            shapes = jax.eval_shape(lambda m: [traced(i, k, m) for i, k in enumerate(positions)], mine)

        rank = next((np.ndim(a) for a in jtu.tree_leaves(mine)), 0)

        def host(concrete):
            # Under a `vmap` of the whole step, every operand comes with the batch's leading
            # axes: the sites run on the batch flattened to one axis.
            leaves = jtu.tree_leaves(concrete)
            batch = np.shape(leaves[0])[: np.ndim(leaves[0]) - rank] if leaves else ()
            with running_prepared(prepared):
                if not batch:
                    return jtu.tree_map(np.asarray, run_all(*concrete))
                size = int(np.prod(batch))
                flat = jtu.tree_map(lambda a: np.reshape(a, (size, *np.shape(a)[len(batch) :])), concrete)
                return jtu.tree_map(lambda a: np.reshape(a, (*batch, *np.shape(a)[1:])), run_all(*flat, size=size))

        # A half that closes over a value of the surrounding trace cannot run from one
        # callback for all: then each site leaves through its own, which takes that value.
        if all_runnable(prepared):
            results = jax.pure_callback(host, shapes, mine, vmap_method="broadcast_all")
    if results is None:
        results = [guarded(k, operands, cts) for k in positions]
    ys = {k: r[0] for k, r in zip(positions, results, strict=True)}
    diff_cts = {k: r[1] for k, r in zip(positions, results, strict=True)}
    return ys, diff_cts


def fused(spec: _site.Spec, operands: list, ct: list, derived: bool = False) -> tuple[list, list]:
    """`fused(x, ct_y)` over every batch level: output leaves, and the cotangents of the
    differentiable leaves of `x` shaped like their operands. `derived`: the site has no
    `fused`; one is made from its `fwd` and `adjoint` (or `y`-free `bwd`)."""
    n_fn = spec.n_fn
    diff = spec.diff

    def one(fn_leaves, x_leaves, ct_leaves):
        fn = spec.fn(fn_leaves)
        y, ct_x = fn.run_fused(spec.x(x_leaves), jtu.tree_unflatten(spec.y_tree, list(ct_leaves)))
        return jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_x), diff, strict=True) if d]

    def axes_of(level):
        return (list(level[:n_fn]), list(level[n_fn:]), [0] * len(spec.y_structs))

    batched_impl = any(a is not None for level, _ in spec.axes for a in level[:n_fn])
    concurrent = derived or isinstance(spec.static.fused, Fused)
    if concurrent and not batched_impl:
        # `dx.fuse` (or one made here): the whole batch's forward and adjoint on two threads
        fn = spec.fn(operands[:n_fn])
        impl = fn.derived_fused() if derived else fn.fused
        x, ct_tree = spec.x(operands[n_fn:]), jtu.tree_unflatten(spec.y_tree, list(ct))
        if spec.axes:
            x_axes = [jtu.tree_unflatten(spec.x_tree, list(level[n_fn:])) for level, _ in spec.axes]
            y, ct_x = impl.vmapped(x, ct_tree, x_axes)
        else:
            y, ct_x = fn.run_fused(x, ct_tree) if not derived else impl(x, ct_tree)
        y, ct_x = jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_x), diff, strict=True) if d]
    else:
        y, ct_x = spec.vmapped(one, axes_of)(list(operands[:n_fn]), list(operands[n_fn:]), list(ct))
    return y, _site.unbatch(spec, ct_x)


# ----------------------------------------------------------------------------- stage 3


def _replay(operands, y, ct_operands):
    return y


def _replay_fwd(operands, y, ct_operands):
    return y, (y, ct_operands)


def _replay_bwd(residuals, ct_y):
    y, ct_operands = residuals
    # The static check proved that `ct_y` equals the cotangent `fused` was given.
    return ct_operands, jtu.tree_map(_tangents.zero_like, y), jtu.tree_map(_tangents.zero_like, ct_operands)


replay = jax.custom_vjp(_replay)
replay.defvjp(_replay_fwd, _replay_bwd)


def given(spec: _site.Spec):
    """The standard schedule of a site whose output `y` was computed in stage 2: returns
    `y`; the backward pass runs `bwd` (or `fused`) as the site's own rules would."""

    @jax.custom_vjp
    def call(operands, y):
        return y

    def fwd(operands, y):
        return y, (operands, y)

    def bwd(residuals, ct_y):
        operands, y = residuals
        diff_cts = _site.cotangents(spec, operands[: spec.n_fn], operands[spec.n_fn :], y, ct_y)
        return _site.operand_cotangents(spec, operands, diff_cts), jtu.tree_map(_tangents.zero_like, y)

    call.defvjp(fwd, bwd)
    return call


def frontier_cotangent(spec: _site.Spec, rows: slice):
    """Where a frontier variable `z` of a basis site is made: `z` itself, whose backward pass
    also gives the site's operands their cotangent. The coefficients are `z`'s own
    cotangent, exactly (no projection): `ct_x = sum_j ct_z[j] * ct_x_j` over the
    precomputed input cotangents of this variable's basis cotangents, with a zero entry of
    `ct_x_j` contributing zero whatever `ct_z[j]` is: an infinite slope then gives `inf`
    where the standard schedule's adjoint would, not NaN everywhere."""

    @jax.custom_vjp
    def call(z, operands, ct_xs):
        return z

    def fwd(z, operands, ct_xs):
        return z, (operands, ct_xs)

    def bwd(residuals, ct_z):
        operands, ct_xs = residuals
        a = _tangents.flatten_tangent(ct_z, ct_z)  # the order of the basis rows

        def combine(c):
            c = c[rows]
            coefficients = jnp.reshape(a, (-1,) + (1,) * (c.ndim - 1)).astype(c.dtype)
            return jnp.sum(jnp.where(c == 0, jnp.zeros((), c.dtype), coefficients * c), axis=0)

        diff_cts = [combine(c) for c in ct_xs]
        return (ct_z, _site.operand_cotangents(spec, operands, diff_cts), jtu.tree_map(_tangents.zero_like, ct_xs))

    call.defvjp(fwd, bwd)
    return call


def _frontier_wraps(analysis: Analysis, k: int, operands: dict, ct_xs: list) -> dict:
    """The stage-3 wrappers of site `k`'s frontier variables (`operands[k]` is filled in
    when the site is evaluated, before any of its frontier variables is made)."""
    spec = analysis.spec(k)
    wraps, start = {}, 0
    for v in analysis.basis[k].variables:
        size = _jaxpr.frontier_size([v])
        rows = slice(start, start + size)
        wraps[v] = lambda z, rows=rows: frontier_cotangent(spec, rows)(z, operands[k], ct_xs)
        start += size
    return wraps


def _replacements(analysis: Analysis, results) -> tuple[dict, dict]:
    """`(handlers, wraps)` for `_jaxpr.interpret`: what stage 3 runs in place of the deferred
    and early sites, and the wrappers of the basis sites' frontier variables. Made afresh
    for each trace: the basis sites' operands recorded here are that trace's tracers, and
    nothing may keep them alive after it (jax >= 0.11 checks for leaked tracers)."""
    handlers, wraps, operands = {}, {}, {}
    if results is None:
        return handlers, wraps
    cts, ys, diff_cts = results
    for k in analysis.deferred + analysis.early:
        spec = analysis.spec(k)
        if k in analysis.early:
            handlers[analysis.sites[k]] = lambda eqn, ops, spec=spec, k=k: given(spec)(ops, ys[k])
        elif k in analysis.basis:
            # the output is a constant here; the operands get their cotangent where the
            # frontier variables are made
            handlers[analysis.sites[k]] = lambda eqn, ops, k=k: (operands.__setitem__(k, ops), ys[k])[1]
            for v, wrap in _frontier_wraps(analysis, k, operands, diff_cts[k]).items():
                # A variable on several sites' frontiers (`sum(f(x)) + sum(f(2 * x))`
                # before a square): each site's wrapper in turn, all given its cotangent.
                before = wraps.get(v)
                wraps[v] = wrap if before is None else (lambda z, wrap=wrap, before=before: wrap(before(z)))
        else:
            handlers[analysis.sites[k]] = lambda eqn, ops, spec=spec, k=k: replay(
                ops, ys[k], _site.operand_cotangents(spec, ops, diff_cts[k])
            )
    return handlers, wraps


def stage3(analysis: Analysis, has_diff: list[bool], ins: list, results) -> tuple:
    """`(outputs, grads)`: the program's outputs (value first) and the gradient of the value
    with respect to the inputs flagged in `has_diff`."""
    diff = [a for a, d in zip(ins, has_diff, strict=True) if d]

    def program(diff_):
        it = iter(diff_)
        full = [next(it) if d else a for a, d in zip(ins, has_diff, strict=True)]
        outs = _jaxpr.interpret(analysis.program, full, *_replacements(analysis, results))
        return outs[0], outs[1:]

    value, vjp, aux = jax.vjp(program, diff, has_aux=True)
    (grads,) = vjp(jnp.ones((), value.dtype))
    return [value, *aux], grads
