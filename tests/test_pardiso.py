"""`dx.Pardiso` (MKL's PARDISO) where it could go wrong: a pattern's analysis, made on its
first matrix, reused for a later one whose pivots it does not suit (perturbed pivots, and
factors that solve another matrix without a perturbed pivot), singular matrices, more
factorisations alive than one handle holds, factorisations on several threads at once, its
errors. Answers against dense solves in NumPy and plain JAX."""

import concurrent.futures as cf
import ctypes
import gc
import importlib.util
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.linalg

import deferax as dx

from .helpers import assert_tree_allclose

pytest.importorskip("pypardiso")

from deferax._sparse._solvers import _auto, _pardiso  # noqa: E402


def cycle(n=200, seed=0):
    """`(matrix(d, o), pattern)`: the pattern of the diagonal and a random permutation `q`,
    with `d` on the diagonal and `o` at `(i, q[i])`. With `d` small against `o` the matrix is
    as well-conditioned as with `d` large, but its LU must swap rows along `q`, across all of
    it, which the ordering and matching analysed on a diagonally dominant matrix do not do."""
    q = np.random.default_rng(seed).permutation(n)
    q[q == np.arange(n)] = (q[q == np.arange(n)] + 1) % n  # (no fixed point: no entry twice)
    rows, cols = np.r_[np.arange(n), np.arange(n)], np.r_[np.arange(n), q]
    pattern = dx.SparsePattern(rows, cols, n)
    return (lambda d, o: jnp.asarray(np.r_[np.full(n, d), np.full(n, o)])), pattern


def analyses(pattern, mtype=_pardiso._REAL):
    matrix = pattern._csc(np.ones(pattern.nnz))
    return _pardiso._ANALYSES.get((_pardiso._pattern_key(matrix), mtype), [])


def loss(v, b, pattern, solver):
    x = dx.sparse_solve(v, pattern, b, solver=solver)
    return jnp.sum(x**2) + jnp.sum(jnp.cos(x))


def dense(v, b, pattern):
    x = jnp.linalg.solve(pattern.todense(v), b)
    return jnp.sum(x**2) + jnp.sum(jnp.cos(x))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_later_matrix_the_analysis_does_not_suit_gets_the_right_answer(jit):
    """A pattern analysed on a diagonally dominant matrix, then matrices that must swap rows:
    with a diagonal of 0 to 1e-14 PARDISO perturbs pivots on that analysis, and the matrix
    is analysed again; with 1e-10 to 1e-3 no pivot is perturbed but the factors solve another
    matrix (NaN, or residuals of 1e140, when taken as they are), and the solve is SuperLU's.
    Value and gradient (the standard schedule: forward and transposed solves) against a
    dense solve in plain JAX."""
    make, pattern = cycle()
    b = jnp.asarray(np.random.default_rng(1).normal(size=pattern.n))
    run = jax.value_and_grad(lambda v, b: loss(v, b, pattern, dx.Pardiso()), argnums=(0, 1))
    run = jax.jit(run) if jit else run
    reference = jax.value_and_grad(lambda v, b: dense(v, b, pattern), argnums=(0, 1))
    for i, d in enumerate((0.0, 1e-300, 1e-14, 1e-10, 1e-6, 1e-3)):
        _pardiso._ANALYSES.clear()  # (each on an analysis of the diagonally dominant matrix)
        # (new values each time: no factorisation of an earlier round found again, also one
        # leased eagerly to an output that a reference cycle keeps past its call, as on jax 0.12)
        well = make(1.0 + 0.01 * i, 0.1)
        assert_tree_allclose(run(well, b), reference(well, b), rtol=1e-9, atol=1e-11)
        first = list(analyses(pattern))
        v = make(d, 1.0)
        assert np.linalg.cond(pattern.todense(v)) < 1.01
        assert_tree_allclose(run(v, b), reference(v, b), rtol=1e-9, atol=1e-11)
        assert len(first) == 1 and first[0].stale  # (found not to suit: the next matrix is analysed afresh)


