"""The host side of `dx.host`: what to submit for a request (a forward solve, adjoints, a
batch from `vmap`), submitting it, checking and assembling what comes back, and timing it
for the choice of schedule.

Runs outside JAX (inside a `jax.pure_callback`, or directly on concrete arrays): NumPy in,
NumPy out.

Each job is timed where it runs (the time inside the host function, not its wait in the
executor's queue), and a request's timings feed `_cost.observe` under the site's identity
(`Identity`: its host functions) and input shapes, once per request (the least of its jobs
of each kind, so that a request's `k` adjoints, or a batch's examples, count as one sample):

| job | what its time `t` gives |
| --- | --- |
| `fwd` | `fwd = t` (with any setup of its own) |
| `adjoint`, `bwd` | `bwd = t` (likewise) |
| `fused` | `fwd = bwd = t / 2` |
| `fused_batch` of `k` cotangents | `fwd = bwd = t / (k + 1)` |
| `jvp`, `jvp_batch` | nothing (no estimate uses them) |

A `fused` job's time is `fwd + bwd` and a `fused_batch`'s `fwd + k * bwd`: one job cannot
tell the forward's share from the adjoints', so it is split as the equal-cost defaults
would (each schedule's estimate is exact for the job that was timed, the other schedule's
assumes that split). Under `vectorized=True`, a call's time is shared equally by the
examples it holds. Host functions that time their own parts, finer (`dx.sparse_solve`), are
not timed here (`timed=False`): each job gathers what they observe (`_cost.gathering`,
where the job runs), and the request feeds the least of each kind to `_cost.observe`, one
sample per request as above.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._checks import _messages
from .._jaxpr import stacked
from .._plan import _cost
from . import _executor, _timing

_ARRAY_LIKE = (np.ndarray, np.generic, jax.Array, int, float, complex)


def _zeros(struct: PyTree) -> PyTree:
    return jtu.tree_map(lambda s: np.zeros(s.shape, s.dtype), struct)


def _stack(items: list, struct: PyTree) -> PyTree:
    """Stack `items` (each shaped like `struct`) on a new leading axis."""
    if not items:
        return jtu.tree_map(lambda s: np.zeros((0, *s.shape), s.dtype), struct)
    return jtu.tree_map(lambda *a: np.stack(a), *items)


def _unstack(struct: PyTree) -> PyTree:
    return jtu.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), struct)


def _multiples(rows: list, partial_struct: PyTree) -> tuple[list[tuple[int | None, Any]], list[int]]:
    """For an adjoint that is linear in its cotangent: which rows are multiples of earlier ones.

    Returns `recipe` (for each row, `(u, c)`: the row is `c` times unique row `u`, or
    `(None, 0)` for a zero row) and `unique` (the indices of the rows that must be solved).
    A complex multiple is used only if every leaf of the adjoint's result is complex.
    """
    firsts = [leaves[0] for leaves in map(jtu.tree_leaves, rows) if leaves]
    if 2 <= len(rows) == len(firsts) <= _FEW and all(
        _apart(u, v) for i, u in enumerate(firsts) for v in firsts[i + 1 :]
    ):
        # (each row unique, as the test below finds them, without it)
        return [(j, 1.0) for j in range(len(rows))], list(range(len(rows)))
    complex_ok = all(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in jtu.tree_leaves(partial_struct))
    recipe: list[tuple[int | None, Any]] = []
    unique: list[int] = []
    norms: list[float] = []  # the squared norm of each unique row, scaled (below)
    if not rows:
        return recipe, unique
    leaves = [jtu.tree_leaves(row) for row in rows]
    flat = np.stack([np.concatenate([np.ravel(leaf) for leaf in ls]) for ls in leaves])
    flat = flat.astype(np.complex128 if np.iscomplexobj(flat) else np.float64)  # (real rows: in real arithmetic)
    # Each row is compared scaled by its largest entry, so that neither squares of tiny
    # entries underflow (weights near 1e-170 would make a row count as zero) nor squares of
    # huge ones overflow: the tests below are all invariant to each row's scale.
    scales = np.max(np.abs(flat), axis=1) if flat.shape[1] else np.zeros(len(rows))
    finite = np.isfinite(scales) & np.all(np.isfinite(flat), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        flat = np.where((finite & (scales > 0))[:, None], flat / np.where(scales > 0, scales, 1.0)[:, None], flat)
    conj = flat.conj()
    for j, ls in enumerate(leaves):
        if not finite[j]:  # (NaN or inf: solved as it is, never taken for a multiple)
            recipe.append((len(unique), 1.0))
            unique.append(j)
            norms.append(math.nan)
            continue
        kind = np.finfo(np.result_type(*[leaf.dtype for leaf in ls]))
        tol = _ROUNDINGS * float(kind.eps)
        # `<w, v>` for this row `v` and every unique row `w` so far, summed by NumPy: not BLAS
        # (`np.vdot`, `@`), whose threads wait for cores on a loaded machine (0.8 s for 6 rows
        # of 22,500 entries with one `np.vdot` a pair, at a load of 8 on 2 cores).
        dots = np.sum(conj[[j, *unique]] * flat[j], axis=1)
        norm2 = dots[0].real
        if scales[j] == 0.0:
            recipe.append((None, 0.0))
            continue
        floor = tol * float(kind.tiny) / float(scales[j])  # (subnormal entries: their rounding is absolute)
        for u, (i, w2, d) in enumerate(zip(unique, norms, dots[1:], strict=True)):
            if not abs(d) ** 2 >= 0.5 * w2 * norm2:  # far from parallel (a multiple has `|<w, v>| = |w| |v|`)
                continue
            c = d / w2
            if abs(c.real) <= tol * abs(c):  # (purely imaginary, up to the rounding of the scaling)
                c = 1j * c.imag
            elif abs(c.imag) <= tol * abs(c):
                c = c.real
            if isinstance(c, complex | np.complexfloating) and not complex_ok:
                continue
            # Entry by entry: `c w` stands for `v` only where each entry of `v` is `c w`'s up to
            # a few roundings, as when the program computed it as `c * w`. A norm-wise test
            # would take a row that differs in one entry by far more than rounding for a
            # multiple (one entry 1e-4 off among 100 passes 100 epsilons on the whole row),
            # and the solution `c A^-1 w` would then carry that entry's error, not the solve's.
            if np.all(np.abs(flat[j] - c * flat[i]) <= tol * np.abs(flat[j]) + floor):
                recipe.append((u, c * (scales[j] / scales[i])))  # (back to the rows' own scales)
                break
        else:
            recipe.append((len(unique), 1.0))
            unique.append(j)
            norms.append(norm2)
    return recipe, unique


# A multiple `c w` computed by the program differs from `c` times `w` by a few roundings in each
# entry (one for `c * w`, and the estimate of `c`); `_multiples` allows this many epsilons.
_ROUNDINGS = 8

# `_apart` reads this many leading entries of each row, and takes two of them apart where
# the rows' ratios there differ by more than `_APART` (a multiple's differ by rounding alone).
# `_multiples` asks it of every pair of up to `_FEW` rows (a sparse solve's `b` and its
# cotangent; a host site's few basis cotangents), 0.02 ms a pair.
_SAMPLE = 32
_APART = 1e-3
_FEW = 8


def _apart(u: np.ndarray, v: np.ndarray) -> bool:
    """Whether `v` is surely not a multiple of `u`, nor `u` of `v`, nor either zero, from
    their first `_SAMPLE` entries: two entries `i`, `j` with `v_i u_j` and `u_i v_j` far apart.
    False says nothing (`_multiples` then compares the whole rows). On a sparse solve's `b`
    and one cotangent of 22,500 entries it took 0.02 ms, against 0.6 ms (real) and 1.2 ms
    (complex) for the whole comparison, in the job of each gradient whose cotangent is not a
    multiple of `b`."""
    u, v = np.ravel(u)[:_SAMPLE], np.ravel(v)[:_SAMPLE]
    with np.errstate(all="ignore"):  # (NaN and infinity compare False: such rows are compared whole)
        vu, uv = np.multiply.outer(v, u), np.multiply.outer(u, v)  # (`[i, j]`: `v_i u_j`, `u_i v_j`)
        return bool(np.any(np.abs(vu - uv) > _APART * (np.abs(vu) + np.abs(uv))))


class Identity:
    """A host site's identity, under which the timings of its jobs are kept: its host
    functions, each by identity (a bound method by its object and function), not its name."""

    def __init__(self, *fns: Any):
        self._parts = tuple(p for f in fns for p in ((f.__self__, f.__func__) if inspect.ismethod(f) else (f,)))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Identity)
            and len(other._parts) == len(self._parts)
            and all(a is b for a, b in zip(self._parts, other._parts, strict=True))
        )

    def __hash__(self) -> int:
        return hash(tuple(map(id, self._parts)))


def _first(results: list) -> Any:
    return results[0]


def _given(fn: Callable[..., Any] | None) -> Callable[..., Any]:
    """`fn`, a host function that a job is planned for: one the site was given."""
    assert fn is not None, "a host job was planned for a function the site was not given"
    return fn


@dataclasses.dataclass(frozen=True)
class StackedRows:
    """What a rows function (`Runner.rows`) may return instead of its list of one result a
    row: the results stacked, each leaf with the job's rows on its leading axis, in their
    order. A job of all the request's rows then gives the request's answer as it is, not
    unstacked into rows and stacked again (the 200 rows of a `jax.jacrev` are one array)."""

    tree: Any


@dataclasses.dataclass(frozen=True)
class _HostCall:
    """One call of a host function, with the structure its result must have."""

    impl: str
    fn: Callable[..., Any]
    args: tuple
    expected: Any
    why: str


_MISMATCH = """{call}: the host function `{impl}` returned {found}, where {expected} was expected ({why}).
A host function must return NumPy arrays with exactly the declared shapes and dtypes (convert with
`np.asarray(value, dtype=...)`), or the declaration must be corrected."""

# What a host function's result must be, for `_MISMATCH`.
_EXPECTED_BY_OUT = "declared by `out=`"

_EXPECTED_LIKE_X = "a cotangent shaped like the input `x`"

_EXPECTED_PAIR = "a pair `(y, ct_x)`: `y` declared by `out=`, `ct_x` shaped like the input `x`"

_EXPECTED_PAIR_BATCH = "a pair `(y, ct_xs)`: `y` declared by `out=`, `ct_xs` shaped like the input `x` with a \
leading axis of one cotangent each"

_EXPECTED_PAIR_JVP = "a pair `(y, t_y)`: both declared by `out=`"

_EXPECTED_PAIR_JVP_BATCH = (
    "a pair `(y, t_ys)`: `y` declared by `out=`, `t_ys` the same with a leading axis of one tangent each"
)


@dataclasses.dataclass(frozen=True)
class Runner:
    """The host side of a host `ExpensiveFn`: plans the jobs for a request, runs them, checks
    and assembles the results. Holds no JAX values, so it can run inside a callback."""

    call: str
    name: str
    fwd: Callable[..., Any] | None
    adjoint: Callable[..., Any] | None
    bwd: Callable[..., Any] | None
    fused: Callable[..., Any] | None
    executor: cf.Executor | None
    timeout: float | None
    vectorized: bool
    linear_adjoint: bool
    adjoint_why: str
    jvp: Callable[..., Any] | None = None
    jvp_batch: Callable[..., Any] | None = None
    thread_safe: bool = True
    fused_batch: Callable[..., Any] | None = None
    timed: bool = True  # whether its jobs are timed for the estimates (see the module's docstring)
    key: Any = None  # the identity under which its timings are kept (`Identity`, made by `host`)
    # Optional hooks of host functions that keep state between requests (`dx.sparse_solve`'s
    # factorisations): `scope(kind, elements)`, a context manager around each request (all
    # the rows of a `vmap` batch: `elements`, each one's NumPy arguments); and
    # `adopt(kind, args, out)`, called with the JAX arrays that an eager request returns.
    scope: Callable[[str, list], Any] | None = None
    adopt: Callable[[str, tuple, PyTree], None] | None = None
    # `rows(kind, elements)`, for host functions that serve several rows of a `vmap` batch
    # in one job (`dx.sparse_solve`: the rows on one matrix share its factorisation): the
    # request's jobs, each `(indices, fn, args)`, `fn(*args)` returning the list of the
    # results of the elements `indices`; or None for a job a row.
    rows: Callable[[str, list], list | None] | None = None
    workers: int | None = None  # how many jobs the executor runs at once, when `dx.Cost(workers=)` says

    def __call__(self, kind: str, result: PyTree, arg_structs: PyTree, shapes: tuple, *args: PyTree) -> PyTree:
        """Run `kind` on NumPy `args`; with leading batch axes (from `vmap`) once per element,
        all elements' jobs submitted together. `shapes`: those of one element's input `x`
        (its leaves), by which the timings are kept."""
        args = jtu.tree_map(np.asarray, args)  # a callback receives `jax.Array`s
        first, first_struct = jtu.tree_leaves(args)[0], jtu.tree_leaves(arg_structs)[0]
        ndim = np.ndim(first) - len(first_struct.shape)
        # (under `vmap`, an argument not batched comes with axes of length 1 (`expand_dims`):
        # broadcast here, as views, not copied `k` times by the program and sent over)
        batch = np.broadcast_shapes(*(np.shape(a)[:ndim] for a in jtu.tree_leaves(args)))
        if ndim:
            args = jtu.tree_map(lambda a, s: np.broadcast_to(a, (*batch, *s.shape)), args, arg_structs)
        elements = [args] if not batch else [jtu.tree_map(lambda a, i=i: a[i], args) for i in np.ndindex(batch)]
        with self.scope(kind, elements) if self.scope is not None else contextlib.nullcontext():
            outs = self._run_all(elements, kind, result, shapes)
        if isinstance(outs, StackedRows):  # (one job of all the rows, its results stacked)
            together = outs.tree
        elif not batch:
            return outs[0]
        else:
            together = _stack(outs, result)
        if not batch:
            return jtu.tree_map(lambda a: a[0], together)
        return jtu.tree_map(lambda a, s: np.reshape(a, (*batch, *s.shape)), together, result)

    def _run_all(self, elements: list, kind: str, result: PyTree, shapes: tuple) -> list | StackedRows:
        jobs = self.rows(kind, elements) if self.rows is not None else None
        if jobs is not None:
            return self._run_rows(jobs, len(elements), kind, result, shapes)
        plans = [self._plan(kind, result, args) for args in elements]
        calls = [c for cs, _ in plans for c in cs]
        results, seconds = self._execute(calls)
        self._observe(shapes, calls, seconds)
        outs, start = [], 0
        for cs, assemble in plans:
            outs.append(assemble(results[start : start + len(cs)]))
            start += len(cs)
        return outs

    def _one_call(self, kind: str) -> tuple[Callable[..., Any] | None, str] | None:
        """The host function of a request of `kind` that is one call a row, and what it must
        return (for `_MISMATCH`); None for a kind of several calls."""
        return {
            "fwd": (self.fwd, _EXPECTED_BY_OUT),
            "adjoint": (self.adjoint, self.adjoint_why),
            "bwd": (self.bwd, _EXPECTED_LIKE_X),
            "fused": (self.fused, _EXPECTED_PAIR),
            "jvp": (self.jvp, _EXPECTED_PAIR_JVP),
            "fused_batch": (self.fused_batch, _EXPECTED_PAIR_BATCH),
            "jvp_batch": (self.jvp_batch, _EXPECTED_PAIR_JVP_BATCH),
        }.get(kind)

    def _run_rows(self, jobs: list, n: int, kind: str, result: PyTree, shapes: tuple) -> list | StackedRows:
        """The results of `n` elements from `jobs` (`rows`' answer), one job each of
        several rows: a list, or, from one job of all `n` in order that stacked its results,
        those (`StackedRows`)."""
        one_call = self._one_call(kind)
        assert one_call is not None  # (`rows` answers for one-call requests only)
        why = f"{one_call[1]}, a list of one result a row of the `vmap` batch"
        calls = [_HostCall(kind, fn, args, [result] * len(indices), why) for indices, fn, args in jobs]
        results, seconds = self._execute(calls)
        self._observe(shapes, calls, seconds)
        if len(jobs) == 1 and list(jobs[0][0]) == list(range(n)) and isinstance(results[0], StackedRows):
            return results[0]
        outs: list = [None] * n
        for (indices, _, _), rows in zip(jobs, results, strict=True):
            if isinstance(rows, StackedRows):
                rows = [jtu.tree_map(lambda a, j=j: a[j], rows.tree) for j in range(len(indices))]
            for i, out in zip(indices, rows, strict=True):
                outs[i] = out
        return outs

    def _plan(self, kind: str, result: PyTree, args: tuple) -> tuple[list[_HostCall], Callable[[list], Any]]:
        one_call = self._one_call(kind)
        if one_call is not None:
            fn, why = one_call
            return [_HostCall(kind, _given(fn), args, result, why)], _first
        x, ct = args
        out_struct, second = result
        if kind == "fwd+adjoint":
            calls = [
                _HostCall("fwd", _given(self.fwd), (x,), out_struct, _EXPECTED_BY_OUT),
                _HostCall("adjoint", _given(self.adjoint), (x, ct), second, self.adjoint_why),
            ]
            return calls, tuple
        k = jtu.tree_leaves(ct)[0].shape[0]
        rows = [jtu.tree_map(lambda c, j=j: c[j], ct) for j in range(k)]
        row_struct = _unstack(second)
        if kind == "jvp*k":  # `jvp` once per tangent, all submitted together; `y` from the first
            calls = [
                _HostCall("jvp", _given(self.jvp), (x, row), (out_struct, row_struct), _EXPECTED_PAIR_JVP)
                for row in rows
            ]
            return calls, lambda r: (r[0][0] if r else _zeros(out_struct), _stack([p[1] for p in r], row_struct))
        if kind == "fused*k":  # `fused` once per cotangent; `y` from the first
            calls = [
                _HostCall("fused", _given(self.fused), (x, row), (out_struct, row_struct), _EXPECTED_PAIR)
                for row in rows
            ]
            return calls, lambda r: (r[0][0] if r else _zeros(out_struct), _stack([p[1] for p in r], row_struct))
        # "fwd+adjoints": the forward once and the adjoints, all at the same time
        if self.linear_adjoint:
            recipe, unique = _multiples(rows, row_struct)
        else:
            recipe, unique = [(j, 1.0) for j in range(k)], list(range(k))
        calls = [_HostCall("fwd", _given(self.fwd), (x,), out_struct, _EXPECTED_BY_OUT)]
        calls += [
            _HostCall("adjoint", _given(self.adjoint), (x, rows[j]), row_struct, self.adjoint_why) for j in unique
        ]

        def assemble(r):
            partials = [
                _zeros(row_struct)
                if u is None
                else r[1 + u]
                if c == 1.0
                else jtu.tree_map(lambda p, c=c: (p * c).astype(p.dtype), r[1 + u])
                for u, c in recipe
            ]
            return r[0], _stack(partials, row_struct)

        return calls, assemble

    def _job(self, c: _HostCall) -> _executor.Job:
        """The job of `c`, returning `(result, seconds)`, or `(result, timings it gathered)`."""
        if not self.timed:
            return _executor.Job(c.impl, _timing.Gathered(c.fn), c.args)
        dask = self.executor is not None and _executor.is_dask(self.executor)
        return _executor.Job(c.impl, _timing.Timed(c.fn, by_value=dask), c.args)

    def _execute(self, calls: list[_HostCall]) -> tuple[list, list]:
        """The checked results of `calls`, and the seconds each ran (not timed: the timings
        each gathered)."""
        if not self.vectorized:
            jobs = [self._job(c) for c in calls]
            check = lambda i, r: self._check(calls[i], r[0])  # noqa: E731
            timed = _executor.run(
                self.call,
                self.executor,
                self.timeout,
                jobs,
                serial=not self.thread_safe,
                check=check,
                workers=self.workers,
            )
            results, took = zip(*timed, strict=True) if timed else ((), ())
            return [self._check(c, r) for c, r in zip(calls, results, strict=True)], list(took)
        # One call per host function, with the arguments of all its calls stacked on a leading axis.
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(calls):
            groups.setdefault(c.impl, []).append(i)
        grouped = []
        for impl, members in groups.items():
            head = calls[members[0]]
            args = jtu.tree_map(lambda *a: np.stack(a), *[calls[i].args for i in members])
            size = len(members)
            expected = stacked(head.expected, size)
            why = f"{head.why}, with a leading batch axis of length {len(members)} (`vectorized=True`)"
            grouped.append(_HostCall(impl, head.fn, args, expected, why))
        jobs = [self._job(c) for c in grouped]
        results = _executor.run(
            self.call, self.executor, self.timeout, jobs, serial=not self.thread_safe, workers=self.workers
        )
        out: list = [None] * len(calls)
        seconds: list = [math.nan] * len(calls)
        for (_, members), c, timed in zip(groups.items(), grouped, results, strict=True):
            r, t = timed
            r = self._check(c, r)
            for n, i in enumerate(members):
                out[i] = jtu.tree_map(lambda a, n=n: a[n], r)
                seconds[i] = t / len(members) if self.timed else t  # (the examples of one call share its time)
        return out, seconds

    def _observe(self, shapes: tuple, calls: list[_HostCall], seconds: list) -> None:
        """Feed the estimates one sample of each kind from this request's jobs (see the
        module's docstring)."""
        if not self.timed:  # (what each job gathered, by site and shapes)
            gathered: dict[tuple, dict[str, float]] = {}
            for found in seconds:
                for site, times in found.items():
                    into = gathered.setdefault(site, {})
                    for what, t in times.items():
                        into[what] = min(t, into.get(what, math.inf))
            for (key, observed_shapes), times in gathered.items():
                _cost.observe(key, observed_shapes, **times)
            return
        least: dict[str, float] = {}
        for c, t in zip(calls, seconds, strict=True):
            if c.impl in ("fwd", "adjoint", "bwd"):
                shares = {"bwd" if c.impl != "fwd" else "fwd": t}
            elif c.impl in ("fused", "fused_batch"):
                k = jtu.tree_leaves(c.args[1])[0].shape[0] if c.impl == "fused_batch" else 1
                shares = {"fwd": t / (k + 1), "bwd": t / (k + 1)}
            else:
                continue
            for what, share in shares.items():
                least[what] = min(share, least.get(what, math.inf))
        if least:
            _cost.observe(self.key, shapes, **least)

    def _check(self, c: _HostCall, r: Any) -> PyTree:
        if isinstance(r, StackedRows):  # (a rows function's results stacked: checked so)
            rows = dataclasses.replace(c, expected=stacked(c.expected[0], len(c.expected)))
            return StackedRows(self._check(rows, r.tree))
        if isinstance(c.expected, tuple) and isinstance(r, list | tuple) and len(r) == len(c.expected):
            r = tuple(r)
        r = jtu.tree_map(lambda a: np.asarray(a) if isinstance(a, _ARRAY_LIKE) else a, r)
        ok = jtu.tree_structure(r) == jtu.tree_structure(c.expected) and all(
            isinstance(a, np.ndarray) and a.shape == s.shape and a.dtype == s.dtype
            for a, s in zip(jtu.tree_leaves(r), jtu.tree_leaves(c.expected), strict=True)
        )
        if not ok:
            raise ValueError(
                _MISMATCH.format(
                    call=self.call,
                    impl=c.impl,
                    found=_messages.tree_text(r),
                    expected=_messages.tree_text(c.expected),
                    why=c.why,
                )
            )
        return r
