"""The static check: which expensive calls may run on a deferred schedule.

Its input is the program traced once: a closed jaxpr `J(consts, leaves) -> (value, aux)`
in which every call of an `ExpensiveFn` is a `deferax_site` equation (a nested `jit` or
`checkpoint` holding one is inlined first). A site at the top level of `J` (one called
under `vmap` included: the batching rule keeps it one equation) is deferred only if all of
these hold:

- it has a `fused` implementation;
- its operands (input, and the arrays of its implementations) depend on no expensive
  output: they can be computed before any expensive call runs;
- its output feeds no other expensive call, so its cotangent arrives only through the
  cheap program;
- its cotangent depends on no expensive output. To see that, the backward pass of `J` with
  respect to the sites' outputs is traced once, `G(consts, leaves, ys, seed) -> (cts,
  operands)`, with every top-level site's output an input `ys[i]`; equations that hold
  expensive calls inside (`scan`, `cond`, custom rules) are sources too.

Under these conditions evaluating `G` with zeros for every `ys` gives the exact operands and
cotangents of the deferred sites. The dependency analysis is syntactic
(`_jaxpr.dependencies`), so it can only over-approximate: a site may stay standard when it
could have been deferred, never the reverse.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from .. import _jaxpr, _site
from .._checks import _messages
from .._implementation._abstract import AbstractImplementation
from .._misc import struct_of, structs
from .._plan import _cost
from .._plan._decision import Basis, Decision
from .._plan._plan import Plan, Site
from ._bwd import bwd_decisions


def _describe(structs_) -> str:
    parts = [_messages.shape_text(s) for s in structs_]
    text = ", ".join(parts)
    return text if len(parts) == 1 else f"({text})"


@dataclasses.dataclass
class Analysis:
    """The outcome of the static check, with what the stages need."""

    plan: Plan
    program: Any  # J: ClosedJaxpr of (consts, leaves) -> (value, aux arrays), sites inlined
    sites: tuple[int, ...]  # equation indices of the top-level sites, in program order
    nested: tuple[int, ...]  # equation indices of equations holding expensive calls inside
    deferred: tuple[int, ...]  # positions (in `sites`) run with one `fused(x, ct)` (plain or basis)
    early: tuple[int, ...]  # standard positions whose `fwd` runs alongside the deferred calls
    basis: dict[int, Basis]
    backward: Any  # G, pruned to what stage 1 needs: (consts, leaves, ys, seed) -> (cts, operands)
    backward_out: tuple  # for each output of `backward`: ("ct", position, leaf) or ("op", position, leaf)
    # the reverse-mode strategy planned for each site not deferred ("standard" or "forward-basis"), by `Spec`:
    # stage 3 differentiates them so (`_site.planned`), whatever timings came in since
    strategies: dict = dataclasses.field(default_factory=dict)

    def derived(self, position: int) -> bool:
        """Whether a deferred site's `fused` is made from its `fwd` and its `adjoint` or
        `y`-free `bwd` (it has none of its own)."""
        static = self.spec(position).static
        return static.fused is None and static.fused_batch is None

    def spec(self, position: int) -> _site.Spec:
        return _site.spec_of(self.program.jaxpr.eqns[self.sites[position]])

    @property
    def live(self) -> bool:
        """Whether stage 3 still runs expensive implementations (standard sites)."""
        return bool(self.nested) or len(self.deferred) < len(self.sites) or bool(self.early)


def analyse(
    program, n_consts: int, *, schedule: str, max_basis: int | None, where: str, bwds: tuple | None = None
) -> Analysis:
    """Run the static check on `program` (`J`, with its constants as leading inputs).
    `bwds`: what `bwd_decisions(program)` returned, if it was called already.

    A value computed twice the same way is computed once first (`fl(y)[argmax(fl(y))]`
    sees one view of `y`, not two): the analysis and the stages see one variable. (Sites
    are never merged, so `bwds` holds for the merged program too.)"""
    program = _jaxpr.merge_duplicates(program, keep=(_site.SITE, _site.LINEAR))
    jaxpr = program.jaxpr
    sites = tuple(_jaxpr.top_level(program, _site.SITE))
    nested = tuple(
        i for i, e in enumerate(jaxpr.eqns) if str(e.primitive) != _site.SITE and _jaxpr.contains(e, (_site.SITE,))
    )
    specs = [_site.spec_of(jaxpr.eqns[i]) for i in sites]
    bwds = bwd_decisions(program) if bwds is None else bwds
    check = _Check(program, n_consts, sites, nested, specs, schedule, max_basis, where, bwds)
    return check.run()


class _Check:
    def __init__(self, program, n_consts, sites, nested, specs, schedule, max_basis, where, bwds):
        self.program, self.n_consts, self.sites, self.nested, self.specs = program, n_consts, sites, nested, specs
        self.schedule, self.max_basis, self.where, self.bwds = schedule, max_basis, where, bwds
        self.n_in = len(program.jaxpr.invars)
        self.eqn_labels = {i: ("y", k) for k, i in enumerate(sites)} | {i: ("n", i) for i in nested}
        self._substituted = None
        self.fallback = _fallback(program)

    # ------------------------------------------------------------------ the order of the plan

    def _entries(self):
        """Every expensive call in program order: (position or None, spec, nested kind or None)."""
        entries = []
        for i, eqn in enumerate(self.program.jaxpr.eqns):
            if i in self.sites:
                entries.append((self.sites.index(i), self.specs[self.sites.index(i)], None))
            elif i in self.nested:
                for inner in _jaxpr.nested_in(eqn, _site.SITE):
                    entries.append((None, _site.spec_of(inner), _jaxpr.kind_of(eqn)))
        return entries

    def run(self) -> Analysis:
        n = len(self.sites)
        marks = _jaxpr.input_marks(self.program, [None] * self.n_in, self.eqn_labels)
        upstream, feeds = {}, {}
        for k, i in enumerate(self.sites):
            upstream[k] = frozenset().union(*marks[i])
            for lab in upstream[k]:
                feeds.setdefault(lab, []).append(f"#{k} `{self.specs[k].name}`")
        for i in self.nested:
            for lab in frozenset().union(*marks[i]):
                feeds.setdefault(lab, []).append(
                    f"the expensive call inside {_jaxpr.kind_of(self.program.jaxpr.eqns[i])}"
                )
        decisions: dict[int, Decision] = {}
        once: dict[int, str | None] = {}
        candidates = []
        for k in range(n):
            reason = self._structural(k, upstream, feeds)
            if reason is None:
                candidates.append(k)
            else:
                decisions[k] = Decision("standard", reason)
        backward, backward_out = None, ()
        if candidates:
            ready = [k for k in range(n) if not upstream[k]]  # operands computable in stage 1
            backward, backward_out, ct_deps, labels = self._backward(candidates, ready)
            once = {k: self._ahead_once(backward, backward_out, k) for k in {*ready, *candidates}}
            for k in candidates:
                decisions[k] = (
                    Decision("standard", once[k]) if once[k] else self._decide(k, ct_deps[k], backward, labels)
                )
        for k in range(n):
            if decisions[k].schedule == "standard":
                decisions[k] = _with_forward_basis(decisions[k], self.specs[k])
        deferred = tuple(k for k in range(n) if decisions[k].deferred)
        basis = {k: b for k in deferred if (b := decisions[k].basis) is not None}
        early = tuple(
            k
            for k in range(n)
            if deferred
            and k not in deferred
            and not self.specs[k].static.autodiff
            and decisions[k].schedule == "standard"
            and not upstream[k]
            and not once.get(k)
        )
        if backward is not None:
            keep = [
                (kind == "ct" and k in deferred and k not in basis) or (kind == "op" and (k in deferred or k in early))
                for kind, k, _ in backward_out
            ]
            backward = _jaxpr.prune(backward, keep)
            backward_out = tuple(o for o, u in zip(backward_out, keep, strict=True) if u)
        plan = self._plan(decisions, deferred, basis, early)
        strategies = {
            spec: s.schedule
            for (_, spec, _), s in zip(self._entries(), plan.sites, strict=True)
            if s.schedule in ("standard", "forward-basis")
        }
        return Analysis(
            plan, self.program, self.sites, self.nested, deferred, early, basis, backward, backward_out, strategies
        )

    def _structural(self, k, upstream, feeds) -> str | None:
        spec = self.specs[k]
        if self.fallback is not None:
            return self.fallback
        if self.schedule == "standard":
            return "schedule='standard' was requested"
        if spec.static.prefer is not None:
            return f"prefer={spec.static.prefer!r} was given"
        underivable = self._underivable(k) if spec.static.fused is None and spec.static.fused_batch is None else None
        if underivable is not None:
            return underivable
        if upstream[k]:
            return "its input depends on " + ", ".join(self._source(lab) for lab in sorted(upstream[k], key=str))
        if ("y", k) in feeds:
            return "its output feeds the input of " + ", ".join(
                f"site {f}" if f.startswith("#") else f for f in feeds[("y", k)]
            )
        return None

    def _underivable(self, k) -> str | None:
        """Why no `fused` can be made from the other implementations (None when one can:
        `fwd` with `adjoint`, or `fwd` with a `bwd` that does not read `y` and calls
        nothing deferax cannot read)."""
        static = self.specs[k].static
        if static.fwd is None or (static.adjoint is None and static.bwd is None):
            return "no `fused` implementation"
        if static.adjoint is not None or self.bwds[k] is None:
            return None
        return f"no `fused` implementation, and {self.bwds[k]}"

    def _source(self, label) -> str:
        if label[0] == "y":
            return f"the output of site #{label[1]} `{self.specs[label[1]].name}`"
        return f"the output of the expensive call inside {_jaxpr.kind_of(self.program.jaxpr.eqns[label[1]])}"

    # ------------------------------------------------------------------ the backward pass, traced once

    def _ys_structs(self):
        return [structs(spec.y_avals()) for spec in self.specs]

    def _in_structs(self):
        # (a `jax.Ref` from outside by its abstract value: a struct would make it an array)
        return [
            v.aval if _jaxpr.is_ref(v) else struct_of(v.aval, keep_weak_type=True) for v in self.program.jaxpr.invars
        ]

    def _backward(self, candidates, ready):
        program, sites = self.program, self.sites
        value_aval = program.jaxpr.outvars[0].aval

        # JAX 0.10 cannot transpose a program that passes a value it does not differentiate
        # through a `jax.Ref` made inside it: with state, the leaves are differentiated too,
        # as Equinox differentiates them (what fails there fails under Equinox as well).
        n_consts, with_leaves = self.n_consts, _jaxpr.uses_refs(program)

        def g(ins, ys, seed):
            def f(ys_, leaves):
                operands: dict[int, list] = {}

                def handler(k):
                    def h(eqn, invals):
                        operands[k] = invals
                        return ys_[k]

                    return h

                value = _jaxpr.interpret(
                    program, [*ins[:n_consts], *leaves], {i: handler(k) for k, i in enumerate(sites)}
                )[0]
                return value, [operands[k] for k in ready]

            if with_leaves:
                _, vjp, operands = jax.vjp(f, ys, ins[n_consts:], has_aux=True)
            else:
                _, vjp, operands = jax.vjp(lambda ys_: f(ys_, ins[n_consts:]), ys, has_aux=True)
            cts = vjp(seed)[0]
            return [cts[k] for k in candidates], operands

        seed = jax.ShapeDtypeStruct((), value_aval.dtype)
        closed, shapes = _jaxpr.trace(g, self._in_structs(), self._ys_structs(), seed)
        out = []
        for group, kind, positions in zip(shapes, ("ct", "op"), (candidates, ready), strict=True):
            for k, leaves in zip(positions, group, strict=True):
                out += [(kind, k, j) for j in range(len(leaves))]
        labels = [None] * self.n_in + [("y", k) for k, spec in enumerate(self.specs) for _ in spec.y_structs] + ["seed"]
        inner = {i: ("n", i) for i, e in enumerate(closed.jaxpr.eqns) if _jaxpr.contains(e, (_site.SITE, _site.LINEAR))}
        deps = _jaxpr.dependencies(closed, labels, inner)
        ct_deps: dict[int, tuple[frozenset, list[int]]] = {}
        for index, ((kind, k, _), d) in enumerate(zip(out, deps, strict=True)):
            if kind == "ct":
                prev, outputs = ct_deps.get(k, (frozenset(), []))
                ct_deps[k] = (prev | (d - {"seed"}), [*outputs, index])
        return closed, tuple(out), ct_deps, (labels, inner)

    def _ahead_once(self, backward, backward_out, k) -> str | None:
        """Why site `k`'s input and cotangent cannot be computed ahead of the expensive
        calls: what stage 1 evaluates for them must happen once a call (it happens again
        in stage 3)."""
        targets = [v for v, (_, j, _) in zip(backward.jaxpr.outvars, backward_out, strict=True) if j == k]
        found = _jaxpr.once_only(backward, _jaxpr.needed_equations(backward.jaxpr, targets))
        return None if found is None else _once_reason("its input and cotangent", found)

    def _decide(self, k, ct_dep, backward, labels):
        sources, outputs = ct_dep
        if not sources:  # (the same work as standard's in one stage fewer: never slower)
            return Decision("deferred", estimates=_estimate(self.specs[k], 1))
        location = None
        uses = _jaxpr.nonlinear_uses(*self._tail(k))  # (to name the culprit as the user wrote it)
        for index in outputs:
            loc = _jaxpr.first_culprit(backward, labels[0], index, frozenset(sources), "seed", labels[1], uses)
            if loc is not None:
                location = str(loc)
                break
        if ("y", k) in sources:
            reason = "its cotangent depends on its own output"
        else:
            reason = "its cotangent depends on " + ", ".join(self._source(lab) for lab in sorted(sources, key=str))
        if location is not None:
            reason += f", through {location}"
        spec = self.specs[k]
        if spec.axes and spec.static.fused_batch is None:
            reason += "; the basis schedule is used for a site under `vmap` only with a `fused_batch`"
            return Decision("standard", reason, location)
        basis = self._basis(k)
        limit = spec.static.max_basis
        limit = limit if limit is not None else self.max_basis
        estimates = _estimate(spec, basis.k)
        assert estimates.deferred is not None  # (`_cost.estimate` always estimates the deferred schedule)
        if basis.k <= limit if limit is not None else estimates.deferred < estimates.standard:
            ahead = _jaxpr.once_only(basis.program, [True] * len(basis.program.jaxpr.eqns))
            if ahead is not None:
                reason += "; " + _once_reason("its basis cotangents", ahead)
                return Decision("standard", reason, location, k=basis.k, estimates=estimates)
            return Decision("deferred-basis", None, location, k=basis.k, basis=basis, estimates=estimates)
        if limit is not None:
            reason += f"; it is a combination of k={basis.k} fixed cotangents, more than max_basis={limit}"
        else:
            reason += f"; deferring its k={basis.k} fixed cotangents is estimated slower: {estimates}"
        return Decision("standard", reason, location, k=basis.k, estimates=estimates)

    def _tail(self, k):
        """The value as a function of site `k`'s output: `(program, source, stand_ins)` for
        the linearity analysis, with every expensive output an input (a stand-in)."""
        if self._substituted is None:
            self._substituted = _jaxpr.substitute(self.program, [*self.sites, *self.nested])
        closed = self._substituted
        n_ys = [len(spec.y_structs) for spec in self.specs]
        source = [False] * self.n_in + [j == k for j, m in enumerate(n_ys) for _ in range(m)]
        stand_ins = [False] * self.n_in + [True] * sum(n_ys)
        stand_ins += [True] * (len(closed.jaxpr.invars) - len(stand_ins))
        source += [False] * (len(closed.jaxpr.invars) - len(source))
        outputs = [True] + [False] * (len(closed.jaxpr.outvars) - 1)  # the value, not the aux
        return _jaxpr.prune(closed, outputs), source, stand_ins

    def _basis(self, k) -> Basis:
        """The linear frontier of the value in site `k`'s output, in the program itself with
        every expensive output (top-level sites and the equations holding nested ones)
        made an input, so that its variables are those that stage 3 evaluates."""
        frontier = _jaxpr.linear_frontier(*self._tail(k))
        program = _jaxpr.computing(self._substituted, frontier)
        return Basis(k=_jaxpr.frontier_size(frontier), variables=tuple(frontier), program=program)

    # ------------------------------------------------------------------ the plan

    def _plan(self, decisions, deferred, basis, early) -> Plan:
        sites = []
        for index, (k, spec, kind) in enumerate(self._entries()):
            decision = _nested_decision(spec, kind) if k is None else decisions[k]
            shapes = {"in_shapes": _describe(spec.x_structs), "out_shapes": _describe(spec.y_structs)}
            row = {"schedule": decision.schedule, "reason": decision.reason, "location": decision.location}
            sites.append(
                Site(
                    index=index,
                    name=spec.name,
                    **shapes,
                    **row,
                    k=decision.k,
                    n=decision.n,
                    batch=spec.sizes,
                    estimates=decision.estimates,
                )
            )
        if self.schedule == "deferred":
            refused = [s for s in sites if s.schedule == "standard"]
            if refused:
                lines = "\n".join(f"  site #{s.index} `{s.name}`: {s.reason}" for s in refused)
                raise ValueError(_messages.CANNOT_DEFER.format(where=self.where, lines=lines))
        return Plan(
            sites=tuple(sites),
            stages=self._stages(sites, deferred, basis, early),
            requested=self.schedule,
            fallback=self.fallback,
        )

    def _stages(self, sites, deferred, basis, early):
        """The expensive work in order: the deferred sites' `fused` calls together with the
        `fwd` of every standard site that needs no expensive output; then the other standard
        sites' `fwd` in program order; then every standard site' `bwd`, in reverse."""
        position = {}  # plan index -> position among the top-level sites
        for index, (k, _, _) in enumerate(self._entries()):
            if k is not None:
                position[index] = k

        def label(s, impl):
            batch = f" x{'x'.join(map(str, s.batch))}" if s.batch else ""
            return f"{s.name}: {impl}{batch}"

        stages: list[tuple[str, ...]] = []

        def fused_label(s):
            static = self.specs[position[s.index]].static
            if static.fused is None and static.fused_batch is None:
                return label(s, "fwd + " + ("adjoint" if static.adjoint is not None else "bwd"))
            return label(s, "fused")

        if deferred:
            first = [
                fused_label(s)
                + (f" (k={basis[position[s.index]].k} cotangents)" if position.get(s.index) in basis else "")
                for s in sites
                if position.get(s.index) in deferred
            ]
            first += [label(s, "fwd") for s in sites if position.get(s.index) in early]
            stages.append(tuple(first))
        standard = [s for s in sites if position.get(s.index) not in deferred and s.schedule == "standard"]
        for s in sites:
            if s.schedule == "forward-basis":
                stages.append((label(s, "jvp") + f" ({s.n} tangents)",))
            elif s in standard and position.get(s.index) not in early:
                stages.append((label(s, "fwd"),))
        stages.extend((label(s, "bwd"),) for s in reversed(standard))
        return tuple(stages)


def _fallback(program) -> str | None:
    """Why the program cannot be evaluated again outside the trace of the function (the
    stages do): then the whole call runs as Equinox's would."""
    stranded = _jaxpr.stranded_rule(program)
    if stranded is None:
        return None
    kind, location = stranded
    return f"a {kind} rule {location.where()} closes over a value computed in the function, so it cannot run \
outside the trace that made it"


