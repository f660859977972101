"""`SparsePattern`: where the stored entries of a square sparse matrix are, the static half of
`sparse_solve`'s matrix (its `values`, a JAX array, are the other)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Inexact

from .._jaxpr import shape_text

_BAD_PATTERN = """`dx.SparsePattern`: {what}, but got {found}.
A pattern is the row and column index of each stored entry of an `n x n` matrix:

    dx.SparsePattern(rows=np.array([0, 1, 1]), cols=np.array([0, 0, 1]), n=2)"""


@dataclasses.dataclass(frozen=True, eq=False)
class SparsePattern:
    """Where the stored entries of a square sparse matrix are: the static half of
    [`deferax.sparse_solve`][]'s matrix (its `values` are the other, a JAX array).

    Entry `k` of `values` sits at row `rows[k]`, column `cols[k]`; entries at the same
    position add up (as in SciPy's COO format). A pattern is hashable and compares by
    value, so a program built for one pattern is reused for an equal one.

    **Arguments:**

    - `rows`, `cols`: integer index arrays of equal length `nnz`, each entry in `[0, n)`.
    - `n`: the size of the matrix.
    """

    rows: np.ndarray
    cols: np.ndarray
    n: int
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)  # (set in `__post_init__`)

    def __post_init__(self):
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(_BAD_PATTERN.format(what="`n` must be a positive int", found=repr(n)))
        for what, given in (("rows", self.rows), ("cols", self.cols)):
            a = np.asarray(given)
            if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
                raise ValueError(_BAD_PATTERN.format(what=f"`{what}` must be a 1-D integer array", found=shape_text(a)))
            if a.size and (a.min() < 0 or a.max() >= n):
                raise ValueError(
                    _BAD_PATTERN.format(
                        what=f"every entry of `{what}` must be in [0, n) = [0, {n})",
                        found=f"entries from {a.min()} to {a.max()}",
                    )
                )
            a = a.astype(np.int64)  # (a copy: the caller's array may change, the pattern may not)
            a.setflags(write=False)
            object.__setattr__(self, what, a)
        if self.rows.shape != self.cols.shape:
            raise ValueError(
                _BAD_PATTERN.format(
                    what="`rows` and `cols` must have the same length",
                    found=f"{self.rows.size} rows and {self.cols.size} cols",
                )
            )
        object.__setattr__(self, "n", int(n))
        object.__setattr__(self, "_hash", hash((self.n, self.rows.tobytes(), self.cols.tobytes())))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparsePattern):
            return NotImplemented
        return self is other or (
            self._hash == other._hash
            and self.n == other.n
            and np.array_equal(self.rows, other.rows)
            and np.array_equal(self.cols, other.cols)
        )

    def __repr__(self) -> str:
        return f"SparsePattern(n={self.n}, nnz={self.nnz})"

    @property
    def nnz(self) -> int:
        """The number of stored entries (the length of `values`)."""
        return int(self.rows.size)

    @property
    def structurally_symmetric(self) -> bool:
        """Whether an entry at `(i, j)` always has one at `(j, i)` (finite-element and most
        frequency-domain matrices): [`deferax.SuperLU`][] then orders its columns for `A + A^T`."""
        return self._transposition() is not None

    def _transposition(self) -> tuple[np.ndarray, np.ndarray, int] | None:
        """`(inverse, transposed, m)`: the `m` distinct positions, each entry's position
        among them (`inverse`) and each position's mirror (`transposed`); None when some
        position has no mirror. Computed once per pattern."""
        if "_transposed" not in self.__dict__:
            n = self.n
            positions, inverse = np.unique(self.rows * n + self.cols, return_inverse=True)
            mirrors = (positions % n) * n + positions // n
            transposed = np.searchsorted(positions, mirrors)
            found = transposed < positions.size
            found[found] = positions[transposed[found]] == mirrors[found]
            value = (inverse.ravel(), transposed, positions.size) if found.all() else None
            object.__setattr__(self, "_transposed", value)
        return self.__dict__["_transposed"]

    def _symmetric(self, values: np.ndarray) -> bool:
        """Whether the matrix with entries `values` equals its transpose, exactly (entries at
        one position summed first)."""
        t = self._transposition()
        if t is None:
            return False
        inverse, transposed, m = t
        summed = np.bincount(inverse, weights=np.real(values), minlength=m)
        if np.iscomplexobj(values):
            summed = summed + 1j * np.bincount(inverse, weights=np.imag(values), minlength=m)
        return bool(np.array_equal(summed, summed[transposed]))

    def _csc(self, values: np.ndarray) -> Any:
        """The matrix with entries `values` (in the dtype given), as a `scipy.sparse.csc_matrix`
        in canonical form (sorted, entries at one position summed), as SciPy's COO
        conversion makes it. Its structure is computed once per pattern and shared by every
        matrix made here (read-only), so each call only gathers and sums `values`."""
        import scipy.sparse

        if "_csc_structure" not in self.__dict__:
            n = self.n
            positions, inverse = np.unique(self.cols * n + self.rows, return_inverse=True)  # (column-major)
            inverse = inverse.ravel()
            index = np.int32 if n <= np.iinfo(np.int32).max and positions.size <= np.iinfo(np.int32).max else np.int64
            indices = (positions % n).astype(index)
            indptr = np.r_[0, np.cumsum(np.bincount(positions // n, minlength=n))].astype(index)
            for a in (indices, indptr):  # (every matrix made here shares them)
                a.setflags(write=False)
            # (`inverse` is never handed out, and stays writable: NumPy 2.4's `bincount` with
            # weights took 5.3 ms with a read-only index on the 180 x 60 beam's 689,505 entries,
            # against 1.6 ms with a writable one)
            object.__setattr__(self, "_csc_structure", (inverse, indices, indptr))
        inverse, indices, indptr = self.__dict__["_csc_structure"]
        if indices.size == self.nnz:  # (no two entries at one position)
            data = np.empty_like(values)
            data[inverse] = values
        else:  # (`bincount` sums in the entries' order, as SciPy's conversion does)
            data = np.bincount(inverse, weights=np.real(values), minlength=indices.size)
            data = data.astype(values.dtype, copy=False)
            if np.iscomplexobj(values):
                data += 1j * np.bincount(inverse, weights=np.imag(values), minlength=indices.size)
        matrix = scipy.sparse.csc_matrix((data, indices, indptr), shape=(self.n, self.n), copy=False)
        matrix.has_sorted_indices = True  # (sorted by construction: no check, no copy)
        matrix.has_canonical_format = True
        return matrix

    def _indices32(self) -> tuple[np.ndarray, np.ndarray]:
        """`(rows, cols)` as int32 (read-only; int64 past int32's range), as a program gathers
        with them: half the bytes, and no int64 where `jax_enable_x64` is off. Made once per
        pattern."""
        if "_gathered_by" not in self.__dict__:
            index = np.int32 if self.n <= np.iinfo(np.int32).max else np.int64
            found = (self.rows.astype(index), self.cols.astype(index))
            for a in found:
                a.setflags(write=False)
            object.__setattr__(self, "_gathered_by", found)
        return self.__dict__["_gathered_by"]

    @classmethod
    def from_scipy(cls, matrix: Any) -> tuple[np.ndarray, SparsePattern]:
        """`(values, pattern)` of a square SciPy sparse matrix (any format), in COO order."""
        coo = matrix.tocoo()
        if coo.shape[0] != coo.shape[1]:
            raise ValueError(_BAD_PATTERN.format(what="the matrix must be square", found=f"shape {coo.shape}"))
        return np.asarray(coo.data), cls(coo.row, coo.col, coo.shape[0])

    def todense(self, values: ArrayLike) -> Inexact[Array, "n n"]:
        """The dense matrix, in JAX (differentiable): for checks and small references."""
        values = jnp.asarray(values)
        return jnp.zeros((self.n, self.n), values.dtype).at[self.rows, self.cols].add(values)
