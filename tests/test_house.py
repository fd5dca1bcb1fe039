"""The house's rules, read from the sources (docs/architecture.md): no import circle among
raysim's modules; algorithms never import the runtime; the runtime and the configuration
never import an algorithm."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ((REPO / "raysim", "raysim"), (REPO / "algorithms", "raysim.algorithms"))


def modules() -> dict:
    out = {}
    for base, package in PACKAGES:
        for f in base.rglob("*.py"):
            parts = [package, *f.relative_to(base).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(f: Path, everywhere: bool) -> set:
    """The modules `f` imports: at its top level, or `everywhere` (inside functions too)."""
    tree = ast.parse(f.read_text())
    nodes = ast.walk(tree) if everywhere else tree.body
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_no_import_circle_among_raysims_modules():
    """Imports inside functions count too; importing one's own parent package does not (it
    is always loaded first)."""
    mods = modules()
    graph = {m: {i for i in imports(f, everywhere=True) if i in mods and not m.startswith(i)} for m, f in mods.items()}
    assert len(graph) > 60
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_algorithms_never_import_the_runtime_and_the_runtime_never_imports_an_algorithm():
    mods = modules()
    for name, f in mods.items():
        found = imports(f, everywhere=True)
        if name.startswith("raysim.algorithms"):
            assert not any(i.startswith("raysim.runtime") for i in found), (name, found)
        if name.startswith(("raysim.runtime", "raysim.config")):
            assert not any(i.startswith("raysim.algorithms") for i in found), (name, found)


def test_every_package_is_listed_in_pyproject_so_the_wheel_carries_it():
    """pyproject lists its packages (the folder mapping needs an explicit list): a new
    subpackage left out would be missing from an installed raysim."""
    import re

    text = (REPO / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(raysim(?:\.[a-z_]+)*)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    found = {"raysim" + "".join(f".{p}" for p in d.relative_to(REPO / "raysim").parts)
             for d in (REPO / "raysim").rglob("*") if d.is_dir() and (d / "__init__.py").is_file()}
    found |= {"raysim", "raysim.algorithms", "raysim.configs"}
    assert listed == found, (sorted(found - listed), sorted(listed - found))
