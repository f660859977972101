import ast
import gc
import os
import sys

import jax
import pytest
from hypothesis import Phase, settings
from jaxtyping import _import_hook


def _only_annotated_nested_functions():
    """The type checks of the suite (jaxtyping's import hook on deferax with beartype, as
    pyproject.toml's `--jaxtyping-packages` sets it up) wrap every function of deferax's
    modules, a nested one each time its enclosing function runs: beartype then writes and
    compiles the wrapper's code again, about a millisecond a call, a sixth of the suite's
    time. A nested function with no annotation has nothing to check (deferax writes no
    `isinstance` against a jaxtyping type), so it is left unwrapped here; every module-level
    function, method and class, and every annotated nested function, is wrapped as before.
    Done before deferax is imported (this file loads after the hook is installed, before any
    test imports deferax), and the modules so transformed are cached under their own name.
    The hook's internals are read: where they change, this fails here, loudly."""
    if "deferax" in sys.modules:
        raise RuntimeError("tests/conftest.py: deferax was imported before the type-check hook was adjusted")
    transformer = _import_hook.JaxtypingTransformer
    wrap_all, cache_name = transformer.visit_FunctionDef, _import_hook._optimized_cache_from_source

    def annotated(node):
        a = node.args
        args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
        return node.returns is not None or any(arg.annotation is not None for arg in args)

    def visit_FunctionDef(self, node):
        if annotated(node) or not any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in self._parents):
            return wrap_all(self, node)
        self._parents.append(node)
        self.generic_visit(node)
        self._parents.pop()
        return node

    def cached_as(typechecker_hash, /, path, debug_override=None):
        return cache_name(f"{typechecker_hash}n", path, debug_override)

    transformer.visit_FunctionDef = visit_FunctionDef
    _import_hook._optimized_cache_from_source = cached_as


_only_annotated_nested_functions()

# The mutation check (.ci/mutations.py) only needs to know that a property fails, not the
# smallest failing example: no shrinking there.
if os.environ.get("DEFERAX_MUTATION_CHECK"):
    settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], deadline=None)
    settings.load_profile("mutation")

# `DEFERAX_TESTS_X64=0` runs the suite in float32, x64 off: as on an accelerator, where x64 is
# not supported for every operation (on a TPU, a float64 solve or FFT raises, or aborts the
# process in XLA's compile). Tests written for float64 tolerances fail there; the core files
# pass (docs/accelerators.md says which, on which device).
if os.environ.get("DEFERAX_TESTS_X64", "1") != "0":
    jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")


_CACHE_OWNED = "DEFERAX_TESTS_OWN_JAX_CACHE"


def pytest_configure(config):
    """JAX's persistent compilation cache, one folder for the run, shared by its workers (and
    the Python processes the tests start): the tests compile the same small programs again
    and again (each test starts from empty caches, and parametrised cases compile the same
    stages), and XLA's compile was about a third of their time. A program found there is
    loaded, not compiled: what runs is the same executable (the key is the compiled program,
    JAX's version and its flags), and no trace is skipped (what the tests count is traced as
    before). A cache the caller chose (`JAX_COMPILATION_CACHE_DIR`; CI shares one among the
    parts of a leg) is used as it is. Made here, in the first process (pytest-xdist's
    workers start after it, with its environment), and removed when the run ends."""
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="deferax-tests-jax-cache-")
    os.environ.update(
        {"JAX_COMPILATION_CACHE_DIR": folder, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", _CACHE_OWNED: folder}
    )
    jax.config.update("jax_compilation_cache_dir", folder)  # (this process imported JAX before)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    folder = os.environ.get(_CACHE_OWNED)
    if folder and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


# The longest tests (a minute or two each on a 2-core machine, measured with `--durations`):
# collected first, so that pytest-xdist, which hands the first tests out one a worker in turn,
# starts them at once, and no worker runs one alone at the end while the others wait.
LONGEST = (
    "tests/test_properties.py::test_random_custom_vjp_programs_match_plain_jax",
    "tests/test_shard_map.py::test_sites_inside_shard_map",
    "tests/test_properties.py::test_random_programs_match_equinox",
    "tests/test_devices.py::test_every_kind_of_site_with_inputs_sharded_over_eight_devices",
)


def pytest_collection_modifyitems(config, items):
    rank = {nodeid: i for i, nodeid in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(LONGEST)))  # (a stable sort: the rest keep their order)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test: the garbage of earlier tests collected, and what is left alive then
    (modules, JAX's caches) moved out of the collector's reach (`gc.freeze`), so that a
    collection scans only what the tests since made. A worker that has run hundreds of tests
    holds millions of objects, and each full collection (Python's own, and the tests' that
    check what a step leaves behind) scanned them all: 217 tests took 173 s with this,
    211 s without. What each test makes is collected as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def float32_tolerances(monkeypatch):
    """In the float32 suite (`DEFERAX_TESTS_X64=0`), `np.testing.assert_allclose` compares to
    float32's accuracy (`helpers.tolerances`): a tolerance written for float64 is raised to
    it, none is lowered. Nothing changes in the float64 suite."""
    from .helpers import float32, tolerances

    if not float32():
        return
    import numpy as np

    strict = np.testing.assert_allclose

    def assert_allclose(actual, desired, rtol=1e-7, atol=0, *args, **kwargs):
        return strict(actual, desired, *tolerances(rtol, atol), *args, **kwargs)

    monkeypatch.setattr(np.testing, "assert_allclose", assert_allclose)


@pytest.fixture
def counter():
    from .helpers import Counter

    return Counter()


@pytest.fixture(autouse=True)
def fresh_runtime():
    """Each test starts from the process state of a fresh import (`_runtime.reset`): no
    timings of earlier calls (every host site times its jobs, and a site's timings, kept by
    its host functions and input shapes, would change another test's plan where the same
    functions are used), the switches at their defaults, empty caches and registries."""
    from deferax import _runtime

    _runtime.reset()
    yield
    _runtime.reset()


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    """The suite's expected plans are those of a 2-core machine, whatever this one has: the
    estimates count the jobs a thread pool runs at once, at most the cores (`_executor.
    jobs_at_once`), and the native thread limits share the cores among jobs."""
    from deferax._concurrency import _native_threads

    monkeypatch.setattr(_native_threads, "cores", lambda: 2)