def test_the_backward_error_of_several_solutions_at_once():
    """`_backward_error` checks the columns through one random combination: against the
    largest column's own error (`|b - A x| / (|A|_F |x| + |b|)`, each computed alone), within
    `sqrt(k)` above it, and never far below it where one column is bad among good ones, its
    solution huge (past 1e154, whose square overflows) or not finite."""
    rng = np.random.default_rng(0)
    matrix = scipy.sparse.random(50, 50, density=0.2, random_state=1, format="csc") + 3 * scipy.sparse.eye(50)
    matrix = matrix.tocsc()
    norm = float(scipy.sparse.linalg.norm(matrix))

    def each(b, x):
        r = b - matrix @ x
        return np.linalg.norm(r, axis=0) / (norm * np.linalg.norm(x, axis=0) + np.linalg.norm(b, axis=0))

    b = rng.normal(size=(50, 4))
    good = np.asfortranarray(scipy.sparse.linalg.spsolve(matrix, b))
    for bad, scale in ((None, 1.0), (2, 1.0), (0, 1e160), (1, 1e153), (3, 1e-160)):
        x = good.copy()
        if bad is not None:
            x[:, bad] = scale * rng.normal(size=50)  # (not a solution)
        got = _pardiso._backward_error(matrix, b, x, norm, False)
        if bad is None:
            assert got < 1e-14
        elif scale == 1.0:
            worst = max(each(b, x))
            assert worst / 20 <= got <= 2 * worst, (bad, got, worst)
        else:  # (a huge non-solution: NaN, its squares past float64's range; a tiny one: about 1/sqrt(k))
            assert not got <= 1e-3, (bad, scale, got)
    x = good.copy()
    x[7, 1] = np.nan
    assert np.isnan(_pardiso._backward_error(matrix, b, x, norm, False))
    assert _pardiso._backward_error(matrix.T.tocsc(), b, good, norm, True) < 1e-14  # (the transpose's)


def test_a_factorisation_that_solves_another_matrix_is_solved_by_superlu():
    make, pattern = cycle(seed=3)
    first = pattern._csc(np.asarray(make(1.0, 0.1)))
    dx.Pardiso().factor(first)  # (the analysis: a diagonally dominant matrix)
    matrix = pattern._csc(np.asarray(make(1e-6, 1.0)))
    f = dx.Pardiso().factor(matrix)
    assert isinstance(f, _pardiso._Factor) and f.fallback is None  # (no pivot perturbed)
    b = np.random.default_rng(2).normal(size=(pattern.n, 3))
    for transpose in (False, True):
        x = dx.Pardiso().solve(f, b, transpose)
        np.testing.assert_allclose((matrix.T if transpose else matrix) @ x, b, atol=1e-12)
    assert f.fallback is not None and f.analysis.stale
    fallback = f.fallback
    np.testing.assert_allclose(matrix @ dx.Pardiso().solve(f, b, False), b, atol=1e-12)
    assert f.fallback is fallback  # (SuperLU's factorisation made once, and used from then on)
    # PARDISO's own answer, unchecked: not a solution
    with f.analysis.lock:
        f.analysis.handle.iparm[11] = 2
        raw = f.analysis.handle.call(33, f.slot, f.data, np.asfortranarray(b))
    assert not np.all(np.abs(matrix @ raw - b) < 1e-3)
    # the pattern's next matrix: a fresh analysis, on its own values, and PARDISO's answer
    g = dx.Pardiso().factor(pattern._csc(np.asarray(make(1e-6, 1.0)) * 2.0))
    np.testing.assert_allclose(2.0 * matrix @ dx.Pardiso().solve(g, b, False), b, atol=1e-12)
    assert g.analysis is not f.analysis and g.fallback is None


@pytest.mark.parametrize("solver", [dx.Pardiso(), dx.AutoSparseSolver()], ids=["Pardiso", "Auto"])
def test_a_singular_matrix_raises_or_gives_nan(solver):
    rows, cols = np.array([0, 0, 1, 1, 2]), np.array([0, 1, 0, 1, 2])
    pattern = dx.SparsePattern(rows, cols, 3)
    v = jnp.array([1.0, 2.0, 2.0, 4.0, 1.0])  # (rank 2: the first two rows alike, scaled)
    b = jnp.array([1.0, 0.0, 1.0])
    with pytest.raises(dx.HostError, match="singular"):
        dx.sparse_solve(v, pattern, b, solver=solver)
    got = jax.grad(lambda v: jnp.sum(dx.sparse_solve(v, pattern, b, solver=solver, singular="nan")))(v)
    assert np.isnan(np.asarray(got)).all()


