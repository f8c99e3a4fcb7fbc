"""The package's shape: the import graph of ``src/jaxmem`` (read with ``ast``, every import at
any depth) has no cycle, nothing in ``_src`` imports the public face, and each concern of
``_src`` imports only from the layers below it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
SRC = ROOT / "jaxmem" / "_src"

# The units of _src (a subpackage or a leaf module) by layer: a unit imports from its own layer's
# leaves or from lower layers only. docs/design.md §2 describes them.
LAYERS = {
    "jax_compat": 0,
    "checks": 0,
    "optional": 0,
    "format": 0,
    "listing": 1,
    "plots": 1,
    "offload": 1,
    "vjp_primitive": 1,
    "remat": 2,
    "scan": 3,
    "losses": 4,
    "reversible": 4,
    "profile": 4,
    "flax": 5,
    "optimize": 5,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "jaxmem").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "_src" else None


MODULES = _modules()
GRAPH = {m: _imports(p, MODULES) - {m} for m, p in MODULES.items()}


def test_every_unit_of_src_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.name != "__pycache__"}
    assert units - {"__init__"} == set(LAYERS)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a path that returns to its start), or None."""
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path, m, n]
            if n not in state and (found := visit(n, [*path, m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one unit of _src to another in the same or a higher layer."""
    return [
        f"{m} -> {n}"
        for m, ns in graph.items()
        if _unit(m)
        for n in ns
        if _unit(n) and _unit(n) != _unit(m) and LAYERS[_unit(n)] >= LAYERS[_unit(m)]
    ]


def test_no_import_cycle():
    assert _cycle(GRAPH) is None


def test_src_never_imports_the_public_face():
    up = [(m, n) for m, ns in GRAPH.items() if _unit(m) for n in ns if not _unit(n)]
    up = [(m, n) for m, n in up if n != "jaxmem._src"]
    assert not up, up


def test_imports_go_down_the_layers():
    assert not _upward(GRAPH)


def test_the_checks_find_a_cycle_and_an_upward_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    up = {"jaxmem._src.remat.policies": {"jaxmem._src.scan.api"}, "jaxmem._src.scan.api": set()}
    assert _upward(up) == ["jaxmem._src.remat.policies -> jaxmem._src.scan.api"]


def _private_uses(path: Path, module: str) -> list[str]:
    """Private names (``_x``) of another unit of _src that ``module`` imports or reads as an
    attribute of an imported module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: dict[str, str] = {}  # local name -> the _src module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxmem."):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    bound[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and _unit(node.module) != _unit(module):
                    found.append(full)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _unit(bound[node.value.id]) != _unit(module)
        ):
            found.append(f"{bound[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_unit_of_src():
    crossing = {
        m: sorted(set(uses))
        for m, p in MODULES.items()
        if _unit(m) and (uses := _private_uses(p, m))
    }
    assert not crossing, crossing


def test_the_private_name_check_finds_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from jaxmem._src.scan import api as _scan\n"
        "from jaxmem._src.scan.api import _prepare\n"
        "x = _scan._check_thing\n"
    )
    found = _private_uses(path, "jaxmem._src.flax.linen")
    assert sorted(found) == ["jaxmem._src.scan.api._check_thing", "jaxmem._src.scan.api._prepare"]
    assert _private_uses(path, "jaxmem._src.scan.other") == []  # within its own unit


# A module a newcomer can read in one sitting; past this, split it by concern.
MAX_LINES = 800


def test_no_module_is_over_800_lines():
    long = {
        m: n
        for m, path in MODULES.items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_top_of_src_holds_leaves_and_one_package_per_concern():
    top = sorted(p.stem for p in (ROOT / "jaxmem" / "_src").glob("*.py") if p.stem != "__init__")
    packages = sorted(
        p.name for p in (ROOT / "jaxmem" / "_src").iterdir() if (p / "__init__.py").is_file()
    )
    assert packages == ["flax", "losses", "optimize", "profile", "remat", "scan"]
    assert len(top) < 12, top  # 24 flat modules before the subpackages
