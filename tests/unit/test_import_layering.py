"""The import layering of services/, shared/ and kernels/ (scripts/check_imports.py, run here
so that CI runs it): no import cycle, no service importing another service, nothing in
shared/ or kernels/ importing services/. The checker itself is tested on small trees whose
offences are known by construction."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_imports.py"
sys.path.insert(0, str(SCRIPT.parent))

import check_imports  # noqa: E402

def test_no_service_imports_another_service_and_shared_imports_no_service():
    g = check_imports.build_graph(str(REPO))
    assert len(g.modules) > 50, "the checker found too few modules to be looking at the repo"
    offences = [f"{kind}: {e.path}:{e.line}: {e.source} imports {e.target}"
                for kind, e in check_imports.layering_offences(g)]
    assert offences == []


def test_no_import_cycle():
    g = check_imports.build_graph(str(REPO))
    cycles = [sorted(c) for c in check_imports.find_cycles(g)]
    assert cycles == [], f"import cycles: {cycles}"


def test_the_script_passes_on_the_repo():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == "" and "no cycle, no cross-service import" in r.stderr, r.stdout + r.stderr


def _tree(root: pathlib.Path, files: dict[str, str]) -> str:
    for pkg in check_imports.PACKAGES:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").touch()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if str(parent) != ".":
                (root / parent / "__init__.py").touch()
        path.write_text(text)
    return str(root)


def _run(root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", root], capture_output=True,
                          text=True, timeout=60)


def test_a_clean_tree_passes_with_exit_code_0(tmp_path):
    root = _tree(tmp_path, {
        "shared/a.py": "import os\nfrom shared import b\n",
        "shared/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shared import a\n",
        "kernels/k.py": "from shared.b import x\n",
        "services/engine/core.py": "from shared.a import y\nfrom . import steps\n",
        "services/engine/steps.py": "from kernels import k\n",
        "services/worker/run.py": "import services.worker.model\n",
        "services/worker/model.py": "",
        "services/cli.py": "def main():\n    from services.engine.core import run\n"
                           "    from services.worker.run import go\n",
    })
    r = _run(root)
    assert (r.returncode, r.stdout) == (0, ""), r.stdout + r.stderr


def test_cycles_through_function_level_and_relative_imports_are_found(tmp_path):
    root = _tree(tmp_path, {
        # a three-module cycle closed by an import inside a function
        "services/frontend/routes.py": "from services.frontend import chat\n",
        "services/frontend/chat.py": "from .util import helper\n",
        "services/frontend/util.py": "def helper():\n    from services.frontend.routes import x\n",
        # a two-module cycle at module level, one side relative from a package
        "kernels/lin/__init__.py": "from .gemv import g\n",
        "kernels/lin/gemv.py": "import kernels.lin\n",
    })
    g = check_imports.build_graph(root)
    assert {frozenset(c) for c in check_imports.find_cycles(g)} == {
        frozenset({"services.frontend.routes", "services.frontend.chat", "services.frontend.util"}),
        frozenset({"kernels.lin", "kernels.lin.gemv"}),
    }
    r = _run(root)
    assert r.returncode == 1
    assert sorted(line.split(":", 1)[0] for line in r.stdout.splitlines()) == [
        "cycle among kernels.lin, kernels.lin.gemv",
        "cycle among services.frontend.chat, services.frontend.routes, services.frontend.util"]
    # the example cycle names the file and line of each hop
    assert "services/frontend/util.py:2" in r.stdout


@pytest.mark.parametrize("src, importer, line, kind", [
    ("services/engine/core.py", "from services.kvstore.settings import s\n", 1, "cross-service"),
    ("services/frontend/metrics.py", "import os\n\ndef f():\n    import services.supervisor.restart\n",
     4, "cross-service"),
    ("shared/config.py", "from services.engine import core\n", 1, "layering"),
    ("kernels/k.py", "from services.worker.model import m\n", 1, "layering"),
])
def test_cross_service_and_layering_imports_are_offences(tmp_path, src, importer, line, kind):
    root = _tree(tmp_path, {
        src: importer,
        "services/kvstore/settings.py": "", "services/supervisor/restart.py": "",
        "services/engine/core.py" if src != "services/engine/core.py" else "services/engine/x.py": "",
        "services/worker/model.py": "",
    })
    r = _run(root)
    assert r.returncode == 1
    assert r.stdout.startswith(f"{kind}: {src}:{line}: "), r.stdout
    assert len(r.stdout.splitlines()) == 1
