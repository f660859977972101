"""The mutation check (.ci/mutations.py) finds where each planted bug goes by the definition
that holds it, wherever that definition now lives, and fails loudly when it cannot."""

import importlib.util
import pathlib
import textwrap

import pytest

PATH = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "mutations.py"
_spec = importlib.util.spec_from_file_location("_mutation_check", PATH)
mutations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutations)

SITE = textwrap.dedent(
    """\
    import jax.numpy as jnp


    def unbatch(spec, diff_cts):
        out = []
        for c, dropped in diff_cts:
            out.append(jnp.sum(c, axis=dropped) if dropped else c)
        return out
    """
)

# the same function after a refactor: moved into a class in another module, below other
# code, and reflowed by a formatter (line breaks, indentation, a trailing comma)
MOVED = textwrap.dedent(
    """\
    import jax.numpy as jnp


    def first():
        return 1


    class Levels:
        def unbatch(self, spec, diff_cts):
            out = []
            for c, dropped in diff_cts:
                out.append(
                    jnp.sum(
                        c,
                        axis=dropped,
                    )
                    if dropped
                    else c
                )
            return out
    """
)

OLD = "out.append(jnp.sum(c, axis=dropped) if dropped else c)"
NEW = "out.append(jnp.take(c, 0, axis=dropped[0]) if dropped else c)"


def test_every_mutation_applies_to_the_code_as_it_is():
    for name, replacements, tests in mutations.MUTATIONS:
        planted, places = mutations.plant(mutations.sources(), replacements)
        assert planted and len(places) == len(replacements), name
        for test in tests:  # a test file, or one test in it named first (`file::test_name`)
            file, _, function = test.partition("::")
            assert (PATH.parent.parent / file).is_file(), (name, test)
            assert not function or f"def {function}(" in (PATH.parent.parent / file).read_text(), (name, test)


def test_a_mutation_follows_its_function_to_another_module_and_a_reflow():
    before, _ = mutations.plant({"_site/_primitive.py": SITE}, [("unbatch", OLD, NEW)])
    after, places = mutations.plant({"_site/_other.py": "x = 1\n", "_levels.py": MOVED}, [("Levels.unbatch", OLD, NEW)])
    assert "jnp.take(c, 0, axis=dropped[0])" in before["_site/_primitive.py"]
    assert list(after) == ["_levels.py"] and places == ["_levels.py:12"]
    assert "            out.append(jnp.take(c, 0, axis=dropped[0]) if dropped else c)\n" in after["_levels.py"]
    assert "jnp.sum" not in after["_levels.py"] and "def first():" in after["_levels.py"]


def test_a_new_snippet_of_several_lines_takes_the_indentation_of_its_place():
    planted, _ = mutations.plant({"m.py": MOVED}, [("Levels.unbatch", "out = []", "out = []\nout.append(0)")])
    assert "        out = []\n        out.append(0)\n" in planted["m.py"]


def test_a_missing_function_fails_naming_similar_names_and_where_the_snippet_is():
    with pytest.raises(
        mutations.Stale,
        match=r"no function, method or class 'unbatch' in src/deferax; similar names: Levels\.unbatch; "
        r"the old snippet is in: Levels\.unbatch \(_levels\.py:12\)\. Point the mutation at",
    ):
        mutations.plant({"_levels.py": MOVED}, [("unbatch", OLD, NEW)])


def test_a_snippet_no_longer_in_its_function_fails_showing_the_closest_lines():
    changed = SITE.replace("if dropped else c", "if len(dropped) else c")
    with pytest.raises(
        mutations.Stale,
        match=r"unbatch \(m\.py:4\) has no 'out\.append\(jnp\.sum\(c, axis=dropped\) if dropped else c\)' "
        r"\(compared ignoring whitespace\); its closest lines: 7: out\.append\(jnp\.sum\(c, axis=dropped\) if "
        r"len\(dropped\) else c\).*Update the mutation's snippets",
    ):
        mutations.plant({"m.py": changed}, [("unbatch", OLD, NEW)])


def test_a_snippet_in_another_function_only_is_not_taken_there():
    with pytest.raises(mutations.Stale, match=r"first \(m\.py:4\) has no .*the old snippet is in: Levels\.unbatch"):
        mutations.plant({"m.py": MOVED}, [("first", OLD, NEW)])


def test_a_snippet_found_twice_in_its_function_fails():
    with pytest.raises(
        mutations.Stale, match=r"unbatch \(m\.py:4\) holds 'dropped' 3 times \(lines 6, 7, 7\)\. Lengthen"
    ):
        mutations.plant({"m.py": SITE}, [("unbatch", "dropped", "d")])


def test_words_are_matched_whole():
    with pytest.raises(mutations.Stale, match="has no 'ropped if'"):
        mutations.plant({"m.py": SITE}, [("unbatch", "ropped if", "x")])


def test_a_name_in_several_modules_is_taken_where_the_snippet_is_or_named_by_module():
    files = {"a.py": SITE, "b/c.py": SITE.replace("jnp.sum", "jnp.mean")}
    planted, _ = mutations.plant(files, [("unbatch", "jnp.mean", "jnp.max")])
    assert list(planted) == ["b/c.py"]
    with pytest.raises(
        mutations.Stale,
        match=r"unbatch is defined in several places that hold 'out = \[\]': a:unbatch \(a\.py:4\), "
        r"b\.c:unbatch \(b/c\.py:4\)\. Write the target as module:qualname",
    ):
        mutations.plant(files, [("unbatch", "out = []", "out = [0]")])
    planted, _ = mutations.plant(files, [("b.c:unbatch", "out = []", "out = [0]")])
    assert list(planted) == ["b/c.py"]


def test_a_planted_copy_that_does_not_compile_fails():
    with pytest.raises(mutations.Stale, match=r"the planted copy of m\.py does not compile .* Fix the new snippet"):
        mutations.plant({"m.py": SITE}, [("unbatch", "return out", "return (out")])


def test_a_mutation_that_changes_nothing_fails():
    with pytest.raises(mutations.Stale, match="the mutation plants nothing"):
        mutations.plant({"m.py": SITE}, [("unbatch", "return out", "return   out")])


def test_the_script_stops_before_any_test_when_a_mutation_is_stale(monkeypatch, capsys):
    monkeypatch.setattr(mutations, "MUTATIONS", [("a stale one", [("nowhere_at_all", "x = 1", "x = 2")], [])])
    assert mutations.main([]) == 1
    out = capsys.readouterr().out
    assert "STALE    a stale one: no function, method or class 'nowhere_at_all'" in out
    assert "mutation check: 1 of 1 mutations no longer describe the code" in out
