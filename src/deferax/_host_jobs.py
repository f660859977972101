"""The host side of `dx.host`: what to submit for a request (a forward solve, adjoints, a
batch from `vmap`), submitting it, and checking and assembling what comes back.

Runs outside JAX (inside a `jax.pure_callback`, or directly on concrete arrays): NumPy in,
NumPy out.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _errors, _executor

MISMATCH = """{call}: the host function `{impl}` returned {found}, where {expected} was expected ({why}).
A host function must return NumPy arrays with exactly the declared shapes and dtypes (convert with
`np.asarray(value, dtype=...)`), or the declaration must be corrected."""

BY_OUT = "declared by `out=`"
LIKE_X = "a cotangent shaped like the input `x`"
PAIR = "a pair `(y, ct_x)`: `y` declared by `out=`, `ct_x` shaped like the input `x`"
PAIR_BATCH = "a pair `(y, ct_xs)`: `y` declared by `out=`, `ct_xs` shaped like the input `x` with a leading axis of one cotangent each"
PAIR_JVP = "a pair `(y, t_y)`: both declared by `out=`"
PAIR_JVP_BATCH = "a pair `(y, t_ys)`: `y` declared by `out=`, `t_ys` the same with a leading axis of one tangent each"

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
    complex_ok = all(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in jtu.tree_leaves(partial_struct))
    recipe: list[tuple[int | None, Any]] = []
    unique: list[int] = []
    norms: list[float] = []  # the squared norm of each unique row
    if not rows:
        return recipe, unique
    leaves = [jtu.tree_leaves(row) for row in rows]
    flat = np.stack([np.concatenate([np.ravel(leaf) for leaf in ls]) for ls in leaves]).astype(np.complex128)
    conj = flat.conj()
    for j, ls in enumerate(leaves):
        tol = 100 * np.finfo(np.result_type(*[leaf.dtype for leaf in ls])).eps
        # `<w, v>` for this row `v` and every unique row `w` so far, summed by NumPy: not BLAS
        # (`np.vdot`, `@`), whose threads wait for cores on a loaded machine (0.8 s for 6 rows
        # of 22,500 entries with one `np.vdot` a pair, at a load of 8 on 2 cores).
        dots = np.sum(conj[[j, *unique]] * flat[j], axis=1)
        norm2 = dots[0].real
        if norm2 == 0.0:
            recipe.append((None, 0.0))
            continue
        for u, (i, w2, d) in enumerate(zip(unique, norms, dots[1:], strict=True)):
            if abs(d) ** 2 < 0.5 * w2 * norm2:  # far from parallel (a multiple has `|<w, v>| = |w| |v|`)
                continue
            c = d / w2
            real = abs(c.imag) <= tol * abs(c)
            residual = flat[j] - c * flat[i]
            if (complex_ok or real) and np.sum(residual.conj() * residual).real <= tol**2 * norm2:
                recipe.append((u, c if complex_ok and not real else c.real))
                break
        else:
            recipe.append((len(unique), 1.0))
            unique.append(j)
            norms.append(norm2)
    return recipe, unique


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a host function, with the structure its result must have."""

    impl: str
    fn: Callable[..., Any]
    args: tuple
    expected: Any
    why: str


