"""The schedule chosen by cost: an estimate of each sound schedule's wall time for a site.

Soundness is decided elsewhere (`_analysis`); this module only chooses among the schedules
already allowed. For a site whose cotangent is a combination of `k` fixed cotangents, the
choice is between the standard schedule (the forward on the forward pass, one adjoint on
the backward pass: two stages) and the deferred-basis schedule (the forward and `k`
adjoints before the value is known: one stage). The estimates count what each schedule
runs, in seconds (or in units of one forward when nothing is known), per site:

    standard        = (setup + fwd) + (setup, unless kept) + bwd + 2 * stage
                      (`fused` alone: two calls, 2 * (setup + fwd + bwd) + 2 * stage)
    deferred-basis  = one job:      J = setup + fwd + m * bwd
                      or m + 1 jobs on `workers`: J = [setup + fwd] + m * [setup + bwd]
                      (`fused` alone: m jobs of setup + fwd + bwd)
                      all `peers` sites' jobs at once on `workers`, this site's share:
                      max(longest job, peers * sum(J) / workers) / peers + stage

with `m = k`, or `ceil(k / 2)` for an adjoint linear over complex numbers on a complex
output (a complex overlap's basis cotangents `m` and `1j * m` are one solve). `peers`: the
sites of the program like this one (the same host functions and input shapes: the two
wavelengths of a frequency-domain design), whose stage-2 jobs run together, where the
standard schedule runs each site's host calls in turn (a 2-core timeline of the waveguide
bend: the two forward factorisations one after the other, eagerly and under `jit`). A
kept factorisation (`keeps_setup`) is paid once; a solve found to be a multiple of one
done (a self-adjoint loss: compliance) costs nothing, and is timed as 0 s. For a site
with `jvp` or `jvp_batch`, the forward-basis strategy's estimate is these with `n` tangents
in place of `k` cotangents (see `forward_basis`). For standard sites that need no
expensive output, whose forward jobs may run at once and whose backward jobs may too
(`together`), the estimate of all of them in turn against all of them at once.

The numbers come from the site's `cost=` hint, else from timings of its earlier calls
(`observe`), else from equal-cost defaults (`fwd = bwd = 1`, no setup, and a stage worth a
hundredth of a forward: a tie goes to the schedule with fewer stages). Timings are kept by
the site's identity (`ExpensiveFn.timings_key`: its host functions, or a
`dx.sparse_solve`'s solve) and input shapes, never by name: another site that happens to
share a name (`solve`, `<lambda>`) has its own. They are used once both `fwd` and `bwd`
are known (seconds are not mixed with the defaults' units). A decision must not
flip-flop between eager calls (timings on a loaded machine vary tenfold), so a site's
plan changes at most once: each call of it gives one sample of each timing (the least of
its jobs of each kind, `gathering` for host functions that time their own parts), and
once `SAMPLES` calls have given `fwd` and `bwd`, the least of each is decided, all at
once (a first call also pays for imports and warm-up), and kept until the user asks for
new ones (`forget_timings`). `TIMINGS.decided(key, shapes)` (part of the key of
eager calls' compiled stages, for each site of the program) changes only then.

Who times what: `dx.sparse_solve` times its factorisation (`setup`) apart from each
right-hand side (`fwd`, `bwd`); any other `dx.host` site's runner times each whole job
where it runs (`_runner`), so its `fwd` and `bwd` include any setup of their own.
`workers` is the hint's, else the number of jobs the site's executor runs at once
(`_executor.jobs_at_once`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Hashable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _runtime
from .._concurrency import _placement

# A host round trip between two stages (a `pure_callback` out of a compiled program and back,
# and the executor's hand-off): a trivial `dx.host` site under `jit` took 3.0 ms deferred (one
# stage) and 6.8 ms standard (two) on a 2-core CPU at load 13; less on an idle machine
# (`benchmarks/bench_cost.py`'s "stage" case measures it: see `STAGE_SECONDS` there).
STAGE_SECONDS = 1e-3
# On an accelerator a round trip is the device's transfer to the host and back, which JAX's
# callback makes slowly (1 MB took 9.1 ms on a TPU v5e, 0.4 ms on a CPU; docs/accelerators.md):
# measured once a process and platform, at first use (`round_trip_seconds`).
_MEASURED_BYTES = 1 << 22  # (4 MB: the size whose time gives the price of a byte)
SAMPLES = 3  # timings of a site's first calls, of which the least is kept
DEFAULT_STAGE = 0.01  # (in units of one forward, with the equal-cost defaults)


_BAD_COST = """`dx.Cost`: `{field}` must be {expected}, but got {found!r}.
Give seconds (or any one unit for every number), for example:

    dx.Cost(fwd=0.8, bwd=0.9)                       # a forward and an adjoint solve
    dx.Cost(setup=2.0, fwd=0.05, bwd=0.05)          # a factorisation shared by every solve of a job"""