def test_more_factorisations_alive_than_a_handle_holds():
    """`_SLOTS` numeric factorisations a handle: more alive at once take another handle (and
    analysis); each answers its own matrix, and each slot is freed with its factorisation."""
    make, pattern = cycle(n=50, seed=5)
    count = _pardiso._SLOTS + 4
    matrices = [pattern._csc(np.asarray(make(2.0 + i, 0.5))) for i in range(count)]
    made = [dx.Pardiso().factor(m) for m in matrices]
    held = analyses(pattern)
    assert len(held) == 2 and [len(a.free) for a in held] == [0, _pardiso._SLOTS - 4]
    b = np.random.default_rng(0).normal(size=pattern.n)
    for m, f in zip(matrices, made, strict=True):
        np.testing.assert_allclose(m @ dx.Pardiso().solve(f, b, False), b, atol=1e-12)
    del made, f
    gc.collect()
    assert [len(a.free) for a in held] == [_pardiso._SLOTS] * 2 and not any(a.ended for a in held)
    # a factorisation collected while its handle's lock is held (by the collector, on a thread
    # inside a call): its slot is freed at the handle's next use, not waited for
    f = dx.Pardiso().factor(matrices[0])
    with held[0].lock:
        del f
        gc.collect()
        assert len(held[0].ended) == 1 and len(held[0].free) == _pardiso._SLOTS - 1
    g = dx.Pardiso().factor(matrices[1])
    assert g.analysis is held[0] and not held[0].ended and len(held[0].free) == _pardiso._SLOTS - 1
    np.testing.assert_allclose(matrices[1] @ dx.Pardiso().solve(g, b, False), b, atol=1e-12)


def test_factorisations_on_four_threads_at_once():
    make, pattern = cycle(n=400, seed=6)
    b = np.random.default_rng(0).normal(size=pattern.n)

    def work(i):
        out = []
        for j in range(6):  # (a forward solve, then a transposed one, in turn)
            m = pattern._csc(np.asarray(make(2.0 + i + 0.1 * j, 0.7)))
            f = dx.Pardiso().factor(m)
            transpose = j % 2 == 1
            out.append(float(np.abs((m.T if transpose else m) @ dx.Pardiso().solve(f, b, transpose) - b).max()))
        return max(out)

    with cf.ThreadPoolExecutor(4) as pool:
        assert max(pool.map(work, range(8))) < 1e-12


def test_jacrev_and_vmap_solve_their_rows_together():
    make, pattern = cycle(n=60, seed=7)
    v = make(3.0, 0.5)
    b = jnp.asarray(np.random.default_rng(0).normal(size=pattern.n))
    solve = lambda v, b: dx.sparse_solve(v, pattern, b, solver=dx.Pardiso())  # noqa: E731
    with dx.record() as timeline:
        got = jax.jit(jax.jacrev(solve, argnums=1))(v, b)
    np.testing.assert_allclose(got, np.linalg.inv(pattern.todense(v)), atol=1e-12)
    assert timeline.counts(steps=True)["factor"] == 1
    bs = jnp.stack([b, 2 * b, -b])
    np.testing.assert_allclose(
        jax.vmap(solve, (None, 0))(v, bs), np.linalg.solve(pattern.todense(v), bs.T).T, atol=1e-12
    )


