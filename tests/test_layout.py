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
    "flop_count": 0,
    "frames": 0,
    "listing": 1,
    "plots": 1,
    "offload": 1,
    "vjp_primitive": 1,
    "attention": 2,
    "remat": 2,
    "trainable": 0,
    "scan": 3,
    "chunking": 4,
    "losses": 4,
    "reversible": 4,
    "profile": 4,
    "flax": 5,
    "optimize": 5,
    "lint": 6,
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
MAX_LINES = 700


def test_no_module_is_over_700_lines():
    long = {
        m: n
        for m, path in MODULES.items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long


# A function a newcomer can read in one sitting; past this, it becomes named steps (STYLE.md 11).
MAX_FUNCTION_LINES = 80


def _long_functions(path: Path, limit: int) -> list[str]:
    """The functions of ``path`` (nested ones and methods too) whose body, less its docstring,
    is over ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if (
            len(body) > 1
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            body = body[1:]  # the docstring
        n = node.end_lineno - body[0].lineno + 1
        if n > limit:
            found.append(f"{node.name} ({n} lines)")
    return found


def test_no_function_in_src_is_over_80_lines():
    long = {m: f for m, path in MODULES.items() if (f := _long_functions(path, MAX_FUNCTION_LINES))}
    assert not long, long


def test_the_function_length_check_finds_one(tmp_path):
    path = tmp_path / "m.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    path.write_text(f'def f():\n    """Doc."""\n{body}\n\ndef g():\n    return 1\n')
    assert _long_functions(path, 4) == ["f (5 lines)"]
    assert _long_functions(path, 5) == []


# Where a function reads best as one piece although mccabe counts more than 10 branches (ruff's
# C901, on for src in pyproject.toml): each such def silences C901 on its line (noqa) and has a
# comment right above it saying why. At most this many.
MAX_COMPLEXITY_EXCEPTIONS = 10


def _complexity_exceptions() -> list[tuple[str, int, bool]]:
    """Each C901 silenced in src: (module, line, whether a comment stands right above)."""
    found = []
    for m, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if "noqa: C901" in line:
                above = lines[i - 1].strip() if i else ""
                found.append((m, i + 1, above.startswith("#")))
    return found


def test_few_functions_pass_over_the_complexity_bar_and_each_says_why():
    found = _complexity_exceptions()
    assert len(found) <= MAX_COMPLEXITY_EXCEPTIONS, found
    assert all(has_comment for _, _, has_comment in found), found


def test_the_top_of_src_holds_leaves_and_one_package_per_concern():
    top = sorted(p.stem for p in (ROOT / "jaxmem" / "_src").glob("*.py") if p.stem != "__init__")
    packages = sorted(
        p.name for p in (ROOT / "jaxmem" / "_src").iterdir() if (p / "__init__.py").is_file()
    )
    assert packages == [
        "attention",
        "chunking",
        "flax",
        "lint",
        "losses",
        "optimize",
        "profile",
        "remat",
        "reversible",
        "scan",
    ]
    assert len(top) < 12, top  # 24 flat modules before the subpackages


REPO = ROOT.parent


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute or by bare name), at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _test_modules_imported(root: Path) -> dict[str, list[str]]:
    """Test modules (``test_*.py``) that another module under ``root`` imports: what tests share
    belongs in tests/helpers.py or a helper module, not in a module pytest also runs."""
    tests = {p.stem for p in root.rglob("test_*.py")}
    found = {}
    for path in root.rglob("*.py"):
        hits = sorted(m for m in _imported_modules(path) if m.split(".")[-1] in tests or m in tests)
        if hits:
            found[str(path.relative_to(root))] = hits
    return found


def test_no_test_module_is_imported_by_another():
    assert not _test_modules_imported(REPO / "tests")


def test_the_test_import_check_finds_one(tmp_path):
    (tmp_path / "test_a.py").write_text("X = 1\n")
    (tmp_path / "test_b.py").write_text("from test_a import X\nimport tests.scan.test_a\n")
    (tmp_path / "helpers.py").write_text("import numpy\n")
    assert _test_modules_imported(tmp_path) == {"test_b.py": ["test_a", "tests.scan.test_a"]}


def _src_imports(root: Path) -> dict[str, list[str]]:
    """Modules under ``root`` that import jaxmem's private ``_src`` (code outside the library
    uses the public face, as users do)."""
    found = {}
    for path in root.rglob("*.py"):
        hits = sorted(m for m in _imported_modules(path) if m.startswith("jaxmem._src"))
        if hits:
            found[str(path.relative_to(root))] = hits
    return found


def test_benchmarks_tools_and_the_demo_use_only_the_public_face():
    for root in (REPO / "benchmarks", REPO / "tools", ROOT / "jaxmem" / "demo"):
        assert not _src_imports(root), root


def test_the_src_import_check_finds_one(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from jaxmem._src.scan import api\n")
    assert _src_imports(tmp_path) == {"m.py": ["jaxmem._src.scan", "jaxmem._src.scan.api"]}


def _definitions(name: str) -> list[str]:
    """The modules of src that define a function ``name`` at any depth."""
    return sorted(
        m
        for m, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
    )


def test_one_definition_of_the_shared_type_helpers():
    # One is_float (jax_compat) and no private copies; array types read by jax.typeof and
    # written by format.format_type.
    assert _definitions("is_float") == ["jaxmem._src.jax_compat"]
    assert _definitions("format_type") == ["jaxmem._src.format"]
    for name in ("_is_float", "_aval", "_aval_str"):
        assert _definitions(name) == [], name


def test_no_module_is_named_like_a_package_it_imports():
    # A benchmarks/flax.py shadows flax for a script run from benchmarks/.
    for root in (REPO / "benchmarks", REPO / "tools"):
        names = {p.stem for p in root.rglob("*.py")}
        assert not names & {"flax", "jax", "optax", "equinox", "numpy", "jaxmem"}, root
