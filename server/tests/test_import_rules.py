"""scripts/check_import_cycles.py's layering rule: nothing in the model layer
(models/, layers/, sluice_kernels) imports the batch/servicer layer, directly
or through other modules, and the kernels import nothing of the server. The
rule fires on planted breaches and holds for this checkout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_import_cycles.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CLEAN = {
    "server/sluice_server/__init__.py": "",
    "server/sluice_server/batch.py": "from sluice_server.layers import attention\n",
    "server/sluice_server/model_runner.py": "from sluice_server import batch\nfrom sluice_server.models import llama\n",
    "server/sluice_server/sampling.py": "import torch\n",
    "server/sluice_server/layers/__init__.py": "",
    "server/sluice_server/layers/attention.py": "from sluice_kernels import ops\n",
    "server/sluice_server/models/__init__.py": "",
    "server/sluice_server/models/llama.py": "from sluice_server.layers.attention import x\n",
    "kernels/sluice_kernels/__init__.py": "",
    "kernels/sluice_kernels/ops.py": "import torch\n",
}


def breaches(checker, root: Path) -> list[str]:
    graph = checker.python_graph(root / "server" / "sluice_server", root / "kernels" / "sluice_kernels")
    return checker.layering_breaches(graph)


def test_a_clean_tree_has_no_breach(checker, tmp_path):
    plant(tmp_path, CLEAN)
    assert breaches(checker, tmp_path) == []


def test_a_model_importing_the_batch_is_a_breach(checker, tmp_path):
    # The old layers/cpu_decoder.py: a lazy import inside a function counts too.
    plant(tmp_path, CLEAN | {
        "server/sluice_server/layers/cpu_decoder.py": "def f():\n    from sluice_server.batch import Batch\n",
    })
    assert breaches(checker, tmp_path) == [
        "model layer imports the batch/servicer layer: sluice_server.layers.cpu_decoder -> sluice_server.batch"
    ]


def test_a_breach_through_another_module_shows_the_chain(checker, tmp_path):
    plant(tmp_path, CLEAN | {
        "server/sluice_server/sampling.py": "from sluice_server import model_runner\n",
        "server/sluice_server/models/llama.py": "from sluice_server import sampling\n",
    })
    assert breaches(checker, tmp_path) == [
        "model layer imports the batch/servicer layer: "
        "sluice_server.models.llama -> sluice_server.sampling -> sluice_server.model_runner"
    ]


def test_kernels_importing_the_server_is_a_breach(checker, tmp_path):
    plant(tmp_path, CLEAN | {"kernels/sluice_kernels/ops.py": "from sluice_server.sampling import x\n"})
    assert breaches(checker, tmp_path) == ["kernels import the server: sluice_kernels.ops -> sluice_server.sampling"]


def test_this_checkout_keeps_the_rules(checker):
    """The shard's Python: no breach, no circle. (The script also checks the
    Rust crates; scripts/test.sh runs it whole.)"""
    graph = checker.python_graph(*(p for p in checker.PYTHON_PACKAGES if p.is_dir()))
    assert "sluice_server.models.llama_cpu_decoder" in graph and "sluice_kernels.cpu_kernels" in graph
    assert checker.layering_breaches(graph) == []
    assert checker.cycles(graph) == []