class Cost(eqx.Module):
    """What a site's implementations cost: the hint from which [`deferax.filter_value_and_grad`][]
    estimates each schedule's wall time when no `max_basis` is set (see "How the schedule
    is chosen" in the docs). Numbers are seconds, or any one unit for all of them.

    **Arguments:**

    - `fwd`: the forward's work (a forward solve), past the setup. Default: measured from
      earlier calls, else 1.
    - `bwd`: one adjoint's work (one adjoint right-hand side), past the setup. Default:
      measured, else 1.
    - `setup`: work one job does once for any number of right-hand sides (a factorisation).
      Default: measured, else 0.
    - `keeps_setup`: the standard schedule's backward pass reuses the forward's setup (a
      factorisation kept on the host between the passes); otherwise it pays it again.
    - `linear`: the adjoint is linear over complex numbers in the cotangent, so a complex
      output's `k` real basis cotangents need `ceil(k / 2)` adjoints (set for
      `dx.host(..., linear_adjoint=True)` and `dx.sparse_solve`).
    - `workers`: how many jobs of one site run at once where it runs (a positive int), for an
      implementation whose forward and adjoints are separate jobs (a `dx.host` site
      without `fused_batch`: `fwd` and `adjoint`, or `fused` once per cotangent). Default: taken from the site's
      executor: deferax's own thread pool's size (no `executor=`), at most the cores this
      process may use; the cores for a `ThreadPoolExecutor` or `ProcessPoolExecutor` of
      yours (its size is not public: give `workers` for a smaller pool); a Dask
      `distributed.Client`'s worker threads, all workers together (asked of the
      scheduler); 1 for any other executor (`client.get_executor()`'s among them), and
      for a site with `thread_safe=False` (its jobs run one at a time). A thread pool's
      jobs also share the cores' native threads among this many.
    - `stage`: the overhead of one stage (a host round trip). Default: 1 ms when any
      number is known, a hundredth of a forward with the equal-cost defaults.
    - `note`: a remark shown with the site's estimates in [`deferax.explain`][] (a
      [`deferax.sparse_solve`][] says there why its factorisation is not kept).

    !!! Example

        ```python
        import deferax as dx

        cost = dx.Cost(setup=0.030, fwd=0.002, bwd=0.002, keeps_setup=True)
        ```
    """

    fwd: float | None = eqx.field(default=None, static=True)
    bwd: float | None = eqx.field(default=None, static=True)
    setup: float | None = eqx.field(default=None, static=True)
    keeps_setup: bool = eqx.field(default=False, static=True)
    linear: bool = eqx.field(default=False, static=True)
    # (an int, NumPy's made one; `Any` so that a wrong value reaches the check)
    workers: Any = eqx.field(default=None, static=True, converter=lambda w: int(w) if isinstance(w, np.integer) else w)
    stage: float | None = eqx.field(default=None, static=True)
    note: str | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        for field, value in self._seconds().items():
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    _BAD_COST.format(field=field, expected="a non-negative, finite number or None", found=value)
                )
        workers = self.workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            expected = "a positive int or None (taken from the executor)"
            raise ValueError(_BAD_COST.format(field="workers", expected=expected, found=self.workers))

    def _seconds(self) -> dict[str, float | None]:
        return {"fwd": self.fwd, "bwd": self.bwd, "setup": self.setup, "stage": self.stage}


class Estimates(eqx.Module):
    """The estimated wall time of a site's schedules, beside the choice in [`deferax.Site`][].

    **Fields:**

    - `standard`: the standard schedule's.
    - `deferred`: the deferred (`k = 1` or no dependence) or deferred-basis schedule's;
      None for a site that cannot be deferred.
    - `source`: where the numbers come from: `"hint"` (the `cost=` given), `"measured"`
      (earlier calls) or `"defaults"` (equal costs, in units of one forward).
    - `forward_basis`: the forward-basis strategy's (`forward_basis` below), for a site
      with `jvp` or `jvp_batch` whose costs are known; None otherwise.
    - `note`: the site's remark on them (its [`deferax.Cost`][]'s `note`), or None.
    """

    standard: float
    deferred: float | None
    source: str
    forward_basis: float | None = None
    note: str | None = None

    def __str__(self) -> str:
        unit = "" if self.source == "defaults" else " s"
        source = {"defaults": "equal costs assumed", "hint": "from cost="}.get(self.source, self.source)
        named = {"standard": self.standard, "deferred": self.deferred, "forward-basis": self.forward_basis}
        shown = ", ".join(f"{name} {value:.4g}{unit}" for name, value in named.items() if value is not None)
        return f"{shown} ({source}{'; ' + self.note if self.note else ''})"


