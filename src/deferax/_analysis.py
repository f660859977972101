"""The static check: which call sites may run on the deferred schedule.

The user's program is traced twice with every `ExpensiveFn` call replaced by a stand-in:

1. *Discovery* (`jax.eval_shape`): records each call site, its input and output structures,
   and whether it was called directly in the differentiated function or inside a nested
   transformation (`vmap`, `scan`, `cond`, `jit`, `checkpoint`, ...).
2. *Analysis* (`jax.make_jaxpr`): the output of a direct site `k` becomes an input `ys[k]`;
   a nested site's output becomes `t_k * (1 + sum(x))`, with a scalar input `t_k`, so that
   anything depending on it, or differentiating through it, depends on `t_k`. The traced
   function returns, for every direct site, its input, the arrays its implementations carry,
   and the cotangent of the loss with respect to its output (for a seed cotangent given as
   an input too).

A direct site `k` is deferred only if all of these hold:

- it has a `fused` implementation;
- its input (and its implementations' arrays) depend on no stand-in: they can be computed
  before any expensive call runs;
- its output feeds the input of no other site, so its cotangent arrives only through the
  cheap program and not through another site's derivative;
- its cotangent depends on no stand-in: the program's backward pass can compute it without
  any expensive output.

Under these conditions, evaluating the analysis program with zeros in place of every
stand-in gives the exact inputs and cotangents of the deferred sites. The dependency
analysis is syntactic (`_jaxpr.dependencies`), so it can only over-approximate: a site may
stay standard when it could have been deferred, never the reverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _errors, _jaxpr, _sites
from ._expensive import ExpensiveFn
from ._plan import Plan, Site

# Part of every jit cache key: each recording pass sets a fresh value, so a `jax.jit` (or
# `eqx.filter_jit`) inside the user's program is re-traced for each pass and never replays a
# jaxpr that was recorded with another pass's stand-ins.
_PASS = jax.make_user_context(default_value=None)
_pass_counter = iter(range(1, 2**62))


def fresh_pass():
    """A context in which nested jits are traced afresh."""
    return _PASS(next(_pass_counter))


def _describe(tree: Any) -> str:
    leaves = jtu.tree_leaves(tree)
    parts = [_errors.shape_text(s) for s in leaves]
    text = ", ".join(parts)
    return text if len(leaves) == 1 else f"({text})"


def _zeros(struct: Any) -> Any:
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), struct)


@dataclasses.dataclass
class SiteRecord:
    """What discovery learnt about one call site."""

    index: int
    static: Any  # the non-array part of the ExpensiveFn (its callables and configuration)
    name: str
    has_fused: bool
    custom_vjp: bool
    max_basis: int | None
    x_struct: Any
    y_struct: Any
    nested: str | None  # the kind of nested transformation, or None for a direct call


class _Discover:
    def __init__(self):
        self.top: object | None = None
        self.records: list[SiteRecord] = []

    def call(self, fn: ExpensiveFn, x: Any) -> Any:
        trace = _jaxpr.current_trace()
        nested = None if trace is self.top else _jaxpr.trace_kind(trace)
        y_struct = fn.out_struct(x)
        _, static = eqx.partition(fn, eqx.is_array)
        self.records.append(
            SiteRecord(
                index=len(self.records),
                static=static,
                name=fn.name,
                has_fused=fn.fused is not None or fn.fused_batch is not None,
                custom_vjp=fn.has_custom_vjp,
                max_basis=fn.max_basis,
                x_struct=jax.eval_shape(lambda v: v, x),
                y_struct=y_struct,
                nested=nested,
            )
        )
        return _zeros(y_struct)


class _Analyse:
    """Direct sites read their output from `ys`; nested sites return a stand-in made of `ts`."""

    def __init__(self, records: list[SiteRecord], ys: list, ts: list):
        self.records = records
        self.ys = ys
        self.ts = ts
        self.top: object | None = None
        self.count = 0
        self.xs: list = []
        self.impls: list = []

    def call(self, fn: ExpensiveFn, x: Any) -> Any:
        record = next_record(self.records, self.count, fn, x)
        self.count += 1
        if record.nested is None:
            self.xs.append(x)
            self.impls.append(eqx.filter(fn, eqx.is_array))
            return self.ys[record.index]
        t = self.ts[record.index]
        total = sum((jnp.sum(jnp.real(leaf)).astype(t.dtype) for leaf in jtu.tree_leaves(x)), start=jnp.zeros((), t.dtype))
        scale = t * (1 + total)
        return jtu.tree_map(lambda s: jnp.broadcast_to(scale, s.shape).astype(s.dtype), record.y_struct)


def _shapes(tree: Any) -> tuple:
    """Structure, shapes and dtypes (not weak types, which differ between traces)."""
    leaves, treedef = jtu.tree_flatten(tree)
    return treedef, tuple((tuple(jnp.shape(a)), jnp.dtype(a.dtype)) for a in leaves)


def next_record(records: list[SiteRecord], count: int, fn: ExpensiveFn, x: Any) -> SiteRecord:
    """The record for the `count`-th call, checking that the program calls the same sites."""
    if count >= len(records):
        raise RuntimeError(_errors.SITES_CHANGED.format(found=f"more than {len(records)} calls", name=fn.name))
    record = records[count]
    if record.name != fn.name or _shapes(x) != _shapes(record.x_struct):
        raise RuntimeError(
            _errors.SITES_CHANGED.format(found=f"call {count} is `{fn.name}` on {_describe(x)}", name=record.name)
        )
    return record


@dataclasses.dataclass
class Basis:
    """A site on the basis schedule: its cotangent is a combination of `k` fixed cotangents."""

    k: int
    frontier: Any  # ClosedJaxpr of (dyn leaves, ys, ts) -> the frontier variables


@dataclasses.dataclass
class Analysis:
    """The outcome of the static check, with what the deferred execution needs."""

    plan: Plan
    records: list[SiteRecord]
    deferred: tuple[int, ...]  # sites run with one `fused(x, ct)` (plain or basis)
    early: tuple[int, ...]  # standard sites whose `fwd` runs alongside the deferred `fused` calls
    basis: dict[int, Basis]  # the deferred sites on the basis schedule
    jaxpr: Any  # ClosedJaxpr of (dyn leaves, ys, ts, seed) -> (xs, impls, cts) for direct sites
    direct: tuple[int, ...]  # indices of the direct sites, in the order of the jaxpr's outputs
    out_tree: Any  # treedef of (xs, impls, cts)


def _value_of(out: Any, has_aux: bool, where: str) -> Any:
    value = out[0] if has_aux else out
    if jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
        raise TypeError(_errors.NOT_SCALAR.format(where=where, found=_describe(jax.eval_shape(lambda v: v, value))))
    return value


class _Tracer:
    """Traces the user's program with every site replaced by its stand-in."""

    def __init__(self, call, records, has_aux, where):
        self.call, self.records, self.has_aux, self.where = call, records, has_aux, where

    def loss(self, leaves, ys, ts, rec=None):
        rec = rec or _Analyse(self.records, ys, ts)
        rec.ys = ys
        rec.top = _jaxpr.current_trace()
        with _sites.recording(rec):
            out = self.call(leaves)
        return _value_of(out, self.has_aux, self.where), rec

    def backward(self, direct):
        """(leaves, ys, ts, seed) -> (inputs, implementation arrays, cotangents) of the direct sites."""

        def analysis(leaves, ys, ts, seed):
            rec = _Analyse(self.records, ys, ts)

            def program(ys_):
                value, _ = self.loss(leaves, ys_, ts, rec)
                return value, (rec.xs, rec.impls)

            _, vjp, (xs, impls) = jax.vjp(program, ys, has_aux=True)
            (cts,) = vjp(seed)
            return xs, impls, [cts[i] for i in direct]

        return analysis

    def forward(self, leaves, ys, ts):
        return self.loss(leaves, ys, ts)[0]


