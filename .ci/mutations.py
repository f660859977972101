"""Mutation check: plant known bugs in a copy of deferax and make sure the tests catch each.

Each mutation names where its bug goes by the qualified name of a function, method or class
(`_Choice._decide`, `outputs.one` for a function nested in `outputs`), looked up in every
module of the package, so that moving code to another place or file keeps it working; and
what to change there by an old and a new snippet. The old snippet is matched within that
definition's source only, ignoring whitespace (indentation, line breaks, a trailing comma
added before a closing bracket: what a reformat changes), and must match exactly once. A
name defined in several modules is taken where the old snippet is (exactly one must have
it), or is written `module:qualname` (`_site._primitive:outputs.one`). A new snippet of
several lines is written dedented; its lines take the indentation of the line it replaces.

If a name is not found, or its snippet is found never or more than once, or the planted
copy does not compile, the mutation no longer describes the code and the script fails
before running any test, naming the mutation, where it looked and what is closest. For
every mutation, `src/deferax` is copied to a temporary folder, the snippets replaced, and
the relevant test files run against the copy (first on the path). A test named before the
files (`tests/test_basis.py::test_name`) is one known to catch the bug: it runs alone first,
and the listed tests all together only where it does not catch it, so a caught bug costs that
test and not the tests before it in its file. A
mutation that no test catches fails the run. Prints one line per mutation with the number of
failing tests (pytest stops at the first: one is enough) and the test that caught it, two
mutations at a time.

    python .ci/mutations.py               # every mutation
    python .ci/mutations.py --check       # only find where each applies (a second; no tests)
    python .ci/mutations.py --only basis  # the mutations whose name contains "basis"
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import difflib
import functools as ft
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "deferax"

# (name, [(qualified name, old, new), ...], [test files])
MUTATIONS = [
    (
        "a nonlinear site deferred",
        [("_Choice._decide", "if not sources:", "if True:")],
        ["tests/test_deferred.py::test_nonlinear_downstream_is_standard_with_line", "tests/test_deferred.py"],
    ),
    (
        "a replayed cotangent scaled by 1 + 1e-6",
        [
            (
                "_replayed_cotangents",
                "return ct_operands, jtu.tree_map(zero_like, y)",
                "return jtu.tree_map(lambda c: c if c.dtype == jax.dtypes.float0 else c * 1.000001, ct_operands), "
                "jtu.tree_map(zero_like, y)",
            )
        ],
        ["tests/test_deferred.py"],
    ),
    (
        "a dropped basis coefficient",
        [("_frontier_cotangents.combine", "c = c[rows]", "c = c[rows].at[0].set(0)")],
        ["tests/test_basis.py"],
    ),
    (
        "the zero-entry guard of the basis combination removed",
        [
            (
                "_frontier_cotangents.combine",
                "jnp.where(c == 0, jnp.zeros((), c.dtype), coefficients * c)",
                "coefficients * c",
            )
        ],
        ["tests/test_basis.py::test_infinite_slope_gives_inf_where_plain_jax_does", "tests/test_basis.py"],
    ),
    (
        "fwd called twice on the standard schedule",
        [
            (
                "outputs.one",
                "y = spec.fn(fn_leaves).primal(spec.x(x_leaves))",
                "spec.fn(fn_leaves).primal(spec.x(x_leaves))\ny = spec.fn(fn_leaves).primal(spec.x(x_leaves))",
            )
        ],
        ["tests/test_expensive.py::test_execution_counts_standard_schedule", "tests/test_expensive.py"],
    ),
    (
        "Fused.batched running the forward once per cotangent",
        [
            (
                "AbstractFused.batched",
                "y, partials = concurrently(",
                "[self.fwd(x) for _ in range(jtu.tree_leaves(cts)[0].shape[0] - 1)]\ny, partials = concurrently(",
            )
        ],
        ["tests/test_basis.py::test_fuse_batched_runs_forward_once", "tests/test_basis.py"],
    ),
    (
        "a cotangent doubled on both the deferred and the standard path",
        [
            ("cotangents", "return unbatch(spec, out)", "return unbatch(spec, [2 * o for o in out])"),
            (
                "Deferred.call",
                "return y, _site.unbatch(spec, ct_x)",
                "return y, _site.unbatch(spec, [2 * c for c in ct_x])",
            ),
        ],
        ["tests/test_deferred.py", "tests/test_properties.py"],
    ),
    (
        "a forward-basis contraction scaled",
        [
            (
                "_contract",
                "else jnp.tensordot(flat.astype(j.dtype), j, axes=1)",
                "else 2 * jnp.tensordot(flat.astype(j.dtype), j, axes=1)",
            )
        ],
        ["tests/test_forward.py"],
    ),
    (
        "a bwd that reads y taken for one that does not",
        [("_returns_y", 'return any("y" in d for d in _jaxpr.dependencies(closed, labels))', "return False")],
        ["tests/test_concurrent.py::test_bwd_that_reads_y_stays_standard", "tests/test_concurrent.py"],
    ),
    (
        "a bwd that starts reading y, checked beside the forward, run without it",
        [("_unless_it_needs_y", "return NEEDS_Y if check() is not None else run()", "return run()")],
        [
            "tests/test_eager_overhead.py::test_a_bwd_that_reads_y_on_a_later_call_runs_after_the_forward",
            "tests/test_eager_overhead.py",
        ],
    ),
    (
        "a bwd read up front on every call, though the last call read that it does not read y",
        [("analysis_of", "if last is not None and all(b is None for b in last):", "if False:")],
        [
            "tests/test_eager_overhead.py::test_after_a_call_that_read_the_bwd_it_is_read_beside_the_forward",
            "tests/test_eager_overhead.py",
        ],
    ),
    (
        "a site under vmap replayed without summing over unbatched levels",
        [
            (
                "unbatch",
                "out.append(jnp.sum(c, axis=dropped) if dropped else c)",
                "out.append(jnp.take(c, 0, axis=dropped[0]) if dropped else c)",
            )
        ],
        [
            "tests/test_vmap_batches.py::test_fuse_under_vmap_runs_the_batch_once_and_compiles_once",
            "tests/test_equinox_semantics.py",
            "tests/test_vmap_batches.py",
            "tests/test_forward.py",
        ],
    ),
    (
        "a dx.fuse adjoint half left out of the recording",
        [
            (
                "_eager",
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
                "pair",
                "return devices[first], devices[(first + 1) % len(devices)]",
                "return devices[first], devices[first]",
            )
        ],
        ["tests/test_devices.py::test_halves_and_sites_on_different_devices", "tests/test_devices.py"],
    ),
    (
        "an accelerator's halves started from a host callback",
        [("halves_run", 'if where != "cpu":', 'if where == "none":')],
        ["tests/test_placement.py"],
    ),
    (
        "a loop run backwards stepped forwards beside the other",
        [("_one_loop", "xs_g = [lax.rev(x, (0,)) for x in xs_g]", "xs_g = list(xs_g)")],
        [
            "tests/test_placement.py::test_a_loop_run_backwards_is_stepped_with_one_run_forwards",
            "tests/test_placement.py",
        ],
    ),
    (
        "an ExpensiveFn's configuration arrays marked trainable",
        [("trainable", "jtu.tree_map(lambda _: False, node) if isinstance(node, ExpensiveFn) else", "")],
        ["tests/test_training.py"],
    ),
    (
        "a variable on several basis sites' frontiers given only the last site's wrapper",
        [
            (
                "_replacements",
                "wraps[v] = wrap if before is None else (lambda z, wrap=wrap, before=before: wrap(before(z)))",
                "wraps[v] = wrap",
            )
        ],
        ["tests/test_basis.py::test_sites_that_share_a_frontier_variable", "tests/test_basis.py"],
    ),
    (
        "the halves made from fwd + bwd compiled once per function (stale when what they read changes)",
        [("DerivedFused", "compiled: ClassVar[bool] = False", "compiled: ClassVar[bool] = True")],
        [
            "tests/test_concurrent.py::test_halves_made_from_fwd_and_bwd_read_what_they_read_afresh",
            "tests/test_concurrent.py",
        ],
    ),
    (
        "a bwd that calls a host callback taken for one that shares no state with fwd",
        [
            (
                "Spec.why_bwd_blocks_fused",
                "return None if opaque is None else _OPAQUE_BWD.format(location=opaque)",
                "return None",
            )
        ],
        [
            "tests/test_concurrent.py::test_bwd_that_calls_what_deferax_cannot_read_runs_after_fwd",
            "tests/test_concurrent.py",
        ],
    ),
    (
        "an io_callback ahead of the expensive calls run twice (value and gradient from two draws)",
        [
            (
                "_Choice.run",
                "Standard(spec=self.specs[p], position=p, reason=reason) if reason else",
                "Standard(spec=self.specs[p], position=p, reason=reason) if False else",
            )
        ],
        ["tests/test_replay_safety.py"],
    ),
    (
        "the same view of the output computed twice counted twice in k",
        [("analyse", "program = _jaxpr.merge_duplicates(program, keep=(_site.SITE, _site.LINEAR))", "")],
        ["tests/test_basis.py::test_k_counts_independent_numbers_at_most_the_output_size", "tests/test_basis.py"],
    ),
    (
        "a contraction over the examples taken for a per-example frontier",
        [("_dot_general", "if right is None or right in rc:", "if right is None:")],
        [
            "tests/test_vmap_basis.py::test_a_frontier_mixing_the_examples_counts_the_whole_batch",
            "tests/test_vmap_basis.py",
        ],
    ),
    (
        "the per-example coefficients in the order of the examples, not of the rows",
        [("coefficients", "return flat.T", "return jnp.reshape(flat, flat.shape[::-1])")],
        ["tests/test_vmap_basis.py::test_a_complex_frontier_per_example", "tests/test_vmap_basis.py"],
    ),
    (
        "a site's strategy chosen again in stage 3 (from timings newer than its plan)",
        [("_jvp_strategy", "chosen = None if fixed is None else fixed.get(spec)", "chosen = None")],
        ["tests/test_strategy_planned.py"],
    ),
    (
        "OpenBLAS limited through threadpoolctl's setter (which ignores threads that do not control it)",
        [("_setter", 'if controller.internal_api == "openblas" and', "if False and")],
        ["tests/test_threads.py"],
    ),
    (
        "a factorisation past the store's budget kept",
        [("Store.acquire", "if nbytes > self.budget:", "if False:")],
        ["tests/test_memory.py::test_past_the_budget_the_backward_pass_factors_again", "tests/test_memory.py"],
    ),
    (
        "a process pool's workers keep the forward's factorisation",
        [("sparse_solve", 'kept = "none"', 'kept = "worker"')],
        ["tests/test_memory.py::test_a_process_pools_workers_keep_no_factorisation", "tests/test_memory.py"],
    ),
    (
        "the runtime's reset forgetting the stores registered with it (a feature's cache kept across tests)",
        [("reset", "for clear in _CLEARS:", "for clear in []:")],
        ["tests/test_runtime.py"],
    ),
    (
        "a together site's fwd run again in stage 3 (twice a step)",
        [
            (
                "ForwardJob.stage3",
                "return (lambda eqn, ops: replay(",
                "return (lambda eqn, ops: _site.outputs(spec, *ops) and replay(",
            )
        ],
        ["tests/test_backward_together.py"],
    ),
    (
        "basis sites never weighed against the standard sites' jobs at once",
        [("against_basis", "if jointly.at_once >= deferred:", "if True:")],
        [
            "tests/test_backward_together.py::test_basis_sites_go_back_to_standard_when_their_jobs_at_once_cost_less",
            "tests/test_backward_together.py",
        ],
    ),
    (
        "a second-order solve keeps no factorisation for the next ones",
        [("_solve_one", "_pin(key)", "pass")],
        [
            "tests/test_second_order.py::test_a_hessian_vector_product_equals_a_dense_one_with_one_factorisation",
            "tests/test_second_order.py",
        ],
    ),
    (
        "a first derivative differentiated later takes the cotangent's tangent as zero",
        [("_differentiable_cotangents", "(t_x, list(t_cts))", "(t_x, [jnp.zeros_like(c) for c in cts])")],
        [
            "tests/test_second_order.py::test_a_derivative_made_first_and_differentiated_later",
            "tests/test_second_order.py",
        ],
    ),
    (
        "a NaN entry of a system solved inside the program let through by a compiled program",
        [("_checked", "jax.lax.cond(broken, fail,", "jax.lax.cond(False, fail,")],
        [
            "tests/test_sparse_in_program.py::test_a_nan_entry_raises_the_host_s_error_from_inside_the_program",
            "tests/test_sparse_in_program.py",
        ],
    ),
    (
        "KLU tried where the klujax module is splineax's fork",
        [("available", "and _fork() is None", "")],
        [
            "tests/test_sparse_backends.py::test_klu_is_left_out_where_the_klujax_module_is_splineax_s_fork",
            "tests/test_sparse_backends.py",
        ],
    ),
]


class Stale(Exception):
    """A mutation that no longer describes the code; the message says where it looked."""


def sources() -> dict[str, str]:
    """The package's modules' text by path relative to the package (`_site/_primitive.py`)."""
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def module_name(file: str) -> str:
    """`_site/_primitive.py` as `_site._primitive` (a package's `__init__.py` as the package)."""
    parts = file.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@ft.cache
def definitions(text: str) -> dict[str, list[ast.AST]]:
    """Every function, method and class of a module by qualified name (`Outer.inner`)."""
    found: dict[str, list[ast.AST]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found.setdefault(prefix + child.name, []).append(child)
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(text), "")
    return found


def pattern(old: str) -> re.Pattern:
    """`old` as a regular expression blind to whitespace: any amount around punctuation, at
    least some between two words, none inside a word; a comma allowed before a closing bracket."""
    parts = []
    for token in re.findall(r"\w+|\S", old):
        if parts:
            parts.append(r"\s+" if re.match(r"\w", token) and re.search(r"\w$", parts[-1]) else r"\s*")
        parts.append(rf"(?:,\s*)?\{token}" if token in ")]}" else re.escape(token))
    if not parts:
        raise Stale("the old snippet is empty")
    head = r"(?<!\w)" if re.match(r"\w", old.strip()) else ""
    tail = r"(?!\w)" if re.search(r"\w$", old.strip()) else ""
    return re.compile(head + "".join(parts) + tail)


def span(text: str, node: ast.AST) -> tuple[int, int]:
    """Where `node` (decorators and all) lies in `text`, as offsets of whole lines."""
    lines = text.splitlines(keepends=True)
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return sum(map(len, lines[: first - 1])), sum(map(len, lines[: node.end_lineno]))


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def where_else(files: dict[str, str], regex: re.Pattern) -> list[str]:
    """The innermost definitions (and lines) anywhere in the package that hold `regex`."""
    found = []
    for file, text in files.items():
        for match in regex.finditer(text):
            line = line_of(text, match.start())
            names = [
                (node.lineno, name)
                for name, nodes in definitions(text).items()
                for node in nodes
                if node.lineno <= line <= node.end_lineno
            ]
            found.append(f"{max(names)[1] if names else '<module>'} ({file}:{line})")
    return found


def closest(text: str, start: int, end: int, old: str) -> list[str]:
    """The lines of `text[start:end]` most like `old` (their comments aside), with their numbers."""
    first = line_of(text, start)
    lines = {
        f"{first + i}: {line.strip()}": re.sub(r"\s+#.*", "", line.strip())
        for i, line in enumerate(text[start:end].splitlines())
    }
    wanted = " ".join(old.split())
    scored = sorted(lines, key=lambda key: -difflib.SequenceMatcher(None, lines[key], wanted).ratio())
    return scored[:3]


def locate(files: dict[str, str], target: str, old: str) -> tuple[str, int, int]:
    """The file and offsets of the one match of `old` within the definition `target`."""
    module, _, qualname = target.rpartition(":")
    regex = pattern(old)
    candidates = [
        (file, node)
        for file, text in files.items()
        if not module or module_name(file) == module
        for node in definitions(text).get(qualname, [])
    ]
    if not candidates:
        names = {name for text in files.values() for name in definitions(text)}
        near = difflib.get_close_matches(qualname, names, n=3, cutoff=0.6)
        holders = where_else(files, regex)
        raise Stale(
            f"no function, method or class {target!r} in src/deferax"
            + (f"; similar names: {', '.join(near)}" if near else "")
            + (f"; the old snippet is in: {'; '.join(holders)}" if holders else "; the old snippet is nowhere")
            + ". Point the mutation at the definition that holds the code it breaks."
        )
    hits = []
    for file, node in candidates:
        start, end = span(files[file], node)
        hits.append((file, node, start, end, list(regex.finditer(files[file], start, end))))
    found = [hit for hit in hits if hit[4]]
    places = ", ".join(f"{file}:{node.lineno}" for file, node, *_ in hits)
    if not found:
        file, _, start, end, _ = hits[0]
        holders = where_else(files, regex)
        raise Stale(
            f"{target} ({places}) has no {old!r} (compared ignoring whitespace)"
            + (f"; its closest lines: {' | '.join(closest(files[file], start, end, old))}" if len(hits) == 1 else "")
            + (f"; the old snippet is in: {'; '.join(holders)}" if holders else "")
            + ". Update the mutation's snippets (or its target) to what the code now says, keeping the planted bug."
        )
    if len(found) > 1:
        raise Stale(
            f"{target} is defined in several places that hold {old!r}: "
            f"{', '.join(f'{module_name(file)}:{target} ({file}:{node.lineno})' for file, node, *_ in found)}. "
            "Write the target as module:qualname."
        )
    file, node, _, _, matches = found[0]
    if len(matches) > 1:
        lines = ", ".join(str(line_of(files[file], m.start())) for m in matches)
        raise Stale(
            f"{target} ({file}:{node.lineno}) holds {old!r} {len(matches)} times (lines {lines}). "
            "Lengthen the old snippet (or target the nested function) so it names one place."
        )
    return file, matches[0].start(), matches[0].end()


def plant(files: dict[str, str], replacements) -> tuple[dict[str, str], list[str]]:
    """The modules changed by `replacements` (each applied where `locate` finds it, in turn),
    and where each went (`file:line`)."""
    files, changed, places = dict(files), set(), []
    for target, old, new in replacements:
        file, start, end = locate(files, target, old)
        text = files[file]
        line_start = text.rfind("\n", 0, start) + 1
        indent = re.match(r"[ \t]*", text[line_start:]).group()
        files[file] = text[:start] + new.replace("\n", "\n" + indent) + text[end:]
        if new.strip() and pattern(new).fullmatch(text[start:end]):
            raise Stale(f"{target}: the new snippet {new!r} is the old one: the mutation plants nothing")
        changed.add(file)
        places.append(f"{file}:{line_of(text, start)}")
    for file in changed:
        try:
            compile(files[file], file, "exec")
        except SyntaxError as error:
            raise Stale(
                f"the planted copy of {file} does not compile ({error.msg}, line {error.lineno}: "
                f"{(error.text or '').strip()!r}); a test failing on that would not show the bug caught. "
                "Fix the new snippet."
            ) from None
    return {file: files[file] for file in changed}, places


def run(planted: dict[str, str], tests) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "src"
        shutil.copytree(PACKAGE, src / "deferax", ignore=shutil.ignore_patterns("__pycache__"))
        for file, text in planted.items():
            (src / "deferax" / file).write_text(text)
        env = {
            **os.environ,
            "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "DEFERAX_MUTATION_CHECK": "1",
        }
        # (where `import deferax` would load it from, found without importing JAX: a second a mutation)
        probe = subprocess.run(
            [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('deferax').origin)"],
            env=env,
            capture_output=True,
            text=True,
        )
        if not probe.stdout.startswith(str(src)):
            return False, f"the mutated copy is not the one imported: {probe.stdout.strip()} {probe.stderr.strip()}"
        # The test known to catch the bug alone first (a second each, where the whole file
        # would run until it reaches it), then, if it does not, all of them.
        for chosen in [tests[:1], tests] if len(tests) > 1 else [tests]:
            out = subprocess.run(
                # -x: the first failing test is enough to call the bug caught
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *chosen],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-300:]
            failed = re.search(r"(\d+) failed", tail)
            caught = out.returncode == 1 and failed is not None
            if caught:
                break
        first = re.search(r"^FAILED (\S+)", out.stdout, re.MULTILINE)
        by = f" by {first.group(1)}" if first else ""
        return caught, f"{failed.group(1) if failed else 0} failing{by} ({tail})"