# ----------------------------------------------------------------------------- timings of earlier calls


class Timings:
    """The timings of sites' earlier calls, by (site identity, input shapes), with their lock:
    for each of `setup`, `fwd`, `bwd`, one sample a call of a site's first calls, until
    `samples` calls have given `fwd` and `bwd`; then the least of each kind, decided once
    (what the estimates are made from, below); and, on each thread, the timings
    gathered for one job that times its own parts (`gathering`,
    in the runtime's thread-local `TIMINGS_GATHERING`: one for the process, as this object is)."""

    def __init__(self, samples: int):
        self.samples = samples
        self._lock = threading.Lock()
        self._decided: dict[tuple, dict[str, float]] = {}
        self._sampled: dict[tuple, dict[str, list[float]]] = {}
        self._gathering = _runtime.TIMINGS_GATHERING

    def observe(self, key: Any, shapes: tuple, seconds: dict[str, float]) -> None:
        """One call's timings of site `key` on inputs of `shapes` (gathered instead, inside
        `gathering` on this thread)."""
        gathered = getattr(self._gathering, "seconds", None)
        if gathered is not None:
            into = gathered.setdefault((key, shapes), {})
            for what, t in seconds.items():
                into[what] = min(float(t), into.get(what, math.inf))
            return
        with self._lock:
            if (key, shapes) in self._decided:
                return
            sampled = self._sampled.setdefault((key, shapes), {})
            for what, t in seconds.items():
                kept = sampled.setdefault(what, [])
                if len(kept) < self.samples:
                    kept.append(float(t))
            if all(len(sampled.get(what, ())) >= self.samples for what in ("fwd", "bwd")):
                self._decided[(key, shapes)] = {what: min(kept) for what, kept in sampled.items()}
                del self._sampled[(key, shapes)]

    @contextlib.contextmanager
    def gathering(self) -> Iterator[dict]:
        """Inside, the timings observed on this thread are gathered into the dict yielded,
        the least of each kind for each site."""
        outer = getattr(self._gathering, "seconds", None)
        self._gathering.seconds = gathered = {}
        try:
            yield gathered
        finally:
            self._gathering.seconds = outer

    def decided(self, key: Any, shapes: tuple) -> dict[str, float]:
        """The timings decided for site `key` on inputs of `shapes` (empty before)."""
        with self._lock:
            return dict(self._decided.get((key, shapes), {}))

    def decide(self, key: Any, shapes: tuple, seconds: dict[str, float]) -> None:
        """Decide `seconds` for site `key` on inputs of `shapes` (for tests: as its first calls would)."""
        with self._lock:
            self._decided[(key, shapes)] = dict(seconds)
            self._sampled.pop((key, shapes), None)

    def sampled(self, key: Any, shapes: tuple) -> dict[str, list[float]]:
        """The samples kept of site `key` on inputs of `shapes`, not yet decided (empty after)."""
        with self._lock:
            return {what: list(kept) for what, kept in self._sampled.get((key, shapes), {}).items()}

    def sites(self, sampled: bool = False) -> list[tuple]:
        """The `(key, shapes)` of the sites whose timings are decided (and, with `sampled`,
        those still sampled)."""
        with self._lock:
            return list(self._decided) + (list(self._sampled) if sampled else [])

    def __len__(self) -> int:
        """How many sites have timings, decided or sampled."""
        with self._lock:
            return len(self._decided) + len(self._sampled)

    def clear(self) -> None:
        """Forget every timing (also the gathering on this thread)."""
        with self._lock:
            self._decided.clear()
            self._sampled.clear()
        self._gathering.__dict__.clear()


# one for the process, cleared by `_runtime.reset()`
TIMINGS = Timings(SAMPLES)
_runtime.on_reset(TIMINGS.clear)