def _once_reason(what: str, found) -> str:
    kind, location = found
    does = f"runs `{location.primitive}`" if kind == "effect" else "writes to a `jax.Ref` from outside the function"
    return f"computing {what} ahead of the expensive calls {does} {location.where()}, which must happen once a \
call, with the value"


def _nested_decision(spec: _site.Spec, kind: str) -> Decision:
    """The decision for a site called inside `kind` (a `lax.scan`, ...): standard, or forward-basis."""
    return _with_forward_basis(Decision("standard", f"called inside {kind}; sites there stay standard"), spec)


def _with_forward_basis(decision: Decision, spec: _site.Spec) -> Decision:
    """A site's standard `decision`, on the forward-basis strategy where `strategy` chooses
    it. Where the estimates choose (`by_estimate`), the forward-basis estimate is put beside
    the others and the reason says which was estimated faster."""
    n = spec.n_tangents
    estimates = spec.static.forward_basis_estimates(spec.x_shapes, n)
    decided = spec.static.by_estimate(estimates)
    if decided and decision.estimates is not None:  # (the standard estimate is the same)
        assert estimates is not None  # (`by_estimate` decides only with estimates)
        estimates = _cost.Estimates(
            estimates.standard, decision.estimates.deferred, estimates.source, estimates.forward_basis, estimates.note
        )
    shown = estimates if decided else decision.estimates
    if spec.static.strategy(n, estimates) == "forward-basis":
        assert decision.reason is not None  # (a standard decision says why)
        reason = decision.reason + _forward_basis_why(spec, decided)
        return Decision("forward-basis", reason, decision.location, n=n, estimates=shown)
    if not decided:
        return decision
    assert decision.reason is not None
    reason = decision.reason + f"; the forward-basis strategy with its n={n} tangents is estimated slower: {estimates}"
    return Decision("standard", reason, decision.location, k=decision.k, estimates=shown)


