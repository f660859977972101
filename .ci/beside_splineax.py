"""deferax beside splineax in one process (CI's package checks run this where `deferax[sparse]`,
splineax and pardiso-mkl-jax are installed together): each library's solves, deferax's with
its defaults on the host and with `dx.Pardiso()` (pypardiso's MKL), splineax's with its KLU and
PARDISO (pardiso-mkl-jax), in turn and again, each against SciPy's answer, under `jit`. Before,
deferax's `sparse` extra installed klujax over splineax's fork of it (splineax then failed to
import), and a deferax host job that called the fork hung. Then a loss that solves with
splineax's KLU through `lineax.linear_solve`: `dx.explain` lists it as left as it is (splineax
factors behind handles), and `dx.filter_value_and_grad` gives plain JAX's value and gradient."""

import faulthandler

faulthandler.dump_traceback_later(240, exit=True)  # (a hang fails the check, with its stacks)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lineax  # noqa: E402, F401
import numpy as np  # noqa: E402
import scipy.sparse  # noqa: E402
import splineax  # noqa: E402
from jax.experimental import sparse as jsparse  # noqa: E402

import deferax as dx  # noqa: E402
from deferax._sparse._solvers import _klu  # noqa: E402

jax.config.update("jax_enable_x64", True)
m = 60
d = scipy.sparse.diags([-1.3, 4.5, -0.7], [-1, 0, 1], shape=(m, m))
e = scipy.sparse.diags([-1.1, -0.9], [-1, 1], shape=(m, m))
matrix = (scipy.sparse.kron(scipy.sparse.identity(m), d) + scipy.sparse.kron(e, scipy.sparse.identity(m))).tocsc()
b = np.ones(m * m)
want = scipy.sparse.linalg.spsolve(matrix, b)
values, pattern = dx.SparsePattern.from_scipy(matrix)
coo = matrix.tocoo()
order = np.lexsort((coo.col, coo.row))
bcoo = jsparse.BCOO(
    (jnp.asarray(coo.data[order]), jnp.stack([jnp.asarray(coo.row[order]), jnp.asarray(coo.col[order])], 1)),
    shape=matrix.shape,
)


def deferax(solver):
    f = jax.jit(lambda v, b: dx.sparse_solve(v, pattern, b, solver=solver, where="host"))
    return [f(jnp.asarray(values) * (1 + 1e-3 * k), b) * (1 + 1e-3 * k) for k in range(14)][-1]


def theirs(solver):
    operator = splineax.BCOOLinearOperator(bcoo)
    return jax.jit(lambda b: splineax.linear_solve(operator, b, solver)[0].value)(jnp.asarray(b))


sides = {
    "deferax, its defaults": lambda: deferax(None),
    "deferax, dx.Pardiso()": lambda: deferax(dx.Pardiso()),
    "splineax, KLU": lambda: theirs(splineax.KLU()),
    "splineax, Pardiso": lambda: theirs(splineax.Pardiso()),
}
for _ in range(2):
    for name, side in sides.items():
        error = float(np.max(np.abs(np.asarray(side()) - want)))
        print(f"{name}: {error:.1e} off SciPy's answer")
        assert error < 1e-10, name


# a loss that solves with splineax's KLU through Lineax: listed by `explain`, left as it is, answered as plain JAX
def loss(data, rhs):
    operator = splineax.BCOOLinearOperator(jsparse.BCOO((data, bcoo.indices), shape=bcoo.shape))
    return jnp.sum(lineax.linear_solve(operator, rhs, solver=splineax.KLU()).value ** 2)


fn = dx.filter_value_and_grad(loss)
# (splineax's fork of klujax binds its handle-based `factor` in Lineax's `init`: listed too, as klujax's)
(call,) = [c for c in dx.explain(fn, bcoo.data, jnp.asarray(b)).recognised if c.call.startswith("lineax")]
print(f"{call.call}: {call.reason}")
assert call.call == "lineax.linear_solve with splineax.KLU" and call.site is None, call
assert call.reason.startswith("splineax's `KLU` factors in Lineax's `init`"), call.reason
got, plain = fn(bcoo.data, jnp.asarray(b)), jax.value_and_grad(loss)(bcoo.data, jnp.asarray(b))
assert np.allclose(got[0], plain[0], rtol=1e-12) and np.allclose(got[1], plain[1], rtol=1e-10, atol=1e-12)
print("deferax's KLU:", "used" if _klu.available() else "left out (the klujax module is splineax's fork)")
print("beside splineax: every solve right, no hang")