def analyse(
    call: Callable[[list], Any],
    dyn_structs: list,
    *,
    has_aux: bool,
    schedule: str,
    max_basis: int,
    where: str,
) -> Analysis:
    """Run the static check on `call(dyn_leaves)`, the user's program on its array leaves."""
    discover = _Discover()

    def discovery(leaves):
        discover.top = _jaxpr.current_trace()
        with _sites.recording(discover):
            return call(leaves)

    with fresh_pass():
        out_struct = jax.eval_shape(discovery, dyn_structs)
    _value_of(out_struct, has_aux, where)
    records = discover.records
    direct = tuple(r.index for r in records if r.nested is None)
    tracer = _Tracer(call, records, has_aux, where)
    ys_structs = [r.y_struct for r in records]
    ts_structs = [jax.ShapeDtypeStruct((), jnp.result_type(float)) for _ in records]
    check = _Check(records, direct, schedule, max_basis, where)
    if direct and schedule != "standard":
        seed_struct = jax.ShapeDtypeStruct((), out_struct[0].dtype if has_aux else out_struct.dtype)
        with fresh_pass():
            check.jaxpr, shapes = jax.make_jaxpr(tracer.backward(direct), return_shape=True)(
                dyn_structs, ys_structs, ts_structs, seed_struct
            )
        check.out_tree = jtu.tree_structure(shapes)
        check.labels = _labels(dyn_structs, ys_structs, ts_structs)
        check.dependence = _dependence(check.jaxpr, check.labels, direct, shapes)

        def forward_jaxpr():
            with fresh_pass():
                return jax.make_jaxpr(tracer.forward)(dyn_structs, ys_structs, ts_structs)

        check.forward_jaxpr = forward_jaxpr
    return check.run()


