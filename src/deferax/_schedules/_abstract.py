"""The interface every schedule implements (how a site's derivative is obtained: what the
plan shows of it), and the interface of a job (what stage 2 runs for a site, and where); for
the jobs ahead of the value, what each stage does for their site; and the custom-VJP
identity that stage 3 puts in place of a site run in stage 2 (`returning`)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax

from .. import _jaxpr, _runtime
from .._concurrency._placement import halves_run
from .._implementation._abstract import AbstractImplementation
from .._jaxpr import shape_text
from .._plan._cost import Estimates
from .._plan._plan import Schedule, Site
from .._site import Spec


def _describe(structs_) -> str:
    parts = [shape_text(s) for s in structs_]
    text = ", ".join(parts)
    return text if len(parts) == 1 else f"({text})"


def stage_label(spec: Spec, impl: str) -> str:
    """How a row of the plan's stages names one call: `"name: impl x4"` (under `vmap`)."""
    batch = f" x{'x'.join(map(str, spec.sizes))}" if spec.sizes else ""
    return f"{spec.name}: {impl}{batch}"


def leaves_program(impl: Any, derived: bool) -> bool:
    """Whether a traced call of `impl` (of a `fused` made from `fwd` and `adjoint` where
    `derived`) leaves the compiled program: host functions always; two JAX-native halves
    (`dx.fuse`, a derived `fused`) where they run from a host callback (`halves_run`), not
    in the program."""
    if isinstance(impl, AbstractImplementation) and impl.runs_on_host:
        return True
    return (derived or isinstance(impl, AbstractImplementation)) and halves_run(eager=False).leave_program


def halves_text(impl: Any, derived: bool) -> str | None:
    """Where the two halves of a call of `impl` (of a `fused` made from `fwd` and `adjoint`
    where `derived`) run, and why (`deferax.Site.halves`); None for a call that is not two
    JAX-native halves (a host function's, a user's `fused`)."""
    if isinstance(impl, AbstractImplementation) and impl.runs_on_host:
        return None
    if not (derived or isinstance(impl, AbstractImplementation)):
        return None
    halves = halves_run(eager=_jaxpr.is_eager() and not _runtime.EXPLAINING_JITTED.get())
    return f"{halves.where}: {halves.why}"


class AbstractSchedule(eqx.Module):
    """The schedule of one call site, how its derivative is obtained (one of the four labels of
    the plan: `Standard`, `Deferred`, `DeferredBasis`, `ForwardBasis`), and why it was chosen.
    When and where its calls run is its jobs' part (`ahead_job`).

    **Fields:**

    - `spec`: the site, as its equation knows it.
    - `position`: its place among the top-level sites of the program (None for a site
      called inside `lax.scan`, `lax.cond`, ...).
    - `reason`, `location`, `k`, `n`, `estimates`: as [`deferax.Site`][]'s.
    - `label`: its name in the plan (`deferax.Site.schedule`).
    - `defers`: whether stage 2 computes its cotangent (no `bwd` after the value).
    """

    spec: eqx.AbstractVar[Spec]
    position: eqx.AbstractVar[int | None]
    reason: eqx.AbstractVar[str | None]
    location: eqx.AbstractVar[str | None]
    k: eqx.AbstractVar[int | None]
    n: eqx.AbstractVar[int | None]
    estimates: eqx.AbstractVar[Estimates | None]
    label: eqx.AbstractClassVar[Schedule]
    defers: eqx.AbstractClassVar[bool]

    @property
    @abc.abstractmethod
    def from_backward(self) -> tuple[str, ...]:
        """What stage 1 takes for it from the backward program (`"ct"`: its cotangent, `"op"`:
        its operands): nothing but for a site with a job ahead of the value."""

    def row(self, index: int) -> Site:
        """The site's row of the plan, as call number `index` in program order."""
        spec = self.spec
        job = self.ahead_job()
        return Site(
            index=index,
            name=spec.name,
            in_shapes=_describe(spec.x_structs),
            out_shapes=_describe(spec.y_structs),
            schedule=self.label,
            reason=self.reason,
            location=self.location,
            k=self.k,
            n=self.n,
            batch=spec.sizes,
            estimates=self.estimates,
            halves=None if job is None else job.halves,
        )

    @abc.abstractmethod
    def stage_rows(self) -> tuple[str | None, str | None, str | None]:
        """What the plan's stages show of the site: its call in stage 2 (ahead of the
        value), on the forward pass, and on the backward pass (None where it has none)."""

    @property
    @abc.abstractmethod
    def stage3_runs(self) -> bool:
        """Whether stage 3 (the program's own passes) runs an expensive implementation of the
        site: its `fwd`, its `bwd`, or its forward-basis call."""

    def strategy_chosen(self) -> AbstractSchedule:
        """The schedule on the strategy chosen for it: a standard site's may be the
        forward-basis strategy (`_standard.choose`); the others' are as they are."""
        return self

    def with_jobs_ahead(self) -> AbstractSchedule | None:
        """The schedule with its jobs run ahead of the value, in stage 2, where it can have
        jobs there (a standard site's, `runs="ahead"`); None for the others."""
        return None

    def ahead_job(self) -> AbstractAhead | None:
        """Its job in stage 2, ahead of the value (None where it has none)."""
        return None


