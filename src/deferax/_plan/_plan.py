"""What `deferax.explain` returns: the schedule chosen for each call site, and why."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import equinox as eqx

from ._cost import Estimates

Schedule = Literal["standard", "deferred", "deferred-basis", "forward-basis"]


class Site(eqx.Module):
    """One call of an `ExpensiveFn` in the differentiated program.

    **Fields:**

    - `index`: the position of the call in program order (0 for the first call).
    - `name`: the `ExpensiveFn`'s name.
    - `in_shapes`, `out_shapes`: the input and output structures, as text (`float64[64,64]`).
    - `schedule`: `"deferred"` (one `fused(x, ct_y)` call, no `fwd` or `bwd`),
      `"deferred-basis"` (the cotangent is a combination of `k` fixed cotangents: the
      primal once and `k` adjoints in one batched `fused` call, combined once the output
      is known), `"forward-basis"` (the primal and `n` tangents in one `jvp_batch` call,
      `ct_x = J^T ct_y` after) or `"standard"` (`fwd` on the forward pass, `bwd` on the
      backward pass; for independent host sites, their `fwd` jobs at once and then their
      `bwd` jobs at once, as `reason` and `stages` say).
    - `reason`: for a site not deferred, why it could not be; `None` for a deferred one.
    - `location`: for a standard site whose cotangent depends on an output, the operation
      and the user's `file:line` that make it so; otherwise `None`.
    - `k`: for a site whose cotangent depends on outputs, the number of fixed basis
      cotangents it is a combination of (a complex number counts as two); `None` otherwise.
    - `n`: for a forward-basis site, the number of tangents (the input's real numbers).
    - `estimates`: for a site that could be deferred, the estimated wall time of the
      standard and the deferred (or deferred-basis) schedule, a [`deferax.Estimates`][];
      for a site with `jvp` or `jvp_batch` whose costs are known, the forward-basis
      strategy's beside them; `None` otherwise.
    - `halves`: for a deferred site whose `fused` is two JAX-native halves (made from `fwd`
      and `adjoint`, or by [`deferax.fuse`][]), where they run and why: `"threads: ..."`
      (eagerly, two threads), `"callback: ..."` (one CPU device under `jit`: one host
      callback starts both), `"program: ..."` (inside the compiled program: on an
      accelerator, with sharded inputs, inside `shard_map`) or `"devices: ..."` (a
      `shard_map` over the devices `dx.set_devices` named, one half a device); `None`
      otherwise. See "Accelerators and several devices" in the docs.
    - `batch`: the sizes of the `jax.vmap` levels the call is made under, outermost first
      (`()` for a call on one example). A deferred site under `vmap` runs one `fused` call
      for the whole batch; `in_shapes` and `out_shapes` are those of one example.
    """

    index: int
    name: str
    in_shapes: str
    out_shapes: str
    schedule: Schedule
    reason: str | None = None
    location: str | None = None
    k: int | None = None
    n: int | None = None
    batch: tuple[int, ...] = ()
    estimates: Estimates | None = None
    halves: str | None = None


class Recognised(eqx.Module):
    """A call of a recognised library function in the loss (`klujax.solve`, JAX's
    `spsolve`, or one registered with [`deferax.register_recognition`][]), and what became
    of it.

    **Fields:**

    - `call`: the function as the user wrote it, e.g. `"klujax.solve"`.
    - `where`: the user's line that makes the call (`"at loss.py:12 `...`"`).
    - `site`: the index in `sites` of the [`deferax.sparse_solve`][] site it became (named
      `"klujax.solve (recognised)"`); `None` when it was left as it is.
    - `reason`: why it was left as it is; `None` when it was rewritten.
    """

    call: str
    where: str
    site: int | None = None
    reason: str | None = None

    def __str__(self) -> str:
        if self.reason is None:
            return f"#{self.site} {self.call} (recognised) {self.where}"
        return f"{self.call} {self.where}: not recognised: {self.reason}"


_CANNOT_DEFER = """{where}: schedule='deferred' was requested, but these call sites cannot be deferred:
{lines}
Use schedule='auto' to defer what can be and keep the rest standard, or restructure the loss so that the
cotangent reaching each expensive output does not depend on an expensive output (see "How the deferred VJP works")."""


@runtime_checkable
class _Scheduled(Protocol):
    """What a plan reads of a site's schedule (`_schedules/`): its row, and what the stages
    show of it (its call in stage 2, on the forward pass, on the backward pass)."""

    def row(self, index: int) -> Site: ...

    def stage_rows(self) -> tuple[str | None, str | None, str | None]: ...


class Plan(eqx.Module):
    """The schedule of a `filter_value_and_grad` call, returned by [`deferax.explain`][].

    `str(plan)` is a readable table. As data:

    **Fields:**

    - `sites`: a [`deferax.Site`][] per call site, in program order.
    - `stages`: the expensive work in execution order; each stage is a tuple of
      `"name: implementation"` strings whose members are independent and run concurrently
      where the implementations allow it.
    - `requested`: the `schedule` argument the plan was made for.
    - `fallback`: why the whole call runs as `equinox.filter_value_and_grad` would (the
      program cannot be evaluated again outside the trace of the function, or the function
      needs a concrete value of a differentiated input and cannot be traced: then `sites`
      is empty); `None` when it does not.
    - `recognised`: a [`deferax.Recognised`][] per call of a recognised library function
      (`klujax.solve`, JAX's `spsolve`, ...), rewritten into a site or left as it is.
    """

    sites: tuple[Site, ...]
    stages: tuple[tuple[str, ...], ...]
    requested: str
    fallback: str | None = None
    recognised: tuple[Recognised, ...] = ()

    @classmethod
    def assemble(
        cls,
        schedules: Sequence[_Scheduled],
        at_once: Sequence[bool],
        ahead: Sequence[str],
        requested: str,
        fallback: str | None,
        where: str,
    ) -> Plan:
        """The plan of every expensive call's schedule, in program order (`at_once`: whether
        its backward job runs with the other together sites'), with `ahead` the rows of the
        jobs run in stage 2 in their order. The stages, in order: those jobs (the deferred
        sites' `fused` calls together with the `fwd` of every standard site that needs no
        expensive output); then the together sites' `bwd`, all at once; then the other
        sites' forward pass in program order; then every other standard site's `bwd`, in
        reverse. With `requested` "deferred", a site on the standard schedule is an error
        that names `where`."""
        sites = tuple(schedule.row(index) for index, schedule in enumerate(schedules))
        if requested == "deferred":
            refused = [s for s in sites if s.schedule == "standard"]
            if refused:
                lines = "\n".join(f"  site #{s.index} `{s.name}`: {s.reason}" for s in refused)
                raise ValueError(_CANNOT_DEFER.format(where=where, lines=lines))
        rows = [schedule.stage_rows() for schedule in schedules]
        stages: list[tuple[str, ...]] = [tuple(ahead)] if ahead else []
        jointly = tuple(backward for (_, _, backward), t in zip(rows, at_once, strict=True) if t and backward)
        if jointly:
            stages.append(jointly)
        stages.extend((forward,) for _, forward, _ in rows if forward is not None)
        stages.extend(
            (backward,)
            for t, (_, _, backward) in reversed(list(zip(at_once, rows, strict=True)))
            if backward is not None and not t
        )
        return cls(sites=sites, stages=tuple(stages), requested=requested, fallback=fallback)

    @property
    def deferred(self) -> tuple[Site, ...]:
        """The sites on a deferred schedule (`"deferred"` or `"deferred-basis"`)."""
        return tuple(s for s in self.sites if s.schedule in ("deferred", "deferred-basis"))

    def __str__(self) -> str:
        """The plan as text no wider than 100 columns: a table of short cells, and under it
        a numbered note for each site's reason."""
        notes = list(dict.fromkeys(s.reason for s in self.sites if s.reason))  # one note a reason
        note_of = {id(s): f"[{notes.index(s.reason) + 1}]" for s in self.sites if s.reason}
        header = ("#", "site", "input", "output", "vmap", "schedule", "note")
        rows = [
            (
                str(s.index),
                _short(s.name, 16),
                s.in_shapes,
                s.out_shapes,
                "x".join(map(str, s.batch)) or "-",
                s.schedule
                + (f" k={s.k}" if s.schedule == "deferred-basis" else f" n={s.n}" if s.n is not None else ""),
                note_of.get(id(s), ""),
            )
            for s in self.sites
        ]
        if not any(s.batch for s in self.sites):  # no column for what no site has
            header = header[:4] + header[5:]
            rows = [r[:4] + r[5:] for r in rows]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        # The two shape columns share what the others leave of the width; a longer
        # structure is cut (in full on the Site).
        shape = max(12, (_WIDTH - sum(widths) + widths[2] + widths[3] - 2 * (len(widths) - 1)) // 2)
        rows = [(r[0], r[1], _short(r[2], shape), _short(r[3], shape), *r[4:]) for r in rows]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        n = len(self.sites)
        out = [
            f"deferax plan (schedule={self.requested!r}): {n} site{'' if n == 1 else 's'}, {len(self.deferred)} \
deferred"
        ]
        if self.fallback is not None:
            out.extend(_wrap(f"the call runs as `equinox.filter_value_and_grad` would: {self.fallback}", ""))
        out.append(line(header))
        out.append(line(tuple("-" * w for w in widths)))
        out.extend(line(r) for r in rows)
        for i, note in enumerate(notes, 1):
            out.extend(_wrap(note, f"[{i}] "))
        if self.recognised:
            out.append("recognised calls:")
            for r in self.recognised:
                out.extend(_wrap(str(r), "  "))
        # (listed where they do not run as on one CPU, from two threads: in the program, on devices)
        placed = [s for s in self.sites if s.halves is not None and not s.halves.startswith(("threads", "callback"))]
        if placed:
            out.append("where the halves run:")
            for s in placed:
                out.extend(_wrap(s.halves, f"  #{s.index} "))  # pyright: ignore[reportArgumentType]  (not None: filtered)
        chosen = [s for s in self.sites if _estimates_listed(s)]
        if chosen:
            out.append("estimated wall time:")
            for s in chosen:
                out.extend(_wrap(str(s.estimates), f"  #{s.index} "))
        if self.stages:
            out.append("expensive stages, in order:")
            for i, stage in enumerate(self.stages, 1):
                together = " (concurrently)" if len(stage) > 1 else ""
                out.extend(_wrap(", ".join(stage) + together, f"  {i}. "))
        else:
            out.append("no expensive stages")
        return "\n".join(out)


_WIDTH = 100  # columns: a terminal's, and the docs' code column


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _wrap(text: str, first: str) -> list[str]:
    """`text` wrapped at `_WIDTH` columns after `first`, its later lines indented under it."""
    return textwrap.wrap(text, _WIDTH, initial_indent=first, subsequent_indent=" " * len(first), break_on_hyphens=False)


def _estimates_listed(site: Site) -> bool:
    """Whether `explain` lists `site`'s estimates under the table: a standard site's note
    gives them already, and a forward-basis site has them only when they chose it."""
    if site.estimates is None:
        return False
    by_estimate = site.schedule == "forward-basis" and site.estimates.forward_basis is not None
    return site.schedule == "deferred-basis" or by_estimate
