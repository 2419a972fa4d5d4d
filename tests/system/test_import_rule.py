"""The layering rule: `core` imports no project package, `index` only `core`, `training` and
`serving` `core` and `index` and never each other, `protos` is imported by `serving` alone (read
from the source: `test_each_package_imports_only_the_layers_below_it`); and `index` and
`serving` import without torch, so a serving image has none; and no package's modules import
each other in a circle, function-level imports included (`test_no_package_has_an_import_circle`);
and no module of the product's code imports another module's private name
(`test_no_module_imports_another_modules_private_name`).

Each check runs in a fresh interpreter (this test process may already have torch loaded). Every
module under core/, index/ and serving/ is found with pkgutil, so modules added later are covered
too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NAMED = [
    "core",
    "core.artifacts.layout",
    "core.data.catalog",
    "core.cli",
    "core.config",
    "core.data.items",
    "core.retrieval.metrics",
    "core.data.preprocess",
    "core.progress",
    "core.registry",
    "core.retrieval.vectors",
    "index",
    "index.build.build",
    "index.embedder",
    "index.search.faiss_index",
    "core.artifacts.layout",
    "core.data.catalog",
    "core.data.preprocess",
    "core.retrieval.metrics",
    "core.data.items",
    "core.config",
    "core.cli",
]

IMPORT_ALL = """
import importlib, json, pkgutil, sys
from pathlib import Path

BLOCK = {block!r}
if BLOCK:
    class NoTorch:
        # Acts as if torch were not installed at all.
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "torchvision"):
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, NoTorch())

imported = []
for name in {named!r}:
    importlib.import_module(name)
    imported.append(name)
