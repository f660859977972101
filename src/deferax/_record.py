"""What ran, when: `record()` collects every implementation call into a `Timeline`; the
`"deferax"` logger reports plans (INFO) and calls with their durations (DEBUG); every
timed call is a named region in a `jax.profiler` trace.

Where a call is timed:

- called with concrete arrays (outside `jit`: the standard schedule's `fwd` and `bwd`,
  the deferred stage's `fused`), around the call, until its results are ready;
- the two halves of a `dx.fuse` (or of a `fused` made from `fwd` + `adjoint`), on their
  threads, also when they leave a compiled program through its callback;
- a host function's job, from its submission until its result is back (queueing
  included);
- a JAX-native implementation compiled into a program (under `jit`) cannot be timed from
  outside without changing the program: it is counted, through a callback that fires
  each time the program runs it, with no start or end. Only programs traced while a
  recording (or DEBUG logging) was on carry these callbacks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.tree_util as jtu

from . import _jaxpr, _runtime

log = logging.getLogger("deferax")
log.addHandler(logging.NullHandler())

_ACTIVE: list[Timeline] = _runtime.RECORDERS
_LOCK = threading.Lock()
# (site name, schedule) of the calls made here; set by the stages and by `ExpensiveFn`
_SITE = _runtime.SITE
# Where the job running here was submitted to (for its steps' rows)
_WHERE = _runtime.WHERE
# Inside the halves of a `Fused`, which are timed around their compiled calls.
_TIMED_OUTSIDE = _runtime.TIMED_OUTSIDE


@dataclasses.dataclass(frozen=True)
class Call:
    """One run of an implementation, as [`deferax.record`][] collects it in a
    [`deferax.Timeline`][] (`timeline.calls`).

    **Fields:**

    - `site`: the `ExpensiveFn`'s `name`;
    - `impl`: `"fwd"`, `"bwd"`, `"adjoint"`, `"combine"`, `"fused"`, `"fused_batch"`,
      `"jvp"` or `"jvp_batch"`;
    - `schedule`: the schedule it ran for (`"standard"`, `"deferred"`,
      `"deferred-basis"`, `"forward-basis"`, or `"forward"` for a `jvp` called by
      forward-mode differentiation on the standard strategy);
    - `start`, `end`: seconds since the recording began; `None` for a call inside a
      compiled program, which is counted but cannot be timed;
    - `thread`: the thread it ran on (for a host job: the executor);
    - `device`: the JAX device its results were on (`None` on the host or untimed);
    - `step`: True for a step inside an implementation's job rather than a call of an
      implementation: [`deferax.sparse_solve`][]'s factorisations (`impl="factor"`) and
      solve calls (`impl="solve"`, any number of right-hand sides in one call), recorded
      when its jobs run on threads of this process.
    """

    site: str
    impl: str
    schedule: str
    start: float | None
    end: float | None
    thread: str
    device: str | None = None
    step: bool = False

    @property
    def duration(self) -> float | None:
        """`end - start` in seconds; `None` for a call that was not timed."""
        return None if self.start is None or self.end is None else self.end - self.start


class Timeline:
    """The calls recorded by [`deferax.record`][], in the order they ended.

    `print(timeline)` shows a table; `timeline.counts()` the runs per implementation, and
    `timeline.counts(steps=True)` the steps inside them (a sparse solve's factorisations and
    solves); `timeline.plot()` a Gantt chart (needs matplotlib).
    """

    def __init__(self):
        self.origin = time.perf_counter()
        self.calls: list[Call] = []

    def _add(self, call: Call) -> None:
        self.calls.append(call)

    def counts(self, site: str | None = None, *, steps: bool = False) -> dict[str, int]:
        """How many times each implementation ran (of the site named `site`, or of all).
        With `steps=True`, how many times each step ran inside them instead: for
        [`deferax.sparse_solve`][], `"factor"` (factorisations) and `"solve"` (solve calls)."""
        return dict(
            collections.Counter(c.impl for c in self.calls if c.step == steps and (site is None or c.site == site))
        )

    def timed(self) -> list[Call]:
        """The calls that have a start and an end."""
        return [c for c in self.calls if c.start is not None]

    def __len__(self) -> int:
        return len(self.calls)

    def __str__(self) -> str:
        rows: list[tuple[str, ...]] = [("site", "impl", "schedule", "start", "end", "ms", "thread", "device")]
        for c in sorted(self.calls, key=lambda c: (c.start is None, c.start or 0.0)):
            if c.start is None or c.end is None:
                times = ("-", "-", "not timed")
            else:
                times = (f"{1e3 * c.start:.2f}", f"{1e3 * c.end:.2f}", f"{1e3 * (c.end - c.start):.2f}")
            impl = f"- {c.impl}" if c.step else c.impl  # (a step, inside the job before it)
            rows.append((c.site, impl, c.schedule, *times, c.thread, c.device or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"deferax timeline: {len(self.calls)} call(s), times in ms from the start of the recording"]
        for i, r in enumerate(rows):
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if any(c.start is None for c in self.calls):
            lines.append("not timed: calls inside a compiled program (counted each time the program runs them)")
        return "\n".join(lines)

    __repr__ = __str__

    def plot(self, title: str | None = None, ax: Any = None) -> Any:
        """A Gantt chart of the timed calls: one bar per call, one row per thread, coloured
        by implementation. Returns the matplotlib `Figure` (matplotlib is needed:
        `pip install deferax[plot]`)."""
        if ax is not None:
            _draw(ax, self, title)
            return ax.figure
        return plot_timelines({title or "": self})


def plot_timelines(timelines: Mapping[str, Timeline], width: float = 8.0) -> Any:
    """Several recordings (standard and deferred runs of one step, say), one above the
    other on a common time axis: for each, a Gantt chart as [`deferax.Timeline`][]'s
    `plot` draws it (one bar per timed call, one row per thread, coloured by
    implementation). Needs matplotlib (`pip install deferax[plot]`).

    **Arguments:**

    - `timelines`: the recordings, each under the title shown above its chart, in the
      order drawn (top to bottom).
    - `width`: the figure's width in inches; its height grows with the number of threads.

    **Returns:**

    The matplotlib `Figure`.

    !!! Example

        ```python
        with dx.record() as standard:
            step_standard(model, data)
        with dx.record() as deferred:
            step(model, data)
        fig = dx.plot_timelines({"standard": standard, "deferred": deferred})
        fig.savefig("timelines.png")
        ```
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - the plot extra is installed in the tests
        raise ImportError("`Timeline.plot` needs matplotlib: `pip install matplotlib` (or `deferax[plot]`).") from e
    rows = [max(1, len({c.thread for c in t.timed()})) for t in timelines.values()]
    fig, axes = plt.subplots(
        len(timelines),
        1,
        figsize=(width, 0.9 + 0.5 * sum(rows) + 0.6 * len(rows)),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": rows},
    )
    for ax, (title, timeline) in zip(axes[:, 0], timelines.items(), strict=True):
        _draw(ax, timeline, title)
    axes[-1, 0].set_xlabel("ms from the first call")
    fig.tight_layout()
    return fig


