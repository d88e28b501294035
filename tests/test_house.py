"""The house a reader walks: one name per thing, the store as one package, the mesh's
node behind the mesh's own methods (docs/design.md §5)."""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KVMESH = ROOT / "kvmesh"

# each API module's route factory is ``router(service)`` (FastAPI's convention): one
# kind of thing under one name, not two things under one
SAME_THING = {"router"}


def _modules() -> list[Path]:
    return [p for p in sorted(KVMESH.rglob("*.py")) if "proto" not in p.parts]


def test_no_two_public_classes_or_functions_share_a_name():
    where: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        for node in ast.parse(path.read_text()).body:
            defines = isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            if defines and not node.name.startswith("_") and node.name not in SAME_THING:
                where[node.name].append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, twice


def test_the_demo_lives_in_the_cli_and_the_store_in_one_package():
    demos = [str(p.relative_to(ROOT)) for p in KVMESH.rglob("demo.py")]
    assert demos == ["kvmesh/cli/demo.py"], demos
    assert (KVMESH / "store" / "__init__.py").is_file()
    flat = [p.name for p in KVMESH.glob("*.py") if p.stem.startswith("store") or p.stem == "disk"]
    assert not flat, flat


def test_only_the_mesh_reaches_into_a_node():
    reach = re.compile(r"\._?node\.node\b")
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for top in ("kvmesh", "tests", "bench")
        for p in sorted((ROOT / top).rglob("*.py"))
        if "mesh" not in p.relative_to(ROOT).parts[:2] and p.name != "test_house.py"
        for n, line in enumerate(p.read_text().splitlines(), start=1)
        if reach.search(line)
    ]
    assert not found, found