def test_the_threads_of_a_pattern_s_analysis_are_those_of_its_factorisations():
    """PARDISO plans a factorisation for the threads of its analysis: factored on fewer, it
    crashed the process. A pattern analysed on every core, then factored while MKL is limited
    to one thread (as deferax's limit for host jobs at once, or threadpoolctl's, sets it), in a
    process of its own."""
    script = textwrap.dedent(
        """
        import numpy as np, scipy.sparse
        from threadpoolctl import threadpool_limits
        import deferax as dx

        m = 60
        d = scipy.sparse.diags([-1.2 * np.ones(m - 1), 2.0 * np.ones(m), -0.8 * np.ones(m - 1)], [-1, 0, 1])
        matrix = (scipy.sparse.kronsum(d, d) + 1j * scipy.sparse.eye(m * m)).tocsc()
        b = np.ones(m * m, complex)
        f = dx.Pardiso().factor(matrix)
        with threadpool_limits(1):
            for scale in (2.0, 3.0):
                g = dx.Pardiso().factor(matrix * scale)
                assert g.analysis is f.analysis
                assert np.abs(scale * matrix @ dx.Pardiso().solve(g, b, False) - b).max() < 1e-12
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_errors_are_named(monkeypatch):
    make, pattern = cycle(n=20)
    matrix = pattern._csc(np.asarray(make(2.0, 0.5)))
    spd = scipy.sparse.csc_matrix(np.array([[2.0, 1.0], [1.0, 2.0]]))

    def failing(code):
        def pardiso(*args):
            args[-1]._obj.value = code  # (the `error` argument, by reference)

        pardiso.threads = lambda threads: 0
        return lambda: pardiso

    for code, kind, message in (
        (-2, MemoryError, "`dx.Pardiso`: PARDISO's phase 11 failed with error -2: not enough memory."),
        (-3, RuntimeError, "`dx.Pardiso`: PARDISO's phase 11 failed with error -3: a reordering problem."),
        (-99, RuntimeError, "`dx.Pardiso`: PARDISO's phase 11 failed with error -99: an error."),
        (-7, np.linalg.LinAlgError, "`dx.Pardiso`: the matrix is singular: PARDISO reported the diagonal matrix"),
    ):
        monkeypatch.setattr(_pardiso, "_pardiso", failing(code))
        other = pattern._csc(np.asarray(make(2.0, 0.5)) * (3.0 - code))  # (a pattern of its own: analysed)
        _pardiso._ANALYSES.clear()
        with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)")):
            _pardiso.factor(other, spd=False)
    monkeypatch.setattr(_pardiso, "_pardiso", failing(-4))
    _pardiso._ANALYSES.clear()
    with pytest.raises(
        np.linalg.LinAlgError, match="not symmetric positive definite: PARDISO's Cholesky found a pivot"
    ):
        _pardiso.factor(spd, spd=True)
    monkeypatch.undo()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(_pardiso.importlib.util, "find_spec", lambda name: None)
    _pardiso._pardiso.cache_clear()
    _auto._installed.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"`dx.Pardiso`: pypardiso is not installed.*pip install pypardiso"):
            dx.Pardiso().factor(matrix)
        assert not _pardiso.available()
        monkeypatch.setattr(_pardiso.importlib.util, "find_spec", find_spec)  # (SciPy's, below)
        monkeypatch.setattr(_pardiso, "available", lambda: False)
        used = []
        factor = _auto._factor
        monkeypatch.setattr(_auto, "_factor", lambda name, matrix: used.append(name) or factor(name, matrix))
        for i in range(6):  # (the other candidates, measured in turn)
            v = make(2.0, 0.5) * (1.0 + i)
            x = dx.sparse_solve(v, pattern, jnp.ones(pattern.n), solver=dx.AutoSparseSolver(), where="host")
            np.testing.assert_allclose((1.0 + i) * matrix @ np.asarray(x), 1.0, atol=1e-12)
        assert len(used) == 6 and not any(name.startswith("PARDISO") for name in used)
    finally:
        _pardiso._pardiso.cache_clear()
        _auto._installed.cache_clear()


def test_mkl_s_runtime_is_found_without_searching_the_whole_environment(monkeypatch, tmp_path):
    """MKL's runtime is where its wheel puts it (the environment's `lib`), found without
    pypardiso's search of the environment's whole tree (1.4 s each time, paid after every
    `_runtime.reset`); `PYPARDISO_MKL_RT` is honoured first, and where neither finds it,
    pypardiso's own search does. An analysis made before a reset is freed with the function it
    was made with."""
    import pypardiso

    def searched(*args, **kwargs):
        raise AssertionError("pypardiso's search of the whole tree")

    monkeypatch.delenv("PYPARDISO_MKL_RT", raising=False)
    monkeypatch.setattr(pypardiso.PyPardisoSolver, "__init__", searched)
    found = _pardiso._mkl_runtime()._name
    assert "mkl_rt" in found and hasattr(ctypes.CDLL(found), "pardiso")
    monkeypatch.setenv("PYPARDISO_MKL_RT", found)
    assert _pardiso._mkl_runtime()._name == found
    monkeypatch.setenv("PYPARDISO_MKL_RT", str(tmp_path / "libmkl_rt.so"))  # (as given: not searched past)
    with pytest.raises(OSError):
        _pardiso._mkl_runtime()
    monkeypatch.delenv("PYPARDISO_MKL_RT")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmkl_rt.a").write_bytes(b"not a shared library")  # (passed over)
    monkeypatch.setattr(_pardiso.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(_pardiso.site, "USER_BASE", str(tmp_path))
    with pytest.raises(AssertionError, match="search of the whole tree"):
        _pardiso._mkl_runtime()
    monkeypatch.undo()

    matrix = scipy.sparse.random(30, 30, density=0.2, random_state=1, format="csc") + 30 * scipy.sparse.eye(30)
    f = dx.Pardiso().factor(matrix.tocsc())
    from deferax import _runtime

    _runtime.reset()
    monkeypatch.setattr(_pardiso, "_pardiso", searched)  # (a lookup now would fail the solve and the free)
    unraised = []
    monkeypatch.setattr(sys, "unraisablehook", unraised.append)  # (what a finalizer raises)
    np.testing.assert_allclose(matrix @ dx.Pardiso().solve(f, np.ones(30), False), 1.0, atol=1e-12)
    kept = len(_pardiso._ANALYSES)  # (the reset let go of the analysis: `f` holds it alone)
    del f
    gc.collect()
    assert kept == 0 and not unraised, unraised