_COLOURS = {
    "fwd": "#4C72B0",
    "bwd": "#DD8452",
    "adjoint": "#DD8452",
    "combine": "#937860",
    "fused": "#55A868",
    "fused_batch": "#55A868",
    "jvp": "#8172B3",
    "jvp_batch": "#8172B3",
    "factor": "#222222",
    "solve": "#BBBBBB",
}


def _span(call: Call) -> tuple[float, float]:
    """`(start, end)` of a call from `Timeline.timed`."""
    assert call.start is not None and call.end is not None, "only timed calls have a span"
    return call.start, call.end


def _draw(ax, timeline: Timeline, title: str | None) -> None:
    calls = timeline.timed()
    jobs = [c for c in calls if not c.step]
    threads = sorted({c.thread for c in calls}, key=lambda t: min(_span(c)[0] for c in calls if c.thread == t))
    t0 = min((_span(c)[0] for c in calls), default=0.0)
    for c in calls:
        row = threads.index(c.thread)
        start, end = _span(c)
        ax.barh(
            row + (0.2 if c.step else 0.0),  # (a step: a thin bar along the bottom of its job's)
            1e3 * (end - start),
            left=1e3 * (start - t0),
            height=0.2 if c.step else 0.6,
            color=_COLOURS.get(c.impl, "#999999"),
            edgecolor="black",
            linewidth=0.5,
        )
        if c.step:
            continue
        ax.text(
            1e3 * (start - t0 + (end - start) / 2),
            row,
            f"{c.site}: {c.impl}",
            ha="center",
            va="center",
            fontsize=8,
            color="white",
        )
    ax.set_yticks(range(len(threads)), threads, fontsize=8)
    ax.invert_yaxis()
    untimed = sum(not c.step for c in timeline.calls) - len(jobs)
    label = title or ""
    if untimed:
        label += f"{' ' if label else ''}(+{untimed} call(s) inside compiled programs, not timed)"
    if calls:
        span = 1e3 * (max(_span(c)[1] for c in calls) - t0)
        label += f"{': ' if label else ''}{span:.1f} ms"
    ax.set_title(label, fontsize=9, loc="left")
    ax.set_ylabel("thread", fontsize=8)


@contextlib.contextmanager
def record() -> Iterator[Timeline]:
    """Record every expensive call made while inside, on any thread, into a [`deferax.Timeline`][].

    The recording is the process's, not the opening thread's: recordings open at the same
    time on two threads each see the calls of both.

    !!! Example

        ```python
        with dx.record() as timeline:
            value, grads = step(model, data)
        print(timeline)
        assert timeline.counts() == {"fused": 1}
        ```

    On leaving, it waits for the programs started inside to have run what they count
    (`jax.effects_barrier`): on an accelerator, a jitted step returns before it has run.

    Calls with concrete arrays (outside `jit`) are timed until their results are ready
    (which makes each wait for its result: recording changes JAX's asynchronous dispatch).
    Under `jit`, the halves of a `dx.fuse` and host functions are timed where they leave
    the compiled program; other implementations compiled into the program are counted,
    not timed, and only if the program was traced inside a recording.
    """
    timeline = Timeline()
    with _LOCK:
        _ACTIVE.append(timeline)
    try:
        yield timeline
    finally:
        # the counts of calls compiled into programs still running (an accelerator's dispatch
        # returns before its program has run them) are in before the recording ends
        jax.effects_barrier()
        with _LOCK:
            _ACTIVE.remove(timeline)


