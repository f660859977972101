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
import functools
from typing import Any

import jax

from .. import _jaxpr, _site
from .._jaxpr import struct_of, structs
from .._plan._plan import Plan
from .._schedules import _per_example, _standard
from .._schedules._abstract import AbstractAhead, AbstractSchedule
from .._schedules._deferred import Deferred, peers
from .._schedules._deferred_basis import Basis, DeferredBasis
from .._schedules._standard import Standard, standard
from .._schedules._together import JointBackward
from . import _together


@dataclasses.dataclass
class Analysis:
    """The outcome of the static check, with what the stages need."""

    plan: Plan
    program: Any  # J: ClosedJaxpr of (consts, leaves) -> (value, aux arrays), sites inlined
    sites: tuple[int, ...]  # equation indices of the top-level sites, in program order
    nested: tuple[int, ...]  # equation indices of equations holding expensive calls inside
    schedules: tuple[AbstractSchedule, ...]  # one a top-level site, in program order
    ahead: tuple[AbstractAhead, ...]  # the jobs of stage 2: the deferred sites first, then the standard sites run ahead
    backward: Any  # G, pruned to what stage 1 needs: (consts, leaves, ys, seed) -> (cts, operands)
    backward_out: tuple  # for each output of `backward`: ("ct", position, leaf) or ("op", position, leaf)
    # the reverse-mode strategy planned for each site not deferred ("standard" or "forward-basis"), by `Spec`:
    # stage 3 differentiates them so (`_site.planned`), whatever timings came in since
    strategies: dict = dataclasses.field(default_factory=dict)
    # the standard sites whose backward jobs run at once in stage 2b, as one group (None: none)
    together: JointBackward | None = None

    @property
    def deferring(self) -> tuple[AbstractAhead, ...]:
        """The sites whose cotangent stage 2 computes (deferred and deferred-basis)."""
        return tuple(s for s in self.ahead if s.defers)

    @property
    def live(self) -> bool:
        """Whether stage 3 still runs expensive implementations (standard sites, but for those
        run in stage 2 whose `bwd` runs there too, or that nothing differentiates)."""
        return bool(self.nested) or any(s.stage3_runs for s in self.schedules)


