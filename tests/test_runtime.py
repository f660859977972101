"""The process's state in one module (`_runtime`): what `reset` resets, that no other module
keeps state of its own, and which switches are process-wide and which per context."""

import ast
import concurrent.futures as cf
import contextvars
import importlib
import pathlib
import pkgutil
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

import deferax as dx
from deferax import _jaxpr, _runtime, _typed
from deferax._concurrency import _devices, _native_threads, _placement
from deferax._host import _executor, _host
from deferax._plan import _cost
from deferax._recognise import _cost as _recognise_cost
from deferax._sparse import _affinity, _factorisations, _solve

from .helpers import assert_tree_allclose

SRC = pathlib.Path(dx.__file__).parent

# Module-level containers that are constant tables, filled at import and never changed after
# (each: why it is not state). Anything else mutable belongs to `_runtime`.
CONSTANTS = {
    "deferax._checks._checks._SIGNATURES": "the expected signature of each implementation, for messages",
    "deferax._checks._checks._RULES": "the rule each implementation must follow, for messages",
    "deferax._host._host._METHODS": "how a host implementation is called, by kind",
    "deferax._jaxpr._dependence._CALL_PARAMS": "the parameter holding a call primitive's program, by primitive",
    "deferax._jaxpr._keys._EVALUATED_PARAMS": "the parameters of a custom rule that its evaluation reads",
    "deferax._jaxpr._linearity._LINEAR_UNARY": "primitives linear in their operand",
    "deferax._jaxpr._linearity._ADDITIVE": "primitives that add",
    "deferax._jaxpr._linearity._PRODUCT": "primitives that multiply",
    "deferax._jaxpr._linearity._LINEAR_FIRST": "primitives linear in their first operand",
    "deferax._jaxpr._program._INLINE": "the call primitives inlined, with their program parameter",
    "deferax._jaxpr._dependence._RULES": "the kind of custom rule of each custom-derivative primitive",
    "deferax._record._COLOURS": "a timeline plot's colour of each implementation",
    "deferax._runtime._POOL_SIZES": "each pool's size and thread names",
}
STATE_KINDS = (
    dict,
    list,
    set,
    bytearray,
    contextvars.ContextVar,
    cf.Executor,
    threading.local,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
)


def _modules():
    yield dx
    for info in pkgutil.walk_packages(dx.__path__, "deferax."):
        yield importlib.import_module(info.name)


def _module_state():
    """(qualified name, object) of every module-level mutable container, context variable,
    thread-local, executor and cache in the package."""
    for module in _modules():
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            if isinstance(value, STATE_KINDS) or hasattr(value, "cache_clear"):
                yield f"{module.__name__}.{name}", value


def test_no_module_keeps_state_outside_the_runtime():
    """Each mutable found at module level is the runtime's own (a module naming it once:
    `_TIMINGS = _cost.TIMINGS`), a store registered with `reset` (`_runtime.store`,
    `_runtime.cached`), or a constant table listed above with its reason."""
    owned = {id(value) for value in vars(_runtime).values()}
    cleared = set(_runtime._CLEARS)
    loose = []
    for name, value in _module_state():
        if name.startswith("deferax._runtime.") or id(value) in owned or name in CONSTANTS:
            continue
        clear = getattr(value, "cache_clear", None) or getattr(value, "clear", None)
        if clear is not None and clear in cleared:
            continue
        loose.append(name)
    assert loose == [], f"module-level state outside `_runtime` (declare it there, or register it): {loose}"
    assert [name for name in CONSTANTS if name not in dict(_module_state())] == []  # (no stale entries)


def test_no_global_statements():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


def test_one_place_makes_thread_pools_and_context_variables():
    """Only `_runtime` makes a `ThreadPoolExecutor` or a `ContextVar` (read from the source:
    a pool made in a function would not show at module level)."""
    makers = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "_runtime.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called.endswith(("ThreadPoolExecutor", "ContextVar", "threading.local")):
                    makers.append(f"{path.relative_to(SRC)}:{node.lineno}: {called}")
    assert makers == []


class _Shaped(dx.TypedModule):
    weight: Float[Array, "out in"]

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        return self.weight @ x


def _fill_everything():
    """Set every piece of the runtime away from its state at import, through the code that
    uses it where that is short."""
    dx.set_concurrency(False)
    dx.set_devices(jax.local_devices()[:1])
    for _ in range(_cost.SAMPLES):
        _cost.observe("decided", ((2,),), fwd=1.0, bwd=2.0)
    _cost.observe("sampled", ((2,),), fwd=1.0)
    _cost.TIMINGS._gathering.seconds = {}
    _native_threads._libraries()
    _runtime.EAGER_CACHE["key"] = "compiled"
    _runtime.REPLAY_ALONE[_Shaped] = True
    dx.register_recognition(jax.lax.sin_p, lambda operands, params: "never", name="sin")
    _runtime.RECOGNITION_BUILTINS.add("klujax")
    _runtime.TESSERACTS.add(_Shaped)
    _runtime.CUSTOM_VJPS[_Shaped] = True
    _runtime.RECORDERS.append("timeline")
    _affinity._WORKERS[_Shaped] = "workers"
    _typed._field_hints(_Shaped)
    _typed._signature(_Shaped.__call__)
    _recognise_cost.trial_seconds(dx.SparsePattern(np.array([0, 1]), np.array([0, 1]), 2), False)
    _factorisations.FACTORISATIONS.acquire("matrix", lambda: "its factorisation")  # (one user: kept)
    dx.set_factorisation_budget(12345)
    for var in _runtime.CONTEXT_VARS:
        var.set(object())
    dx.set_typechecking(False)
    return {name: _runtime.POOLS.get(name) for name in ("halves", "sites", "host")}