def timed(job) -> tuple[bool, str, float]:
    t0 = time.perf_counter()
    return *run(*job), time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="TEXT", help="mutations whose name has TEXT")
    parser.add_argument("--check", action="store_true", help="only find where each mutation applies; run no test")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(o.lower() in m[0].lower() for o in args.only)]
    if not chosen:
        print(f"mutation check: no mutation's name contains any of {args.only}", file=sys.stderr)
        return 2
    files, jobs, stale = sources(), [], []
    # every mutation is placed before any test runs: one that no longer describes the code fails at once
    for name, replacements, tests in chosen:
        try:
            planted, places = plant(files, replacements)
        except Stale as error:
            stale.append(name)
            print(f"STALE    {name}: {error}", flush=True)
            continue
        jobs.append((name, places, (planted, tests)))
    if stale:
        print(
            f"mutation check: {len(stale)} of {len(chosen)} mutations no longer describe the code "
            "(fix them in .ci/mutations.py, see above)"
        )
        return 1
    if args.check:
        for name, places, _ in jobs:
            print(f"applies  {name}: {', '.join(places)}")
        print(f"mutation check: all {len(jobs)} mutations apply (no tests run)")
        return 0
    survived = 0
    # two mutations at a time (each its own copy and pytest process), printed in order
    with cf.ThreadPoolExecutor(2) as pool:
        for (name, _, _), (caught, detail, seconds) in zip(jobs, pool.map(timed, [j[2] for j in jobs]), strict=True):
            survived += not caught
            print(f"{'caught  ' if caught else 'SURVIVED'} {name}: {detail} [{seconds:.0f} s]", flush=True)
    print(f"mutation check: {len(jobs) - survived} of {len(jobs)} planted bugs caught")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
