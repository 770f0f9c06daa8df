"""The layout a reader relies on (issue 44): one name per module, no import cycle, the README's module
map naming every folder and top-level module of dice/ as it is."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DICE = ROOT / "dice"


def sources() -> list[Path]:
    """The package's Python modules (dice/assets holds example programs, data rather than modules)."""
    return [p for p in DICE.rglob("*.py") if "assets" not in p.relative_to(DICE).parts]


def modules() -> dict[str, Path]:
    """dotted name -> file, for every module of the package (a package is its __init__.py)."""
    found = {}
    for path in sources():
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def top_level_imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The dice modules `name` imports when it is imported (module level only, as Python runs it)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:   # `from pkg import submodule` imports the submodule
                targets.add(f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {t for t in targets if t in known and t != name}


def test_no_two_modules_share_a_basename():
    names = {}
    for path in sources():
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_every_folder_of_modules_is_a_package():
    """A folder without __init__.py imports as a namespace package but is left out of an install."""
    folders = {p.parent for p in sources()}
    assert {str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()} == set()


def test_no_import_cycle():
    known = modules()
    graph = {name: top_level_imports(name, path, known) for name, path in known.items()}
    # a package's __init__ runs before its submodules: an edge from a module to its own package is not a cycle
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_readme_module_map_names_every_folder_and_top_level_module():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Module map"):readme.index("## Rules the code follows")]
    named = set(re.findall(r"`(dice/[\w/]+(?:\.py)?)`", table))
    named |= {f"dice/{m}" for m in re.findall(r"`(\w+\.py)`", table.split("| `dice/config.py`")[1])}
    folders = {f"dice/{p.parent.relative_to(DICE)}/" for p in DICE.glob("*/__init__.py")}
    top = {f"dice/{p.name}" for p in DICE.glob("*.py") if p.name != "__init__.py"}
    assert folders - named == set() and top - named == set()
    assert {n for n in named if not (ROOT / n).exists()} == set()


def test_each_folders_own_map_names_its_modules():
    for init in DICE.glob("**/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "| module |" not in doc:
            continue
        mods = {p.stem for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
        named = set(re.findall(r"`(\w+)`", doc))
        assert mods - named == set(), init