class AbstractJob(eqx.Module):
    """A call that stage 2 (or stage 2b) runs for one top-level site, at once with the
    others: a schedule's call ahead of the value (`AbstractAhead`), or a together site's
    backward job (`_jobs.py`). A job says what it runs and where; its schedule
    says how the site's derivative is obtained."""

    spec: eqx.AbstractVar[Spec]  # (the site, as its equation knows it)
    position: eqx.AbstractVar[int]  # (its place among the top-level sites of the program)
    label: eqx.AbstractVar[str]  # (its schedule's name in the plan, for the timeline)

    @property
    @abc.abstractmethod
    def impl(self) -> Callable[..., Any] | None:
        """The implementation its call runs (None for a `fused` made there)."""

    @property
    def leaves_program(self) -> bool:
        """Whether its call runs outside the XLA program anyway: on the host (`dx.host`), or
        as two compiled halves on threads (`dx.fuse`, or a `fused` made from `fwd` and
        `adjoint`/`bwd`). Such work leaves through a callback, which JAX cannot
        differentiate. By default, whether `impl` is an implementation deferax made that
        does (`leaves_program`)."""
        return leaves_program(self.impl, derived=False)

    @property
    def halves(self) -> str | None:
        """Where the two halves of its call run and why, for two JAX-native halves
        (`halves_text`); None otherwise."""
        return halves_text(self.impl, derived=False)

    @abc.abstractmethod
    def call(self, operands: list, cts: Any) -> tuple:
        """Its call: `(y, ct_x)`, output leaves and, for a deferred site, the cotangents of
        the differentiable leaves of its input (None otherwise); a backward job's is
        `(ct_x, None)`."""


class AbstractAhead(AbstractJob):
    """A job in stage 2, ahead of the value, for a site at the top level of the program:
    concurrently with the other such jobs, from what stage 1 computed for it. A deferred
    schedule is its own job; a standard site run ahead has its forward job (`_jobs.py`).

    - `defers`: whether it computes the site's cotangent (no `bwd` after the value).
    - `together`: whether the site's backward job runs in stage 2b, at once with the other
      together sites' (`_together.JointBackward`).
    """

    defers: eqx.AbstractClassVar[bool]
    together: eqx.AbstractVar[bool]

    @abc.abstractmethod
    def stage2_row(self) -> str:
        """What the plan's stages show of its call in stage 2."""

    @abc.abstractmethod
    def stage1_cotangents(self, ins: list, ys: list, traced: list | None) -> Any:
        """The cotangents stage 2 gives the site: `traced`, what stage 1 read off the
        backward program for it (None when it takes none), with `ins` the program's inputs
        and `ys` zeros for every site's output."""

    @abc.abstractmethod
    def stage3(self, y: list, ct_x: Any) -> tuple[Callable[..., Any], dict]:
        """`(handler, wraps)`: what stage 3 runs in place of the site's equation (as
        `handler(eqn, operands)`), given stage 2's results, and the wrappers of variables
        of the program it needs (a basis site's frontier variables)."""


class AbstractDeferring(AbstractSchedule, AbstractAhead):
    """A schedule on which stage 2 computes the site's cotangent (`Deferred`,
    `DeferredBasis`): its own job ahead of the value (its `fused` call), with nothing of the
    site left for stage 3."""

    defers: ClassVar[bool] = True  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    together: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]

    @property
    def stage3_runs(self) -> bool:
        return False

    def ahead_job(self) -> AbstractAhead:
        return self

    def stage2_row(self) -> str:
        return self.stage_rows()[0]  # pyright: ignore[reportReturnType]  (its call is in stage 2)


def returning(index: int, backward):
    """A function that returns its argument `index`, whose backward pass is
    `backward(args, ct)`: the cotangents of all its arguments, from all of them (kept as
    residuals) and the cotangent of the result."""

    @jax.custom_vjp
    def call(*args):
        return args[index]

    def fwd(*args):
        return args[index], args

    call.defvjp(fwd, backward)
    return call
