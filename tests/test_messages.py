"""Where messages live: each beside its raise (`_checks/_messages.py` keeps only what several
modules share), and the host messages that no other test matched."""

import ast
import concurrent.futures as cf
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

SRC = pathlib.Path(dx.__file__).parent
X0 = np.array([0.5, 1.0, 2.0])
OUT = jax.ShapeDtypeStruct((3,), jnp.float64)


def _users() -> dict[str, set[str]]:
    """For each name `_messages` defines, the modules (other than itself) that read it."""
    messages = SRC / "_checks" / "_messages.py"
    names = set()
    for node in ast.parse(messages.read_text()).body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    users = {name: set() for name in names}
    for path in SRC.rglob("*.py"):
        if path == messages:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_messages":
                users.setdefault(node.attr, set()).add(str(path.relative_to(SRC)))
    return users


def test_shared_messages_module_keeps_only_what_several_modules_use():
    """A message (or table) used by one module is written beside its raise in that module."""
    users = _users()
    single = {name: sorted(where) for name, where in users.items() if len(where) < 2}
    assert single == {}, f"used by one module (or none), so it belongs beside its raise: {single}"


def test_no_message_text_defined_twice():
    """No message text is defined twice, in two modules or under two names (STYLE.md: one home per message)."""
    seen: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant | ast.BinOp):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id.isupper() and isinstance(node.value, ast.Constant):
                        if isinstance(node.value.value, str) and "{" in node.value.value:
                            seen.setdefault(node.value.value, []).append(f"{path.relative_to(SRC)}:{t.id}")
    assert {text[:60]: where for text, where in seen.items() if len(where) > 1} == {}


# ----------------------------------------------------------------------------- a host result that does not match


def _loss(f):
    return lambda x: jnp.sum(f(x) ** 2)


def test_wrong_shape_from_bwd_names_the_cotangent_expected():
    f = dx.host(lambda x: 2 * x, bwd=lambda x, y, ct: 2 * ct[:2], out=OUT, name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `bwd` returned float64[2], where float64[3] was expected "
        "(a cotangent shaped like the input `x`)."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        jax.grad(_loss(f))(X0)


def test_wrong_tangent_from_jvp_names_the_pair_expected():
    f = dx.host(lambda x: 2 * x, jvp=lambda x, t: (2 * x, 2 * t[:2]), out=OUT, name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `jvp` returned (float64[3], float64[2]), where "
        "(float64[3], float64[3]) was expected (a pair `(y, t_y)`: both declared by `out=`)."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        jax.jvp(f, (X0,), (np.ones(3),))


def test_wrong_batch_from_jvp_batch_names_the_pair_expected():
    f = dx.host(lambda x: 2 * x, jvp_batch=lambda x, ts: (2 * x, 2 * ts[:, :2]), out=OUT, name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `jvp_batch` returned (float64[3], float64[3, 2]), where "
        "(float64[3], float64[3, 3]) was expected (a pair `(y, t_ys)`: `y` declared by `out=`, `t_ys` the same "
        "with a leading axis of one tangent each)."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        jax.jacfwd(f)(X0)


def test_wrong_batch_from_fused_batch_names_the_pair_expected():
    m = np.arange(9.0).reshape(3, 3)

    def fused(x, ct):
        return 2 * x, 2 * ct

    def fused_batch(x, cts):
        return 2 * x, 2 * cts[:, :2]

    f = dx.host(lambda x: 2 * x, fused=fused, fused_batch=fused_batch, out=OUT, name="sim", max_basis=3)
    loss = lambda x: jnp.sum(jnp.dot(m, f(x)) ** 2)  # noqa: E731 (the output's cotangent depends on `f(x)`)
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `fused_batch` returned (float64[3], float64[3, 2]), where "
        "(float64[3], float64[3, 3]) was expected (a pair `(y, ct_xs)`: `y` declared by `out=`, `ct_xs` shaped like "
        "the input `x` with a leading axis of one cotangent each)."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        dx.filter_value_and_grad(loss, schedule="deferred")(X0)


# ----------------------------------------------------------------------------- a lost worker


class _Broken(cf.Executor):
    """An executor whose every job is lost, as when the worker running it dies."""

    def submit(self, fn, /, *args, **kwargs):
        future = cf.Future()
        future.set_exception(cf.BrokenExecutor("the worker died"))
        return future


def test_lost_worker_on_another_executor_says_to_submit_again():
    f = dx.host(lambda x: 2 * x, adjoint=lambda x, ct: 2 * ct, out=OUT, executor=_Broken(), name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `fwd` did not complete: the worker running it was lost "
        "(BrokenExecutor: the worker died, on a _Broken).\nSubmit the job again on a working executor."
    )
    with pytest.raises(dx.HostError, match=re.escape(expected)):
        f(X0)