def wanted() -> bool:
    """Whether calls are to be timed now: a recording is on, or DEBUG logging."""
    return bool(_ACTIVE) or log.isEnabledFor(logging.DEBUG)


def _add(
    site: str,
    impl: str,
    schedule: str,
    start: float | None,
    end: float | None,
    thread: str,
    device: str | None,
    step: bool = False,
):
    with _LOCK:
        timelines = list(_ACTIVE)
    for timeline in timelines:
        timeline._add(
            Call(
                site,
                impl,
                schedule,
                None if start is None else start - timeline.origin,
                None if end is None else end - timeline.origin,
                thread,
                device,
                step,
            )
        )
    if log.isEnabledFor(logging.DEBUG):
        took = "inside a compiled program" if start is None or end is None else f"{1e3 * (end - start):.3f} ms"
        log.debug("%s: %s (%s schedule) %s on %s", site, impl, schedule, took, thread)


def site(name: str | None, schedule: str | None = None):
    """Inside: the calls are those of site `name`, for `schedule` (kept from outside if None)."""
    outer = _SITE.get()
    return _jaxpr.setting(
        _SITE, (name if name is not None else "unnamed", schedule or (outer[1] if outer else "standard"))
    )


def current(impl: str) -> tuple[str, str]:
    """`(site, schedule)` for a call of `impl` made here."""
    name, schedule = _SITE.get() or ("?", "standard")
    if impl in ("jvp", "jvp_batch") and schedule == "standard":
        schedule = "forward"
    return name, schedule


def carrying(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
    """`fn`, to run on another thread of this process as a job of the site and schedule
    current here, shown as running on `where` (so that the steps it records are that
    site's, on its job's row)."""
    here = _SITE.get()

    def run(*args: Any) -> Any:
        with _jaxpr.setting(_SITE, here), _jaxpr.setting(_WHERE, where):
            return fn(*args)

    return run


def step(impl: str, start: float, end: float) -> None:
    """A step inside a job that ran from `start` to `end` (`time.perf_counter()`): recorded
    if wanted, as a step of the site whose job this is."""
    if wanted():
        site_name, schedule = current(impl)
        _add(site_name, impl, schedule, start, end, _WHERE.get() or threading.current_thread().name, None, step=True)


def timed_outside():
    """Inside: calls are part of one already recorded; they are not recorded again."""
    return _jaxpr.setting(_TIMED_OUTSIDE, True)


def device_of(tree: Any) -> jax.Device | None:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
    """The device of the first array of `tree` (None for no array, or one on several)."""
    for leaf in jtu.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            devices = leaf.devices()
            return next(iter(devices)) if len(devices) == 1 else None
    return None


def recorded(impl: str, fn: Callable[[], Any], traced: bool, device: Any = None) -> Any:
    """`fn()`, the call of implementation `impl` (on traced arrays or concrete ones), as a
    named region for the profiler, and recorded if wanted. `device`: where it runs, if
    not where its results are."""
    site_name, schedule = current(impl)
    record_it = wanted() and not _TIMED_OUTSIDE.get()  # (not again inside a recorded call)
    if traced:
        with jax.named_scope(f"deferax_{site_name}_{impl}"):
            if record_it:
                # compiled into the program: counted each time the program runs it, not timed
                jax.debug.callback(
                    lambda: _add(site_name, impl, schedule, None, None, "in program", None), ordered=False
                )
            with timed_outside():
                return fn()
    with jax.profiler.TraceAnnotation(f"deferax {site_name}: {impl}"):
        if not record_it:
            return fn()
        start = time.perf_counter()
        with timed_outside():
            result = jax.block_until_ready(fn())
        end = time.perf_counter()
    device = device if device is not None else device_of(result)
    _add(
        site_name, impl, schedule, start, end, threading.current_thread().name, None if device is None else str(device)
    )
    return result


def job(impl: str, where: str) -> Callable[[float], None] | None:
    """For a host job about to be submitted: `record(end)`, which records it as run from now
    to `end` (`time.perf_counter()`), or None when nothing is to be recorded."""
    if not wanted():
        return None
    site_name, schedule = current(impl)
    start = time.perf_counter()
    return lambda end: _add(site_name, impl, schedule, start, end, where, None)


def log_plan(plan: Any) -> None:
    """The plan of a newly traced program, at INFO."""
    if log.isEnabledFor(logging.INFO):
        for s in plan.sites:
            log.info("site #%d %s: %s%s", s.index, s.name, s.schedule, f" ({s.reason})" if s.reason else "")
