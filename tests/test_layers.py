"""The layers of docs/design.md read true: a module of the package imports only modules of
its own layer or of a layer further down the table, never one higher up (read from the
modules' import statements, nothing run)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "deferax"


def layers() -> list[tuple[str, set[str]]]:
    """The table's rows, top first: (layer, the package paths its "where" names: a folder as
    `_site`, a top-level file as `_record.py`)."""
    rows = []
    in_table = False
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        if line.startswith("| layer | where |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if not in_table or line.startswith("| ---"):
            continue
        layer, where = (cell.strip() for cell in line.strip("|").split("|")[:2])
        places, in_folder = set(), False
        for name in re.findall(r"`([^`]+)`", where):
            if "/" in name:
                places.add(name.split("/")[0])
                in_folder = True  # (the files after it are that folder's)
            elif not in_folder:
                places.add(name)  # a top-level file
        rows.append((layer, places))
    return rows


def place_of(module: pathlib.Path) -> str:
    """`_site` for `_site/_spec.py`, `_record.py` for `_record.py`."""
    return module.relative_to(PACKAGE).parts[0]


def imported(module: pathlib.Path) -> set[str]:
    """The package places that `module` imports (relative imports resolved)."""
    package = module.relative_to(PACKAGE).parent.parts  # () for a top-level module
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = list(package[: len(package) - (node.level - 1)])
        names = (node.module.split(".") if node.module else []) or [alias.name for alias in node.names]
        for name in [names[0]] if node.module else names:
            target = [*base, name] if not base else base
            head = target[0]
            found.add(head if (PACKAGE / head).is_dir() else f"{head}.py")
    return found


def test_the_layer_table_names_the_families_it_orders():
    places = [p for _, ps in layers() for p in ps]
    for place in ("_site", "_implementation", "_stages", "_analysis", "_plan", "_jaxpr", "_recognise", "_transform.py"):
        assert place in places, (place, places)
    assert "_forward_basis" not in places and not (PACKAGE / "_forward_basis").exists()


def test_no_import_runs_up_the_layers():
    row = {place: i for i, (_, places) in enumerate(layers()) for place in places}
    upward = []
    for module in sorted(PACKAGE.rglob("*.py")):
        source = place_of(module)
        if source not in row:
            continue  # (a family the table does not order)
        for target in imported(module) - {source}:
            if target in row and row[target] < row[source]:
                upward.append(f"{module.relative_to(PACKAGE)} imports {target}")
    assert upward == []


def module_imports() -> dict[str, set[str]]:
    """Each module of the package (`deferax._site._spec`; a package by its own name) and the
    package modules it imports, anywhere in it (a function's import too), relative imports
    resolved to the module named where there is one, else to the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            for alias in node.names:
                module = f"{target}.{alias.name}"
                found.add(module if module in modules else target)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_circle():
    """No module reaches itself through the imports of the package's modules (a circle holds a
    module that cannot be read, or loaded, without the others)."""
    graph = module_imports()
    circles = []
    for start in sorted(graph):
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module == start:
                circles.append(start)
                break
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
    assert circles == []


def test_the_together_group_lives_in_its_own_file():
    """The together sites are one group (`_schedules/_together.py`): the public transform and
    the three stages' interpreters (stage 2's runner among them) name none of it, and stage 2
    runs declared jobs (`AbstractJob`)."""
    run = PACKAGE / "_stages" / "_run.py"
    tree = ast.parse(run.read_text())
    stages = {"stage1", "_on_host", "_Stage2", "by_position", "stage2", "_replacements", "stage3"}
    parts = {
        f"_stages/_run.py `{n.name}`": ast.get_source_segment(run.read_text(), n)
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in stages
    }
    assert set(name.split("`")[1] for name in parts) == stages
    parts["_transform.py"] = (PACKAGE / "_transform.py").read_text()
    for path, code in parts.items():
        found = [w for w in ('"together"', "BackwardJob", "JointBackward", "_together", ".together") if w in code]
        assert found == [], f"{path} names {found}: the together group's code belongs in _schedules/_together.py"
    assert "AbstractJob" in parts["_stages/_run.py `stage2`"]


def test_no_isinstance_test_of_a_schedule_or_job_class_outside_the_schedules():
    """What a site's schedule is (how its derivative is obtained) and where its jobs run are
    asked of the schedule and its jobs, not found by testing their classes: no `isinstance`
    of a class of `_schedules/` anywhere else in the package."""
    classes = {
        node.name
        for path in (PACKAGE / "_schedules").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert {"Standard", "Deferred", "DeferredBasis", "ForwardBasis", "ForwardJob", "BackwardJob"} <= classes
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "_schedules":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if named & classes:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == [], f"isinstance tests of schedule or job classes at {found}"


def test_the_schedules_are_the_four_ways_to_a_derivative():
    """`AbstractSchedule`'s final classes are the plan's four labels, one each; a standard
    site run ahead of the value is `Standard` with its `runs`, and its jobs are jobs."""
    import typing

    from deferax._plan._plan import Schedule
    from deferax._schedules import _deferred, _deferred_basis, _jobs, _standard
    from deferax._schedules._abstract import AbstractAhead, AbstractJob, AbstractSchedule

    del _deferred, _deferred_basis, _standard  # (imported: their classes defined)

    def finals(cls):
        subs = cls.__subclasses__()
        return {c for s in subs for c in finals(s)} | {s for s in subs if not s.__subclasses__()}

    labels = sorted(c.label for c in finals(AbstractSchedule))
    assert labels == sorted(typing.get_args(Schedule))
    assert not issubclass(_jobs.ForwardJob, AbstractSchedule) and issubclass(_jobs.ForwardJob, AbstractAhead)
    assert not issubclass(_jobs.BackwardJob, AbstractSchedule) and issubclass(_jobs.BackwardJob, AbstractJob)