packages = {packages!r}
for package in packages:
    module = importlib.import_module(package)
    imported.append(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
torch_importable = None
if BLOCK:
    try:  # the blocker really hides torch (so the blocked run is not vacuous)
        import torch  # noqa: F401
        torch_importable = True
    except ModuleNotFoundError:
        torch_importable = False
print(json.dumps({{"imported": imported, "heavy": heavy, "torch_importable": torch_importable}}))
"""


TORCH = ("torch", "torchvision")


def run_imports(
    block_torch: bool,
    named: list[str] = NAMED,
    packages: tuple[str, ...] = ("core", "index", "serving"),
    forbidden: tuple[str, ...] = TORCH,
) -> dict:
    code = textwrap.dedent(
        IMPORT_ALL.format(block=block_torch, named=named, packages=list(packages), forbidden=forbidden)
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_modules(packages: tuple[str, ...] = ("core", "index", "serving")) -> set[str]:
    found = set()
    for package in packages:
        found.add(package)
        for path in (REPO / package).rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if all((REPO.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
                found.add(".".join(parts))
    return found


def test_index_and_serving_import_without_loading_torch():
    result = run_imports(block_torch=False)
    assert result["heavy"] == []
    imported = set(result["imported"])
    assert set(NAMED) <= imported
    assert expected_modules() <= imported  # every module file was actually imported


def test_index_and_serving_import_when_torch_is_not_installed():
    result = run_imports(block_torch=True)
    assert result["torch_importable"] is False
    assert result["heavy"] == []
    assert expected_modules() <= set(result["imported"])


def test_core_imports_nothing_above_it_and_no_torch():
    core_named = [name for name in NAMED if name.split(".")[0] == "core"]
    result = run_imports(
        block_torch=True, named=core_named, packages=("core",), forbidden=(*TORCH, "training", "index", "serving")
    )
    assert result["heavy"] == []
    assert expected_modules(("core",)) <= set(result["imported"])


# -- the package rule, read from the source -------------------------------------------------------

PACKAGES = ("core", "index", "training", "serving", "protos", "simsearch")
# Which project packages each may import: core at the bottom, index over it, training and serving
# each over index and never each other, the generated protos for serving alone. `simsearch`, the
# one command over them all, imports none: it names the package a command runs in and imports
# that one when the command runs (`test_the_simsearch_command_loads_only_the_package_it_runs`);
# and no package imports it.
ALLOWED = {
    "core": set(),
    "index": {"core"},
    "training": {"core", "index"},
    "serving": {"core", "index", "protos"},
    "protos": {"protos"},
    "simsearch": set(),
}


def project_imports(path: Path, package: str) -> set[tuple[str, int]]:
    """(other project package, line) of every absolute import in a file, at module level or inside
    a function (a relative import stays inside its own package)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found |= {(name.split(".")[0], node.lineno) for name in names}
    return {(top, line) for top, line in found if top in PACKAGES and top != package}


def test_each_package_imports_only_the_layers_below_it():
    edges = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for imported, line in project_imports(path, package):
                edges.setdefault((package, imported), []).append(f"{path.relative_to(REPO)}:{line}")
    wrong = {edge: where for edge, where in edges.items() if edge[1] not in ALLOWED[edge[0]]}
    assert not wrong, "\n".join(f"{a} imports {b}: {', '.join(where[:3])}" for (a, b), where in sorted(wrong.items()))
    # The rule is not vacuous: the edges it allows are there.
    assert {("index", "core"), ("training", "index"), ("serving", "index"), ("serving", "protos")} <= set(edges)


LOADED_BY = """
import json, sys
from simsearch.cli import main
try:
    main({argv!r})
except SystemExit:  # --help
    pass
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & {{"training", "serving", "torch"}})))
"""


def test_the_simsearch_command_loads_only_the_package_it_runs():
    """`simsearch serve` imports serving, never training or torch; `simsearch train` training (and
    torch), never serving; `simsearch index` neither: the command over every package keeps them apart."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(REPO)}
    loaded = {}
    for argv in (["serve", "--help"], ["train", "--help"], ["index", "list", "--help"]):
        code = LOADED_BY.format(argv=argv)
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        loaded[argv[0]] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == {"serve": ["serving"], "train": ["torch", "training"], "index": []}


# -- circles inside a package, read from the source -----------------------------------------------


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Module name → file of every module of `package` under `root` (subpackages included)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if all((root.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            found[".".join(parts)] = path
    return found


def module_imports(name: str, path: Path, modules: set[str]) -> dict[str, int]:
    """The modules of `modules` that module `name` imports, each with the line of its first
    import: module level or inside a function, relative imports resolved, `from pkg import sub`
    taken as sub (the submodule, not pkg's __init__)."""
    import ast

    def known(dotted: str) -> str | None:  # the longest prefix that is a module
        parts = dotted.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [known(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else known(base) for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target is not None and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_cycles(root: Path, package: str) -> list[str]:
    """Each circle of imports among `package`'s modules, as "a imports b (file:line) imports a
    (file:line)"; a circle is reported and one of its edges set aside until none is left, so
    every separate circle is named."""
    from graphlib import CycleError, TopologicalSorter

    files = module_files(root, package)
    graph = {name: module_imports(name, path, set(files)) for name, path in files.items()}
    cycles = []
    while True:
        try:
            tuple(TopologicalSorter({name: list(imported) for name, imported in graph.items()}).static_order())
            return cycles
        except CycleError as exc:
            # Each node of graphlib's list is imported by the next one: reversed, it reads as "imports";
            # started at its first module by name, so a circle is told the same way every run.
            ring = list(reversed(exc.args[1]))[:-1]
            start = ring.index(min(ring))
            cycle = ring[start:] + ring[: start + 1]
        steps = [cycle[0]]
        for importer, imported in zip(cycle, cycle[1:], strict=False):
            where = f"{files[importer].relative_to(root)}:{graph[importer][imported]}"
            steps.append(f"imports {imported} ({where})")
        cycles.append(" ".join(steps))
        del graph[cycle[0]][cycle[1]]


def test_no_package_has_an_import_circle():
    # A function-level import hides a circle from the interpreter, not from the reader: either
    # module can only be understood with the other, so the shared part belongs in a third.
    cycles = [cycle for package in PACKAGES for cycle in import_cycles(REPO, package)]
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_an_import_circle_is_found_however_it_is_written(tmp_path):
    """Not vacuous: a circle through a function-level, a relative and a `from pkg import sub`
    import is found, and a package whose __init__ imports its submodules is not a circle."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg import a\nfrom . import b\n")
    (package / "a.py").write_text("import json\n\n\ndef f():\n    from pkg.sub import c\n")
    (package / "b.py").write_text("from .a import f\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from .. import b\n")
    assert import_cycles(tmp_path, "pkg") == [
        "pkg.a imports pkg.sub.c (pkg/a.py:5) imports pkg.b (pkg/sub/c.py:1) imports pkg.a (pkg/b.py:1)"
    ]
    (package / "b.py").write_text("import pkg.sub.c\n")
    assert import_cycles(tmp_path, "pkg") == ["pkg.b imports pkg.sub.c (pkg/b.py:1) imports pkg.b (pkg/sub/c.py:1)"]
    # No circle: __init__ imports its submodules, which import each other by `from pkg import a`
    # (the submodule a, not the __init__ that imports them).
    (package / "a.py").write_text("import json\n")
    (package / "b.py").write_text("from pkg import a\n")
    (package / "sub" / "c.py").write_text("from ..a import json\n")
    assert import_cycles(tmp_path, "pkg") == []


# -- private names stay private, read from the source ---------------------------------------------

# The code the private-name rule covers: the product's packages, its benchmarks and scripts.
PRODUCT_CODE = ("core", "index", "serving", "training", "simsearch", "benchmarks", "scripts")


def is_private(name: str) -> bool:
    """One leading underscore and not a dunder: `_name`, not `__version__`."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(root: Path, folder: str) -> list[str]:
    """Each `from x import _name` in the files under `root`/`folder`, as "file:line: from x import
    _name", in file and line order: at module level or inside a function, relative or absolute,
    whatever x is (a project module or not)."""
    import ast

    found = []
    for path in sorted((root / folder).rglob("*.py")):
        imports = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                imports += [(node.lineno, module, alias.name) for alias in node.names if is_private(alias.name)]
        found += [
            f"{path.relative_to(root)}:{line}: from {module} import {name}" for line, module, name in sorted(imports)
        ]
    return found


def test_no_module_imports_another_modules_private_name():
    """A name with one leading underscore is its module's own: another module that imports it
    (`from x import _name`) depends on what its owner may change without notice — the name shared
    is made public, or moved where both read it. Covers core, index, serving, training, simsearch,
    benchmarks and scripts. Tests under tests/ are exempt: a test may reach into a module's internals to check
    them."""
    assert all(any((REPO / folder).rglob("*.py")) for folder in PRODUCT_CODE)  # not vacuous
    found = [where for folder in PRODUCT_CODE for where in private_imports(REPO, folder)]
    assert not found, "another module's private name imported:\n" + "\n".join(found)


def test_a_private_import_is_found_however_it_is_written(tmp_path):
    """Not vacuous: an absolute, a relative and a function-level import of a private name are
    found (the alias does not hide it); a dunder, a public name and `import x` are not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from __future__ import annotations\n\n__version__ = '1'\n")
    (package / "a.py").write_text(
        "import os\nfrom pkg.b import _helper, public\n\n\ndef f():\n    from .b import _other as other\n"
    )
    (package / "b.py").write_text("import pkg._c\nfrom pkg import __version__\nfrom os import name_, path\n")
    assert private_imports(tmp_path, "pkg") == [
        "pkg/a.py:2: from pkg.b import _helper",
        "pkg/a.py:6: from .b import _other",
    ]


# -- rooms: which room of a package may import which, read from the source --------------------

# A room is a folder of a package (`serving/search/`) or one module of its top folder
# (`serving/errors.py`); docs/architecture.md's map names each. Inside a package a module may
# import its own room and the rooms listed for it here, nothing else, so the rooms stack from
# the bottom up; a command's entry point (`__main__`, "*") may import any room of its package.
# Between packages the package rule above holds. Listed bottom first.
_SERVING_LEAVES = {"serving.errors", "serving.logs", "serving.memory"}
_SERVING_ROOMS = {"serving.telemetry", "serving.search", "serving.monitoring", "serving.shards", "serving.api"}
_SERVING_APP = {"serving.config", "serving.listen", "serving.server", "serving.workers"}
ROOMS: dict[str, set[str]] = {
    # core: leaves at its top (registry, config, progress, memory), then its rooms, then the CLI's behaviour
    "core": set(),
    "core.data": {"core"},
    "core.artifacts": {"core", "core.data"},
    "core.retrieval": {"core"},
    "core.cli": {"core", "core.data", "core.artifacts"},
    "index": set(),  # the package's __init__
    "index.embedder": set(),
    "index.search": set(),
    "index.versions": {"index.search"},
    "index.build": {"index.embedder", "index.search", "index.versions"},
    "index.changes": {"index.embedder", "index.search", "index.versions", "index.build"},
    "index.__main__": {"*"},
    "serving": set(),
    "serving.errors": set(),
    "serving.logs": set(),
    "serving.memory": set(),
    "serving.client": set(),
    "serving.telemetry": _SERVING_LEAVES,
    "serving.search": _SERVING_LEAVES | {"serving.telemetry"},
    "serving.monitoring": _SERVING_LEAVES | {"serving.telemetry", "serving.search"},
    "serving.shards": _SERVING_LEAVES | {"serving.telemetry", "serving.search", "serving.monitoring"},
    "serving.api": _SERVING_LEAVES | {"serving.telemetry", "serving.search", "serving.monitoring"},
    "serving.transport": _SERVING_LEAVES | {"serving.telemetry", "serving.search", "serving.api"},
    # the app: its options, where it listens, the server that wires every room above
    "serving.config": _SERVING_LEAVES | _SERVING_ROOMS,
    "serving.listen": _SERVING_LEAVES | _SERVING_ROOMS | {"serving.transport", "serving.config"},
    "serving.server": _SERVING_LEAVES | _SERVING_ROOMS | {"serving.transport", "serving.config", "serving.listen"},
    # a server of several processes: the supervisor over the server each worker runs
    "serving.workers": _SERVING_LEAVES | _SERVING_ROOMS | {"serving.config", "serving.listen", "serving.server"},
    "serving.ray_serve": _SERVING_LEAVES | _SERVING_ROOMS | _SERVING_APP | {"serving.transport"},
    "serving.__main__": {"*"},
    "training": set(),
    "training.losses": set(),
    "training.models": set(),
    "training.data": {"training.models"},
    "training.runs": {"training.losses", "training.models", "training.data"},
    "training.text": {"training.losses", "training.models", "training.data", "training.runs"},
    "training.export": {"training.models", "training.data", "training.runs", "training.text"},
    "training.__main__": {"*"},
}


def room_of(module: str, rooms: dict[str, set[str]] = ROOMS) -> str | None:
    """The room holding `module`: the longest room name that is the module or a package above it."""
    found = [room for room in rooms if module == room or module.startswith(room + ".")]
    return max(found, key=len, default=None)


def room_edges(root: Path, packages: tuple[str, ...], rooms: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """(modules in no room, imports a room may not make as "a (file:line) imports b"), over every
    module of `packages` under `root`, function-level imports included."""
    homeless, wrong = [], []
    for package in packages:
        files = module_files(root, package)
        for name, path in files.items():
            here = room_of(name, rooms)
            if here is None:
                homeless.append(name)
                continue
            for imported, line in module_imports(name, path, set(files)).items():
                there = room_of(imported, rooms)
                if there != here and there not in rooms[here] and "*" not in rooms[here]:
                    wrong.append(f"{here} ({path.relative_to(root)}:{line}) imports {there} ({imported})")
    return homeless, wrong


def test_each_room_imports_only_the_rooms_below_it():
    homeless, wrong = room_edges(REPO, ("core", "index", "serving", "training"), ROOMS)
    assert not homeless, "modules in no room (add the room to ROOMS and to docs/architecture.md's map):\n" + "\n".join(
        homeless
    )
    assert not wrong, "imports across rooms the map does not allow:\n" + "\n".join(sorted(wrong))


def test_every_room_the_map_names_exists():
    """A room in ROOMS, and every module docs/architecture.md's map of rooms and its request paths
    name, is a folder or module of the code: the map cannot go stale."""
    missing = [
        room
        for room in ROOMS
        if not (REPO / room.replace(".", "/")).is_dir() and not (REPO / (room.replace(".", "/") + ".py")).is_file()
    ]
    assert not missing, f"ROOMS names what does not exist: {missing}"
    named = mapped_modules((REPO / "docs" / "architecture.md").read_text())
    assert len(named) > 40  # not vacuous: the map and the paths name the rooms' modules
    missing = [name for name in named if not (REPO / name).exists()]
    assert not missing, f"docs/architecture.md's map names what does not exist: {missing}"


def mapped_modules(doc: str) -> list[str]:
    """The files and folders the map of rooms and the request paths name (the document's part
    before its first `## Purpose`): each `path/to/module.py` or `package/room/`, and each dotted
    `package.room.module` written as a path."""
    import re

    head = doc.split("\n## Purpose", 1)[0]
    found = []
    for token in re.findall(r"`([a-z_][\w./]*)`", head):
        if token.endswith((".py", "/")) and "/" in token:
            found.append(token.rstrip("/"))
        elif re.fullmatch(r"(core|index|serving|training)(\.\w+)+", token):
            path = token.replace(".", "/")
            found.append(path if (REPO / path).is_dir() else path + ".py")
    return found


def test_a_room_breach_and_a_homeless_module_are_found(tmp_path):
    """Not vacuous: an import up the stack and a module no room holds are reported; imports
    within a room and down the stack are not."""
    package = tmp_path / "pkg"
    for folder in ("low", "high"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("from pkg.low import b\n\n\ndef f():\n    from pkg.high import c\n")
    (package / "low" / "b.py").write_text("")
    (package / "high" / "c.py").write_text("from pkg.low import a\n")
    (package / "stray.py").write_text("")
    rooms = {"pkg.low": set(), "pkg.high": {"pkg.low"}}
    homeless, wrong = room_edges(tmp_path, ("pkg",), rooms)
    assert sorted(homeless) == ["pkg", "pkg.stray"]
    assert wrong == ["pkg.low (pkg/low/a.py:5) imports pkg.high (pkg.high.c)"]
    assert room_of("pkg.low.a", rooms) == "pkg.low" and room_of("pkg.lowly", rooms) is None