@dataclasses.dataclass(frozen=True)
class Runner:
    """The host side of a host `ExpensiveFn`: plans the jobs for a request, runs them, checks
    and assembles the results. Holds no JAX values, so it can run inside a callback."""

    call: str
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

    def __call__(self, kind: str, result: PyTree, arg_structs: PyTree, *args: PyTree) -> PyTree:
        """Run `kind` on NumPy `args`; with leading batch axes (from `vmap`) once per element,
        all elements' jobs submitted together."""
        args = jtu.tree_map(np.asarray, args)  # a callback receives `jax.Array`s
        first, first_struct = jtu.tree_leaves(args)[0], jtu.tree_leaves(arg_structs)[0]
        batch = tuple(np.shape(first)[: np.ndim(first) - len(first_struct.shape)])
        if not batch:
            return self._run_all([args], kind, result)[0]
        elements = [jtu.tree_map(lambda a, i=i: a[i], args) for i in np.ndindex(batch)]
        outs = self._run_all(elements, kind, result)
        stacked = _stack(outs, result)
        return jtu.tree_map(lambda a, s: np.reshape(a, (*batch, *s.shape)), stacked, result)

    def _run_all(self, elements: list, kind: str, result: PyTree) -> list:
        plans = [self._plan(kind, result, args) for args in elements]
        calls = [c for cs, _ in plans for c in cs]
        results = self._execute(calls)
        outs, start = [], 0
        for cs, assemble in plans:
            outs.append(assemble(results[start : start + len(cs)]))
            start += len(cs)
        return outs

    def _plan(self, kind: str, result: PyTree, args: tuple) -> tuple[list[_Call], Callable[[list], Any]]:
        first = lambda r: r[0]  # noqa: E731
        if kind == "fwd":
            return [_Call("fwd", self.fwd, args, result, BY_OUT)], first
        if kind == "adjoint":
            return [_Call("adjoint", self.adjoint, args, result, self.adjoint_why)], first
        if kind == "bwd":
            return [_Call("bwd", self.bwd, args, result, LIKE_X)], first
        if kind == "fused":
            return [_Call("fused", self.fused, args, result, PAIR)], first
        if kind == "jvp":
            return [_Call("jvp", self.jvp, args, result, PAIR_JVP)], first
        if kind == "fused_batch":
            return [_Call("fused_batch", self.fused_batch, args, result, PAIR_BATCH)], first
        if kind == "jvp_batch":
            return [_Call("jvp_batch", self.jvp_batch, args, result, PAIR_JVP_BATCH)], first
        x, ct = args
        out_struct, second = result
        if kind == "fwd+adjoint":
            calls = [_Call("fwd", self.fwd, (x,), out_struct, BY_OUT), _Call("adjoint", self.adjoint, (x, ct), second, self.adjoint_why)]
            return calls, tuple
        k = jtu.tree_leaves(ct)[0].shape[0]
        rows = [jtu.tree_map(lambda c, j=j: c[j], ct) for j in range(k)]
        row_struct = _unstack(second)
        if kind == "jvp*k":  # `jvp` once per tangent, all submitted together; `y` from the first
            calls = [_Call("jvp", self.jvp, (x, row), (out_struct, row_struct), PAIR_JVP) for row in rows]
            return calls, lambda r: (r[0][0] if r else _zeros(out_struct), _stack([p[1] for p in r], row_struct))
        if kind == "fused*k":  # `fused` once per cotangent; `y` from the first
            calls = [_Call("fused", self.fused, (x, row), (out_struct, row_struct), PAIR) for row in rows]
            return calls, lambda r: (r[0][0] if r else _zeros(out_struct), _stack([p[1] for p in r], row_struct))
        # "fwd+adjoints": the forward once and the adjoints, all at the same time
        if self.linear_adjoint:
            recipe, unique = _multiples(rows, row_struct)
        else:
            recipe, unique = [(j, 1.0) for j in range(k)], list(range(k))
        calls = [_Call("fwd", self.fwd, (x,), out_struct, BY_OUT)]
        calls += [_Call("adjoint", self.adjoint, (x, rows[j]), row_struct, self.adjoint_why) for j in unique]

        def assemble(r):
            partials = [
                _zeros(row_struct) if u is None else r[1 + u] if c == 1.0 else jtu.tree_map(lambda p, c=c: (p * c).astype(p.dtype), r[1 + u])
                for u, c in recipe
            ]
            return r[0], _stack(partials, row_struct)

        return calls, assemble

    def _execute(self, calls: list[_Call]) -> list:
        if not self.vectorized:
            jobs = [_executor.Job(c.impl, c.fn, c.args) for c in calls]
            check = lambda i, r: self._check(calls[i], r)  # noqa: E731
            results = _executor.run(self.call, self.executor, self.timeout, jobs, serial=not self.thread_safe, check=check)
            return [self._check(c, r) for c, r in zip(calls, results, strict=True)]
        # One call per host function, with the arguments of all its calls stacked on a leading axis.
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(calls):
            groups.setdefault(c.impl, []).append(i)
        stacked = []
        for impl, members in groups.items():
            head = calls[members[0]]
            args = jtu.tree_map(lambda *a: np.stack(a), *[calls[i].args for i in members])
            size = len(members)
            expected = jtu.tree_map(lambda s, n=size: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), head.expected)
            why = f"{head.why}, with a leading batch axis of length {len(members)} (`vectorized=True`)"
            stacked.append(_Call(impl, head.fn, args, expected, why))
        jobs = [_executor.Job(c.impl, c.fn, c.args) for c in stacked]
        results = _executor.run(self.call, self.executor, self.timeout, jobs, serial=not self.thread_safe)
        out: list = [None] * len(calls)
        for (_, members), c, r in zip(groups.items(), stacked, results, strict=True):
            r = self._check(c, r)
            for n, i in enumerate(members):
                out[i] = jtu.tree_map(lambda a, n=n: a[n], r)
        return out

    def _check(self, c: _Call, r: Any) -> PyTree:
        if isinstance(c.expected, tuple) and isinstance(r, list | tuple) and len(r) == len(c.expected):
            r = tuple(r)
        r = jtu.tree_map(lambda a: np.asarray(a) if isinstance(a, _ARRAY_LIKE) else a, r)
        ok = jtu.tree_structure(r) == jtu.tree_structure(c.expected) and all(
            isinstance(a, np.ndarray) and a.shape == s.shape and a.dtype == s.dtype
            for a, s in zip(jtu.tree_leaves(r), jtu.tree_leaves(c.expected), strict=True)
        )
        if not ok:
            raise ValueError(MISMATCH.format(call=self.call, impl=c.impl, found=_errors.tree_text(r), expected=_errors.tree_text(c.expected), why=c.why))
        return r