def analyse(
    program, n_consts: int, *, schedule: str, max_basis: int | None, where: str, bwds: tuple | None = None
) -> Analysis:
    """Run the static check on `program` (`J`, with its constants as leading inputs).
    `bwds`: what `_site.bwd_decisions(program)` returned, if it was called already.

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
    bwds = _site.bwd_decisions(program) if bwds is None else bwds
    choice = _Choice(program, n_consts, sites, nested, specs, schedule, max_basis, where, bwds)
    return choice.run()


class _Choice:
    """The choice of each site's schedule over one traced program: the static check (what
    may be deferred, and why not), then the estimates among what may be (`run`)."""

    def __init__(self, program, n_consts, sites, nested, specs, schedule, max_basis, where, bwds):
        self.program, self.n_consts, self.sites, self.nested, self.specs = program, n_consts, sites, nested, specs
        self.schedule, self.max_basis, self.where, self.bwds = schedule, max_basis, where, bwds
        self.n_in = len(program.jaxpr.invars)
        self.eqn_labels = {i: ("y", k) for k, i in enumerate(sites)} | {i: ("n", i) for i in nested}
        self._substituted = None
        self._candidates: list[int] = []  # (the sites that may run ahead of the value)
        self.why_not_deferred: dict[int, str] = {}  # (each basis site's reason to stay standard, by position)
        self.program, self.fallback = self._rules()
        self.still = self._undifferentiated()  # (positions of the sites that nothing differentiates)

    def _rules(self) -> tuple[Any, str | None]:
        """The program the stages run, its custom rules checked to run outside the trace of
        the function (`_jaxpr.check_rules`; a `custom_vjp`'s backward rule is replayed there
        from its first run), and why it cannot be evaluated again outside that trace, where it
        cannot: then the whole call runs as Equinox's would. The stages differentiate the
        arguments (the inputs after the constants) and the sites' outputs; under
        schedule='standard' (an enclosing differentiation) the constants too."""
        labels = [None if i < self.n_consts and self.schedule != "standard" else "x" for i in range(self.n_in)]
        rules = _jaxpr.check_rules(self.program, labels, self.eqn_labels)
        if rules.stranded is None:
            return rules.program, None
        kind, location = rules.stranded
        return rules.program, (
            f"a {kind} rule {location.where()} closes over a value computed in the function, so it cannot run "
            "outside the trace that made it"
        )

    # ------------------------------------------------------------------ the order of the plan

    @functools.cached_property
    def _entries(self) -> list:
        """Every expensive call in program order: (position or None, spec, nested kind or None)."""
        entries = []
        for i, eqn in enumerate(self.program.jaxpr.eqns):
            if i in self.sites:
                entries.append((self.sites.index(i), self.specs[self.sites.index(i)], None))
            elif i in self.nested:
                for inner in _jaxpr.nested_in(eqn, _site.SITE):
                    entries.append((None, _site.spec_of(inner), _jaxpr.kind_of(eqn)))
        return entries

    def facts(self) -> _together.Facts:
        """What the choice of backward jobs at once reads of the program."""
        nested = tuple(_jaxpr.kind_of(self.program.jaxpr.eqns[i]) for i in self.nested)
        return _together.Facts(
            tuple(self.specs), self.schedule, self.fallback, nested, self.max_basis, self.why_not_deferred
        )

    def run(self) -> Analysis:
        n = len(self.sites)
        marks = _jaxpr.input_marks(self.program, [None] * self.n_in, self.eqn_labels)
        upstream, feeds = {}, {}
        for p, i in enumerate(self.sites):
            upstream[p] = frozenset().union(*marks[i])
            for lab in upstream[p]:
                feeds.setdefault(lab, []).append(f"#{p} `{self.specs[p].name}`")
        for i in self.nested:
            for lab in frozenset().union(*marks[i]):
                feeds.setdefault(lab, []).append(
                    f"the expensive call inside {_jaxpr.kind_of(self.program.jaxpr.eqns[i])}"
                )
        schedules: dict[int, AbstractSchedule] = {}
        once: dict[int, str | None] = {}
        candidates = []
        for p in range(n):
            reason = self._structural(p, upstream, feeds)
            if reason is None:
                candidates.append(p)
            else:
                still = p in self.still
                schedules[p] = Standard(spec=self.specs[p], position=p, reason=reason, differentiated=not still)
        backward, backward_out = None, ()
        ready = [p for p in range(n) if not upstream[p]]  # operands computable in stage 1
        # (standard sites whose backward jobs may run at once: their cotangents are traced too)
        facts = self.facts()  # (its `why_not_deferred` is filled as the candidates are decided)
        several = n + len(self.nested) >= 2  # (a site alone runs neither together nor in turn with others)
        jointly = several and _together.may_run_together(facts, ready)
        if candidates or jointly:
            backward, backward_out, ct_deps, labels = self._backward(list(range(n)) if jointly else candidates, ready)
            self._candidates = candidates
            # (a site that is not a candidate takes only its operands from stage 1)
            once = {p: self._ahead_once(backward, backward_out, p, p in candidates) for p in {*ready, *candidates}}
            for p in candidates:
                reason = once[p]
                schedules[p] = (
                    Standard(spec=self.specs[p], position=p, reason=reason)
                    if reason
                    else self._decide(p, ct_deps[p], backward, labels)
                )
        if jointly:
            schedules = _together.against_basis(
                facts, schedules, candidates, lambda s: standard(_standard.choose(s)) is not None
            )
        schedules = {p: s.strategy_chosen() for p, s in schedules.items()}
        if any(s.defers for s in schedules.values()):
            # (a standard host site whose operands are known in stage 1 runs its `fwd` there too)
            schedules = {
                p: ahead
                if (ahead := s.with_jobs_ahead()) is not None
                and not s.spec.static.autodiff
                and not upstream[p]
                and not once.get(p)
                else s
                for p, s in schedules.items()
            }
        if jointly:
            alone = {p: self._ahead_once(backward, backward_out, p) for p in range(n)}
            schedules = _together.choose(facts, schedules, alone)
        elif several:
            schedules = _together.in_turn(facts, schedules, upstream)
        ordered = tuple(schedules[p] for p in range(n))
        jobs = [job for s in ordered if (job := s.ahead_job()) is not None]
        ahead = tuple(j for j in jobs if j.defers) + tuple(j for j in jobs if not j.defers)
        together = None
        if backward is not None:
            members = tuple(j for j in ahead if j.together)
            if members:
                jointly_at = {s.position for s in members}
                wanted = [kind == "ct" and p in jointly_at for kind, p, _ in backward_out]
                together = JointBackward(
                    members=members,
                    program=_jaxpr.prune(backward, wanted),
                    outs=tuple(o for o, u in zip(backward_out, wanted, strict=True) if u),
                    order=tuple(range(n)),
                    seed=self.program.jaxpr.outvars[0].aval.dtype,
                )
            keep = [kind in ordered[p].from_backward for kind, p, _ in backward_out]
            backward = _jaxpr.prune(backward, keep)
            backward_out = tuple(o for o, u in zip(backward_out, keep, strict=True) if u)
        plan = self._plan(ordered, ahead)
        strategies = {
            spec: s.schedule
            for (_, spec, _), s in zip(self._entries, plan.sites, strict=True)
            if s.schedule in ("standard", "forward-basis")
        }
        return Analysis(
            plan,
            self.program,
            self.sites,
            self.nested,
            ordered,
            ahead,
            backward,
            backward_out,
            strategies,
            together,
        )

    def _structural(self, k, upstream, feeds) -> str | None:
        spec = self.specs[k]
        if self.fallback is not None:
            return self.fallback
        if self.schedule == "standard":
            return "schedule='standard' was requested"
        if k in self.still:
            return "its input depends on no differentiated argument: no backward pass runs for it"
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

    def _undifferentiated(self) -> frozenset[int]:
        """The positions of the sites whose differentiable inputs depend on no differentiated
        argument (the program's inputs after its constants): nothing differentiates them, so
        no backward pass runs for them. None under schedule='standard' (an enclosing
        differentiation asked for it, and may differentiate the constants too)."""
        if self.schedule == "standard" or self.fallback is not None:
            return frozenset()
        labels = [None] * self.n_consts + ["x"] * (self.n_in - self.n_consts)
        marks = _jaxpr.input_marks(self.program, labels)
        still = []
        for p, (i, spec) in enumerate(zip(self.sites, self.specs, strict=True)):
            x_marks = marks[i][spec.n_fn :]  # (the implementations' arrays are constants to the derivative)
            if not any("x" in m for m, d in zip(x_marks, spec.diff, strict=True) if d):
                still.append(p)
        return frozenset(still)

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

    def _ahead_once(self, backward, backward_out, k, cotangent: bool = True) -> str | None:
        """Why site `k`'s input and cotangent (with `cotangent`; else its input) cannot be
        computed ahead of the expensive calls: what stage 1 evaluates for them must happen
        once a call (it happens again in stage 3)."""
        targets = [
            v
            for v, (kind, j, _) in zip(backward.jaxpr.outvars, backward_out, strict=True)
            if j == k and (cotangent or kind == "op")
        ]
        found = _jaxpr.once_only(backward, _jaxpr.needed_equations(backward.jaxpr, targets))
        return None if found is None else _once_reason("its input and cotangent", found)

    def _decide(self, p, ct_dep, backward, labels) -> AbstractSchedule:
        """The schedule of candidate site `p` (at position `p`), from the sources of its
        cotangent (`ct_dep`)."""
        spec = self.specs[p]
        sources, outputs = ct_dep
        alike = peers(spec, [self.specs[q] for q in self._candidates])  # (sites whose jobs run together)
        if not sources:  # (the same work as standard's in one stage fewer: never slower)
            return Deferred(spec=spec, position=p, estimates=Deferred.estimate(spec, alike))
        location = None
        uses = _jaxpr.nonlinear_uses(*self._tail(p))  # (to name the culprit as the user wrote it)
        for index in outputs:
            loc = _jaxpr.first_culprit(backward, labels[0], index, frozenset(sources), "seed", labels[1], uses)
            if loc is not None:
                location = str(loc)
                break
        if ("y", p) in sources:
            reason = "its cotangent depends on its own output"
        else:
            reason = "its cotangent depends on " + ", ".join(self._source(lab) for lab in sorted(sources, key=str))
        if location is not None:
            reason += f", through {location}"
        self.why_not_deferred[p] = reason  # (for a basis site put back on the standard schedule)
        basis = self._basis(p)
        if spec.axes and spec.static.fused_batch is None and basis.example_axes is None:
            reason += "; the basis schedule is used for a site under `vmap` only with a `fused_batch`"
            return Standard(spec=spec, position=p, reason=reason, location=location)
        limit = spec.static.max_basis
        limit = limit if limit is not None else self.max_basis
        estimates = DeferredBasis.estimate(spec, basis.k, alike, per_example=basis.example_axes is not None)
        assert estimates.deferred is not None  # (`_deferred.estimate` always estimates the deferred schedule)
        if basis.k <= limit if limit is not None else estimates.deferred < estimates.standard:
            ahead = _jaxpr.once_only(basis.program, [True] * len(basis.program.jaxpr.eqns))
            if ahead is not None:
                reason += "; " + _once_reason("its basis cotangents", ahead)
                return Standard(spec=spec, position=p, reason=reason, location=location, k=basis.k, estimates=estimates)
            return DeferredBasis(spec=spec, position=p, location=location, k=basis.k, estimates=estimates, basis=basis)
        each = " per example" if basis.example_axes is not None else ""
        if limit is not None:
            reason += f"; it is a combination of k={basis.k} fixed cotangents{each}, more than max_basis={limit}"
        else:
            reason += f"; deferring its k={basis.k} fixed cotangents{each} is estimated slower: {estimates}"
        return Standard(spec=spec, position=p, reason=reason, location=location, k=basis.k, estimates=estimates)

    def _tail(self, p):
        """The value as a function of site `p`'s output: `(program, source, stand_ins)` for
        the linearity analysis, with every expensive output an input (a stand-in)."""
        if self._substituted is None:
            self._substituted = _jaxpr.substitute(self.program, [*self.sites, *self.nested])
        closed = self._substituted
        n_ys = [len(spec.y_structs) for spec in self.specs]
        source = [False] * self.n_in + [j == p for j, m in enumerate(n_ys) for _ in range(m)]
        stand_ins = [False] * self.n_in + [True] * sum(n_ys)
        stand_ins += [True] * (len(closed.jaxpr.invars) - len(stand_ins))
        source += [False] * (len(closed.jaxpr.invars) - len(source))
        outputs = [True] + [False] * (len(closed.jaxpr.outvars) - 1)  # the value, not the aux
        return _jaxpr.prune(closed, outputs), source, stand_ins

    def _basis(self, p) -> Basis:
        """The linear frontier of the value in site `p`'s output, in the program itself with
        every expensive output (top-level sites and the equations holding nested ones)
        made an input, so that its variables are those that stage 3 evaluates."""
        tail = self._tail(p)
        frontier = _jaxpr.linear_frontier(*tail)
        program = _jaxpr.computing(self._substituted, frontier)
        axes = _per_example.example_axes(self.specs[p], tail, frontier)
        k = _per_example.count(frontier, axes)
        return Basis(k=k, variables=tuple(frontier), program=program, example_axes=axes)

    # ------------------------------------------------------------------ the plan

    def _plan(self, schedules, ahead) -> Plan:
        entries = self._entries
        every = [_nested_schedule(spec, kind) if p is None else schedules[p] for p, spec, kind in entries]
        together = {job.position for job in ahead if job.together}
        at_once = [p is not None and p in together for p, _, _ in entries]
        rows = tuple(job.stage2_row() for job in ahead)
        return Plan.assemble(every, at_once, rows, requested=self.schedule, fallback=self.fallback, where=self.where)


def _once_reason(what: str, found) -> str:
    kind, location = found
    does = f"runs `{location.primitive}`" if kind == "effect" else "writes to a `jax.Ref` from outside the function"
    return f"computing {what} ahead of the expensive calls {does} {location.where()}, which must happen once a \
call, with the value"


def _nested_schedule(spec: _site.Spec, kind: str) -> AbstractSchedule:
    """The schedule of a site called inside `kind` (a `lax.scan`, ...): standard, or forward-basis."""
    return _standard.choose(
        Standard(spec=spec, position=None, reason=f"called inside {kind}; sites there stay standard")
    )
