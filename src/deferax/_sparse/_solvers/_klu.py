"""`KLU`: SuiteSparse's KLU through klujax's handle API (`analyze`, `factor`, then
`solve_with_numeric` and `tsolve_with_numeric` with the numeric handle), on the host.

klujax's functions are JAX calls on the CPU; importing klujax turns `jax_enable_x64` on and sets
`jax_platform_name` for the whole process, so it is imported here with both put back, and
called with x64 on and the CPU device for this thread only."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ... import _runtime
from .._solver import _SINGULAR, AbstractSparseSolver
from . import _fill

_NO_KLUJAX = """`dx.KLU`: klujax is not installed, and this solver calls it. Install it: `pip install klujax`, or \
leave `solver=` out (the default measures the solvers that are installed)."""

_SPLINEAX_FORK = """`dx.KLU`: the module `klujax` installed here is splineax-klujax's ({version}, the fork \
that splineax installs under klujax's name), not klujax's, and a deferax host job that called it hung (under \
`jit`, n = 3,600, 2026-12-07). `dx.AutoSparseSolver` leaves KLU out while it is there. Leave `solver=` out, or \
choose `dx.Pardiso()`, `dx.Cholmod()` or `dx.SuperLU()`; `pip install --force-reinstall klujax` would bring \
klujax's own module back, and break splineax."""

_IMPORT_LOCK = threading.Lock()


def available() -> bool:
    """Whether klujax can be imported, and is klujax's own (not splineax's fork: `_fork`)."""
    return importlib.util.find_spec("klujax") is not None and _fork() is None


@_runtime.cached(maxsize=1)
def _fork() -> str | None:
    """splineax-klujax's version where the `klujax` module on the path is that distribution's
    file (splineax installs it under klujax's name; with both distributions installed, the
    file is whichever came last): told by the file's hash against the distribution's record.
    None otherwise."""
    import base64
    import hashlib

    spec = importlib.util.find_spec("klujax")
    try:
        fork = importlib.metadata.distribution("splineax-klujax")
    except importlib.metadata.PackageNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return None
    with open(spec.origin, "rb") as f:
        digest = base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
    for file in fork.files or ():
        if file.name == pathlib.PurePath(spec.origin).name and file.hash is not None and file.hash.value == digest:
            return fork.version
    return None


def _klujax() -> Any:
    """klujax, imported with the process's `jax_enable_x64` and `jax_platform_name` left as
    they were (its import turns the first on and sets the second to "cpu")."""
    import sys

    import jax

    if importlib.util.find_spec("klujax") is None:
        raise ImportError(_NO_KLUJAX)
    if (version := _fork()) is not None:
        raise ImportError(_SPLINEAX_FORK.format(version=version))
    with _IMPORT_LOCK:  # (the first import, once: the config read and put back around it)
        if "klujax" not in sys.modules:
            names = ("jax_enable_x64", "jax_platform_name")
            before = {name: jax.config.read(name) for name in names}
            try:
                import klujax
            finally:
                for name, value in before.items():
                    if jax.config.read(name) != value:
                        jax.config.update(name, value)
    import klujax  # (complete: an import under way on another thread is waited for)

    return klujax


@contextlib.contextmanager
def _on_cpu_x64() -> Iterator[None]:
    """klujax's calls: 64-bit handles and values, on the CPU (its FFI targets are CPU only),
    for this thread only."""
    import jax

    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):  # (`jax.enable_x64`: jax >= 0.8)
        yield


class _Factors:
    """A KLU factorisation: the symbolic and numeric handles (freed with this object), the
    dtype it was made in and the matrix's, and the entries its factors are estimated to hold."""

    def __init__(self, symbolic: Any, numeric: Any, work: np.dtype, dtype: np.dtype, entries: int):
        self.symbolic, self.numeric, self.work, self.dtype, self.entries = symbolic, numeric, work, dtype, entries

    def close(self) -> None:
        """Free the handles now (they are freed when collected otherwise)."""
        self.numeric.close()
        self.symbolic.close()


class KLU(AbstractSparseSolver):
    """SuiteSparse's KLU (a sparse LU for circuit-like and other unsymmetric matrices), through
    [klujax](https://github.com/flaport/klujax)'s handle API, on the host: `analyze` and
    `factor` once, then `solve_with_numeric` for `A x = b` and `tsolve_with_numeric` for the
    plain transpose `A^T x = b` (no conjugate, for complex matrices too) on the same numeric
    factors. Real (float64) and complex (complex128) matrices are factored natively; float32
    and complex64 ones (`precision="input"`) in float64 and complex128, as KLU has no single
    precision, and the solutions are returned in the matrix's dtype.

    Needs klujax (`pip install klujax`); importing it is done so that the process's
    `jax_enable_x64` and `jax_platform_name` stay as they were. Each call is a JAX call on the
    CPU (about 0.3 ms of dispatch each), which a small system notices; KLU releases Python's
    GIL while it factors and solves.

    Its `nbytes` is an estimate, as klujax does not say how many entries KLU's factors hold:
    those of SuperLU's factors on the same pattern (the least over its orderings), where
    [`deferax.AutoSparseSolver`][] or [`deferax.SuperLU`][] measured them in this process, else
    the matrix's own entries (a lower bound); an entry in the dtype factored and a 4-byte index each.
    """

    def factor(self, matrix: Any) -> Any:
        klujax = _klujax()
        dtype = np.dtype(matrix.dtype)
        work = np.promote_types(dtype, np.float64)
        n = matrix.shape[0]
        rows = np.asarray(matrix.indices, np.int32)
        cols = np.repeat(np.arange(n, dtype=np.int32), np.diff(matrix.indptr))
        data = np.asarray(matrix.data, work)
        try:
            with _on_cpu_x64():
                symbolic = klujax.analyze(rows, cols, n)
                numeric = klujax.factor(rows, cols, data, symbolic)
        except Exception as e:  # (klujax reports KLU's failure as a JAX runtime error)
            if "singular" not in str(e):
                raise
            raise np.linalg.LinAlgError(_SINGULAR.format(solver="KLU", why=f"a zero pivot ({e})")) from None
        return _Factors(symbolic, numeric, work, dtype, _fill.estimated_entries(matrix)[0])

    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        klujax = _klujax()
        f = factorisation
        with _on_cpu_x64():
            call = klujax.tsolve_with_numeric if transpose else klujax.solve_with_numeric
            out = call(f.numeric, np.ascontiguousarray(rhs, f.work), f.symbolic)
            return np.asarray(out).astype(f.dtype, copy=False)

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        """An estimate (klujax does not report it): the entries of SuperLU's factors on the
        same pattern where they were measured, else the matrix's own (a lower bound), an entry
        in the dtype factored and a 4-byte index each."""
        f = factorisation
        return f.entries * (f.work.itemsize + 4)