def _forward_basis_why(spec, decided: bool) -> str:
    """Why a site not deferred is differentiated on the forward-basis strategy (`decided`:
    by the estimates)."""
    static, n = spec.static, spec.n_tangents
    if static.prefer == "forward-basis":
        return ""
    if not static.has_vjp:
        return f"; reverse mode from its forward-mode implementation: the output and n={n} tangents in one call"
    if decided:
        return f"; forward-basis: the output and n={n} tangents in one call, estimated faster than `fwd` then `bwd`"
    return f"; forward-basis: the output and n={n} tangents in one call, one stage where `fwd` then `bwd` take two"


def _estimate(spec: _site.Spec, k: int) -> _cost.Estimates:
    """The estimates for site `spec` on `k` cotangents: one job when its forward and
    adjoints share one call (`fused_batch`, or a traced `fused` batched over them).

    Under `vmap`, each example's job gets all `k`, of which those of the other examples
    are zero there when the frontier is batched like the output (a loss of each example's
    overlaps): a site that solves only rows that are not multiples of others (`linear`
    in its `cost`, as `dx.sparse_solve`) is estimated on its example's share, like one
    site of the loop over the examples."""
    static = spec.static
    if spec.axes and static.cost is not None and static.cost.linear:
        k = math.ceil(k / math.prod(spec.sizes))
    fused = static.fused
    one_job = not isinstance(fused, AbstractImplementation) or fused.batch_in_one_job
    workers = fused.jobs_at_once if isinstance(fused, AbstractImplementation) and not one_job else 1
    complex_out = any(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in spec.y_structs)
    shapes = tuple(s.shape for s in spec.x_structs)
    fused_only = static.fwd is None and static.bwd is None and static.adjoint is None
    fused_jobs = fused_only or (isinstance(fused, AbstractImplementation) and fused.batch_jobs_are_fused)
    return _cost.estimate(
        static.timings_key, shapes, static.cost, k, complex_out, one_job, fused_only, workers, fused_jobs=fused_jobs
    )
