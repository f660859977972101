"""Mutation check: plant known bugs in a copy of deferax and make sure the tests catch each.

For every mutation, `src/deferax` is copied to a temporary folder, one or more text
replacements are applied (each must match, or the mutation no longer describes the code and
this script fails), and the relevant test files run against the copy (first on the path).
A mutation that no test catches fails the run. Prints one line per mutation with the
number of failing tests (pytest stops at the first: one is enough), two mutations at a time.

    python .ci/mutations.py
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (name, [(file, old, new), ...], [test files])
MUTATIONS = [
    (
        "a nonlinear site deferred",
        [
            (
                "_analysis/_analysis.py",
                "        if not sources:  #",
                "        if True:  #",
            )
        ],
        ["tests/test_deferred.py"],
    ),
    (
        "a replayed cotangent scaled by 1 + 1e-6",
        [
            (
                "_stages/_stage3.py",
                "    return ct_operands, jtu.tree_map(zero_like, y)",
                "    return jtu.tree_map(lambda c: c if c.dtype == jax.dtypes.float0 else c * 1.000001, ct_operands), "
                "jtu.tree_map(zero_like, y)",
            )
        ],
        ["tests/test_deferred.py"],
    ),
    (
        "a dropped basis coefficient",
        [("_stages/_stage3.py", "        c = c[rows]\n", "        c = c[rows].at[0].set(0)\n")],
        ["tests/test_basis.py"],
    ),
    (
        "the zero-entry guard of the basis combination removed",
        [("_stages/_stage3.py", "jnp.where(c == 0, jnp.zeros((), c.dtype), coefficients * c)", "coefficients * c")],
        ["tests/test_basis.py"],
    ),
    (
        "fwd called twice on the standard schedule",
        [
            (
                "_site/_primitive.py",
                "        y = spec.fn(fn_leaves).primal(spec.x(x_leaves))\n",
                "        spec.fn(fn_leaves).primal(spec.x(x_leaves))\n        y = \
spec.fn(fn_leaves).primal(spec.x(x_leaves))\n",
            )
        ],
        ["tests/test_expensive.py"],
    ),
    (
        "Fused.batched running the forward once per cotangent",
        [
            (
                "_implementation/_abstract.py",
                "        y, partials = concurrently(",
                "        [self.fwd(x) for _ in range(jtu.tree_leaves(cts)[0].shape[0] - 1)]\n"
                "        y, partials = concurrently(",
            )
        ],
        ["tests/test_basis.py"],
    ),
    (
        "a cotangent doubled on both the deferred and the standard path",
        [
            ("_site/_primitive.py", "    return unbatch(spec, out)", "    return unbatch(spec, [2 * o for o in out])"),
            (
                "_stages/_stage2.py",
                "    return y, _site.unbatch(spec, ct_x)",
                "    return y, _site.unbatch(spec, [2 * c for c in ct_x])",
            ),
        ],
        ["tests/test_deferred.py", "tests/test_properties.py"],
    ),
    (
        "a forward-basis contraction scaled",
        [
            (
                "_forward_basis/_primitive.py",
                "else jnp.tensordot(flat.astype(j.dtype), j, axes=1)",
                "else 2 * jnp.tensordot(flat.astype(j.dtype), j, axes=1)",
            )
        ],
        ["tests/test_forward.py"],
    ),
    (
        "a bwd that reads y taken for one that does not",
        [
            (
                "_analysis/_bwd.py",
                '    return any("y" in d for d in _jaxpr.dependencies(closed, labels))',
                "    return False",
            )
        ],
        ["tests/test_concurrent.py"],
    ),
    (
        "a site under vmap replayed without summing over unbatched levels",
        [
            (
                "_site/_primitive.py",
                "        out.append(jnp.sum(c, axis=dropped) if dropped else c)",
                "        out.append(jnp.take(c, 0, axis=dropped[0]) if dropped else c)",
            )
        ],
        ["tests/test_equinox_semantics.py", "tests/test_vmap_batches.py", "tests/test_forward.py"],
    ),
    (
        "a dx.fuse adjoint half left out of the recording",
        [
            (
                "_concurrency/_threads.py",
                "ft.partial(_timed_eager, halves.names[1], adjoint_device, home, call_adjoint)",
                "ft.partial(_ready, call_adjoint)",
            )
        ],
        ["tests/test_record.py"],
    ),
    (
        "the adjoint placed on the forward's device",
        [
            (
                "_concurrency/_devices.py",
                "    return devices[first], devices[(first + 1) % len(devices)]",
                "    return devices[first], devices[first]",
            )
        ],
        ["tests/test_devices.py"],
    ),
    (
        "an ExpensiveFn's configuration arrays marked trainable",
        [
            (
                "_implementation/_expensive.py",
                "jtu.tree_map(lambda _: False, node) if isinstance(node, ExpensiveFn) else ",
                "",
            )
        ],
        ["tests/test_training.py"],
    ),
    (
        "a variable on several basis sites' frontiers given only the last site's wrapper",
        [
            (
                "_stages/_stage3.py",
                "wraps[v] = wrap if before is None else (lambda z, wrap=wrap, before=before: wrap(before(z)))",
                "wraps[v] = wrap",
            )
        ],
        ["tests/test_basis.py"],
    ),
    (
        "the halves made from fwd + bwd compiled once per function (stale when what they read changes)",
        [
            (
                "_implementation/_derived.py",
                "    compiled: ClassVar[bool] = False",
                "    compiled: ClassVar[bool] = True",
            )
        ],
        ["tests/test_concurrent.py"],
    ),
    (
        "a bwd that calls a host callback taken for one that shares no state with fwd",
        [
            (
                "_analysis/_bwd.py",
                "    return None if opaque is None else _OPAQUE_BWD.format(location=opaque)",
                "    return None",
            )
        ],
        ["tests/test_concurrent.py"],
    ),
    (
        "an io_callback ahead of the expensive calls run twice (value and gradient from two draws)",
        [
            (
                "_analysis/_analysis.py",
                'Decision("standard", once[k]) if once[k] else',
                'Decision("standard", once[k]) if False else',
            )
        ],
        ["tests/test_replay_safety.py"],
    ),
    (
        "the same view of the output computed twice counted twice in k",
        [
            (
                "_analysis/_analysis.py",
                "    program = _jaxpr.merge_duplicates(program, keep=(_site.SITE, _site.LINEAR))\n",
                "",
            )
        ],
        ["tests/test_basis.py"],
    ),
    (
        "OpenBLAS limited through threadpoolctl's setter (which ignores threads that do not control it)",
        [("_concurrency/_native_threads.py", 'if controller.internal_api == "openblas" and', "if False and")],
        ["tests/test_threads.py"],
    ),
]


def run(name, replacements, tests) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "src"
        shutil.copytree(ROOT / "src" / "deferax", src / "deferax", ignore=shutil.ignore_patterns("__pycache__"))
        for file, old, new in replacements:
            path = src / "deferax" / file
            text = path.read_text()
            if old not in text:
                return False, f"the mutation no longer applies: {file} has no {old!r}"
            path.write_text(text.replace(old, new, 1))
        env = {
            **os.environ,
            "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "DEFERAX_MUTATION_CHECK": "1",
        }
        probe = subprocess.run(
            [sys.executable, "-c", "import deferax; print(deferax.__file__)"], env=env, capture_output=True, text=True
        )
        if not probe.stdout.startswith(str(src)):
            return False, f"the mutated copy is not the one imported: {probe.stdout.strip()} {probe.stderr.strip()}"
        out = subprocess.run(
            # -x: the first failing test is enough to call the bug caught
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *tests],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-300:]
        failed = re.search(r"(\d+) failed", tail)
        return out.returncode == 1 and failed is not None, f"{failed.group(1) if failed else 0} failing ({tail})"


def timed(mutation) -> tuple[bool, str, float]:
    t0 = time.perf_counter()
    return *run(*mutation), time.perf_counter() - t0


def main() -> int:
    survived = 0
    # two mutations at a time (each its own copy and pytest process), printed in order
    with cf.ThreadPoolExecutor(2) as pool:
        for (name, _, _), (caught, detail, seconds) in zip(MUTATIONS, pool.map(timed, MUTATIONS), strict=True):
            survived += not caught
            print(f"{'caught  ' if caught else 'SURVIVED'} {name}: {detail} [{seconds:.0f} s]", flush=True)
    print(f"mutation check: {len(MUTATIONS) - survived} of {len(MUTATIONS)} planted bugs caught")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