def _labels(dyn_structs, ys_structs, ts_structs):
    labels: list[object] = [None] * len(jtu.tree_leaves(dyn_structs))
    for i, y in enumerate(ys_structs):
        labels += [("y", i)] * len(jtu.tree_leaves(y))
    labels += [("t", i) for i in range(len(ts_structs))]
    labels.append("seed")
    return labels


def _dependence(jaxpr, labels, direct, shapes):
    """For each direct site: which stand-ins its input, its implementations' arrays and its
    cotangent depend on, and where its cotangent sits among the jaxpr's outputs."""
    deps = _jaxpr.dependencies(jaxpr, labels)
    result: dict[int, dict[str, Any]] = {site: {} for site in direct}
    offset = 0
    for key, group in zip(("x", "impl", "ct"), shapes, strict=True):
        for site, value in zip(direct, group, strict=True):
            n = len(jtu.tree_leaves(value))
            result[site][key] = frozenset().union(*deps[offset : offset + n]) - {"seed"}
            if key == "ct":
                result[site]["ct_outputs"] = range(offset, offset + n)
            offset += n
    return result


def _site_name(records, label) -> str:
    return f"#{label[1]} `{records[label[1]].name}`"


class _Check:
    """Decides the schedule of each site from the dependences found by the analysis."""

    def __init__(self, records, direct, schedule, max_basis, where):
        self.records, self.direct, self.schedule, self.max_basis, self.where = records, direct, schedule, max_basis, where
        self.jaxpr = self.out_tree = self.labels = self.forward_jaxpr = None
        self.dependence: dict = {}
        self._forward = None

    def run(self) -> Analysis:
        feeds: dict[int, list[int]] = {}
        for site in self.direct:
            for label in self.dependence.get(site, {}).get("x", frozenset()) | self.dependence.get(site, {}).get("impl", frozenset()):
                feeds.setdefault(label[1], []).append(site)
        sites, deferred, basis = [], [], {}
        for r in self.records:
            schedule, reason, location, k = self._decide(r, feeds)
            if schedule != "standard":
                deferred.append(r.index)
            if schedule == "deferred-basis":
                basis[r.index] = k
            sites.append(
                Site(
                    index=r.index,
                    name=r.name,
                    in_shapes=_describe(r.x_struct),
                    out_shapes=_describe(r.y_struct),
                    schedule=schedule,
                    reason=reason,
                    location=location,
                    k=k.k if isinstance(k, Basis) else k,
                )
            )
        # A standard site whose input needs no expensive output can run its `fwd` in the
        # same stage as the deferred sites' `fused` calls (only worth it when there are any).
        early = [
            r.index
            for r in self.records
            if deferred and r.index not in deferred and r.nested is None and r.custom_vjp
            and not (self.dependence[r.index]["x"] | self.dependence[r.index]["impl"])
        ]  # fmt: skip
        if self.schedule == "deferred":
            refused = [s for s in sites if s.schedule == "standard"]
            if refused:
                lines = "\n".join(f"  site #{s.index} `{s.name}`: {s.reason}" for s in refused)
                raise ValueError(_errors.CANNOT_DEFER.format(where=self.where, lines=lines))
        plan = Plan(sites=tuple(sites), stages=_stages(self.records, deferred, basis, early), requested=self.schedule)
        return Analysis(
            plan=plan,
            records=self.records,
            deferred=tuple(deferred),
            early=tuple(early),
            basis=basis,
            jaxpr=self.jaxpr,
            direct=self.direct,
            out_tree=self.out_tree,
        )

    def _decide(self, r: SiteRecord, feeds):
        """(schedule, reason, location, basis or k) for one site."""
        if self.schedule == "standard":
            return "standard", "schedule='standard' was requested", None, None
        if r.nested is not None:
            return "standard", f"called inside {r.nested}; only sites called directly in the differentiated function are deferred", None, None
        if not r.has_fused:
            return "standard", "no `fused` implementation", None, None
        dep = self.dependence[r.index]
        upstream = sorted(dep["x"] | dep["impl"])
        if upstream:
            return "standard", "its input depends on the output of site " + ", ".join(_site_name(self.records, lab) for lab in upstream), None, None
        if r.index in feeds:
            return "standard", "its output feeds the input of site " + ", ".join(f"#{j} `{self.records[j].name}`" for j in feeds[r.index]), None, None
        if not dep["ct"]:
            return "deferred", None, None, None
        # The cotangent depends on expensive outputs: say where, then try the basis schedule.
        sources = dep["ct"]
        location = None
        for k in dep["ct_outputs"]:
            loc = _jaxpr.first_culprit(self.jaxpr, self.labels, k, frozenset(sources), "seed")
            if loc is not None:
                location = str(loc)
                break
        others = sorted(lab for lab in sources if lab != ("y", r.index))
        if ("y", r.index) in sources:
            reason = "its cotangent depends on its own output"
        else:
            reason = "its cotangent depends on the output of site " + ", ".join(_site_name(self.records, lab) for lab in others)
        if location is not None:
            reason += f", through {location}"
        basis = self._basis(r)
        limit = r.max_basis if r.max_basis is not None else self.max_basis
        if basis.k <= limit:
            return "deferred-basis", None, location, basis
        reason += f"; it is a combination of k={basis.k} fixed cotangents, more than max_basis={limit}"
        return "standard", reason, location, basis.k

    def _basis(self, r: SiteRecord) -> Basis:
        if self._forward is None:
            self._forward = self.forward_jaxpr()
        closed = self._forward
        labels = self.labels[:-1]  # the forward program has no seed input
        source = [lab == ("y", r.index) for lab in labels]
        stand_ins = [lab is not None for lab in labels]
        frontier = _jaxpr.linear_frontier(closed, source, stand_ins)
        return Basis(k=_jaxpr.frontier_size(frontier), frontier=_jaxpr.with_outputs(closed, frontier))


def _stages(records: list[SiteRecord], deferred: list[int], basis: dict, early: list[int]) -> tuple[tuple[str, ...], ...]:
    """The expensive work in order: the deferred sites' `fused` calls together with the
    `fwd` of every standard site that needs no expensive output; then the other standard
    sites' `fwd` in program order; then every standard site's `bwd`, in reverse."""
    stages: list[tuple[str, ...]] = []
    if deferred:
        stages.append(
            tuple(f"{records[i].name}: fused" + (f" (k={basis[i].k} cotangents)" if i in basis else "") for i in deferred)
            + tuple(f"{records[i].name}: fwd" for i in early)
        )
    standard = [r for r in records if r.index not in deferred]
    stages.extend((f"{r.name}: fwd",) for r in standard if r.index not in early)
    stages.extend((f"{r.name}: bwd",) for r in reversed(standard))
    return tuple(stages)