def observe(key: Hashable, shapes: tuple, **seconds: float) -> None:
    """One call's timings of the site `key` (`ExpensiveFn.timings_key`) on inputs of
    `shapes` (`setup`, `fwd`, `bwd`: seconds). Inside `gathering` on this thread they are
    gathered there instead. Once `SAMPLES` calls have given `fwd` and `bwd`, the least of
    each kind is decided: then, and only then, the site's decisions change (one new plan,
    one compilation of the programs that contain it). (`TIMINGS` keeps them.)"""
    TIMINGS.observe(key, shapes, seconds)


def gathering() -> contextlib.AbstractContextManager[dict]:
    """Inside, the timings that `observe` gets on this thread are gathered, the least of each
    kind for each site, into the dict yielded (for a host function that times its own
    parts, several solves in one job: the job's runner feeds them to `observe` as one
    sample of its call)."""
    return TIMINGS.gathering()


def forget_timings() -> None:
    """Forget the timings of earlier calls, so that the schedules chosen from them are chosen
    again from the next calls' (after a change of machine load, of executor, of problem).
    Programs compiled under `jax.jit` keep the plan they were traced with."""
    TIMINGS.clear()


# ----------------------------------------------------------------------------- the estimates


def round_trip_seconds(nbytes: int = 0) -> float:
    """A host round trip's price where the halves run (`_placement.platform`), with `nbytes`
    going to the host: on a CPU, `STAGE_SECONDS` (measured by `benchmarks/bench_cost.py`,
    mostly the executor's hand-off); on an accelerator, measured here once a process (the
    least of 5 jitted `jax.pure_callback` calls of 4 bytes, and of 4 MB for a byte's price)."""
    platform = _placement.platform()
    if platform == "cpu":
        return STAGE_SECONDS
    fixed, per_byte = _measured(platform)
    return fixed + per_byte * nbytes


@_runtime.cached(maxsize=8)
def _measured(platform: str) -> tuple[float, float]:
    """`(fixed, per byte)` seconds of a host round trip on the default device, measured now."""

    def seconds(nbytes: int) -> float:
        struct = jax.ShapeDtypeStruct((max(1, nbytes // 4),), np.float32)
        trip = jax.jit(lambda a: jax.pure_callback(np.asarray, struct, a))
        a = jax.block_until_ready(jnp.zeros(struct.shape, struct.dtype))
        jax.block_until_ready(trip(a))  # (compiled, untimed)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(trip(a))
            times.append(time.perf_counter() - start)
        return min(times)

    with jax.ensure_compile_time_eval():  # (run now, also when asked while a step is traced)
        fixed = seconds(4)
        return fixed, max(0.0, seconds(_MEASURED_BYTES) - fixed) / _MEASURED_BYTES


def numbers(key: Hashable, shapes: tuple, hint: Cost, defaults: bool = False) -> tuple:
    """`(setup, fwd, bwd, stage, source)` for a site: its hint's numbers, else its timings,
    else the equal-cost defaults (all of them with `defaults`)."""
    measured = TIMINGS.decided(key, shapes)
    given = {f: value for f, value in hint._seconds().items() if f != "stage" and value is not None}
    if defaults or not {"fwd", "bwd"} <= set(measured) | set(given):  # (seconds are not mixed with the defaults' units)
        measured = {}
        given = {} if defaults else given
    numbers = {"fwd": 1.0, "bwd": 1.0, "setup": 0.0} | measured | given
    source = "measured" if set(measured) - set(given) else "hint" if given else "defaults"
    stage = hint.stage if hint.stage is not None and not defaults else None
    # (the input's numbers go to the host: as float32, a lower bound)
    nbytes = 4 * sum(math.prod(shape) for shape in shapes)
    stage = stage if stage is not None else DEFAULT_STAGE if source == "defaults" else round_trip_seconds(nbytes)
    return numbers["setup"], numbers["fwd"], numbers["bwd"], stage, source


def standard_seconds(setup: float, fwd: float, bwd: float, stage: float, hint: Cost, fused_only: bool) -> float:
    """A site's standard schedule from its numbers (`numbers`): its forward, then its
    backward (a second setup unless the hint says it is kept; `fused` twice where it is the
    only implementation), a stage each."""
    if fused_only:
        return 2 * (setup + fwd + bwd) + 2 * stage
    return setup + fwd + (0.0 if hint.keeps_setup else setup) + bwd + 2 * stage


def at_once(jobs: list[float], workers: int, stage: float, peers: int = 1) -> float:
    """Jobs of these seconds run at once on `workers` in one stage, with `peers` sites'
    alike sharing them (each site's share): the longest job, or all jobs' seconds shared
    among the workers, whichever is longer, plus the stage."""
    return max(max(jobs), peers * sum(jobs) / workers) / peers + stage