def test_reset_resets_every_piece():
    pools = _fill_everything()
    caches = [value for _, value in _module_state() if hasattr(value, "cache_clear")]
    assert sum(cache.cache_info().currsize for cache in caches) >= 3
    assert _placement.serialised(False) and _runtime.SWITCHES.devices is not None
    _runtime.reset()
    # the switches
    assert _runtime.SWITCHES == _runtime.Switches() and not _placement.serialised(False)
    assert _runtime.SWITCHES.devices is None
    assert {var.name: var.get() for var in _runtime.CONTEXT_VARS} == {
        var.name: contextvars.Context().run(var.get) for var in _runtime.CONTEXT_VARS
    }
    assert dx.typechecking_enabled() == _runtime.TYPECHECK_DEFAULT
    # the timings
    assert _cost.TIMINGS.decided("decided", ((2,),)) == {} and len(_cost.TIMINGS) == 0
    assert not hasattr(_cost.TIMINGS._gathering, "seconds")
    assert _runtime.NATIVE.found is None
    # the caches, registries and stores
    for store in (
        _runtime.EAGER_CACHE,
        _runtime.REPLAY_ALONE,
        _runtime.RECOGNITION_RULES,
        _runtime.RECOGNITION_BUILTINS,
        _runtime.TESSERACTS,
        _runtime.CUSTOM_VJPS,
        _runtime.RECORDERS,
        _affinity._WORKERS,
    ):
        assert len(store) == 0, store
    assert [cache for cache in caches if cache.cache_info().currsize] == []
    store = _factorisations.FACTORISATIONS
    assert len(store) == 0 and store.budget == _factorisations.default_budget()
    assert _solve._solve_site in caches and _host._check_picklable in caches
    # the pools: shut down (a job submitted to an old one is refused) and made afresh
    assert [_runtime.POOLS.made(name) for name in pools] == [None, None, None]
    for name, pool in pools.items():
        with pytest.raises(RuntimeError, match="after shutdown"):
            pool.submit(int)
        assert _runtime.POOLS.get(name) is not pool
    assert _executor.default_executor() is _runtime.POOLS.made("host")


# ----------------------------------------------------------------------------- switches and threads

A = np.array([[4.0, 1.0], [0.5, 3.0]])


class _Peak:
    """A host solve that records the most calls inside at once."""

    def __init__(self):
        self.inside = self.peak = 0
        self.lock = threading.Lock()

    def solve(self, matrix, rhs):
        with self.lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
        time.sleep(0.2)
        with self.lock:
            self.inside -= 1
        return np.linalg.solve(matrix, rhs)

    def site(self):
        out = jax.ShapeDtypeStruct((2,), jnp.float64)
        return dx.host(lambda b: self.solve(A, b), adjoint=lambda b, ct: self.solve(A.T, ct), out=out, name="peak")


def _in_thread(fn):
    """`fn()` run on a new thread (which starts with a fresh context), its result."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_concurrency_and_devices_are_process_wide():
    """Set on one thread, `set_concurrency` and `set_devices` hold on every thread: the
    caller's and those the calls run on."""
    peak = _Peak()
    loss = lambda x: jnp.sum(jnp.array([1.0, -2.0]) * peak.site()(x))  # noqa: E731
    reference = jax.value_and_grad(lambda x: jnp.sum(jnp.array([1.0, -2.0]) * jnp.linalg.solve(A, x)))
    x = jnp.array([0.3, -0.7])
    dx.filter_value_and_grad(loss)(x)
    assert peak.peak == 2  # (the forward and the adjoint at once)
    cpu = jax.local_devices()[0]
    _in_thread(lambda: (dx.set_concurrency(False), dx.set_devices([cpu, cpu])))
    peak.peak = 0
    got = dx.filter_value_and_grad(loss)(x)
    assert peak.peak == 1  # (set on the other thread, seen here and on the pool's threads)
    assert_tree_allclose(got, reference(x))
    assert _devices.pair(0) == (cpu, cpu)
    assert _in_thread(lambda: _devices.pair(0)) == (cpu, cpu)


def test_typechecking_is_per_context():
    """`set_typechecking` holds in the context it was called in: not on a thread started
    elsewhere, nor on one started after it (a new thread starts with the defaults), but
    deferax carries it into the threads it runs a step's work on."""
    wrong = _Shaped(jnp.ones((2, 3)))
    assert _in_thread(lambda: (dx.set_typechecking(False), dx.typechecking_enabled())) == (None, False)
    assert dx.typechecking_enabled()
    with pytest.raises(dx.AnnotationError, match="does not match its annotation"):
        wrong(jnp.ones(4))
    dx.set_typechecking(False)
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions") as info:
        wrong(jnp.ones(4))  # (not checked here: JAX's own error)
    assert not isinstance(info.value, dx.AnnotationError)
    assert _in_thread(dx.typechecking_enabled) is True
    pool = _runtime.POOLS.get("halves")
    assert pool.submit(_jaxpr.carry_context(dx.typechecking_enabled)).result() is False
