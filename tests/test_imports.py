"""Imports stay cheap and acyclic: the torch-free parts import without torch, the CLI parses its
flags without torch, and no module's top-level imports lead back to itself."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package name -> source folder (pyproject's package-dir: kernels/ is installed as specserve.kernels)
PACKAGE_DIRS = {"specserve": ROOT / "specserve", "specserve.kernels": ROOT / "kernels"}
HEAVY = ("torch", "transformers")


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A fresh interpreter: what this test process already imported does not count."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# -- (a) torch-free modules ------------------------------------------------------------------------
TORCH_FREE = ["specserve", "specserve.cache.kv_cache_manager", "specserve.engine.scheduler", "specserve.config",
              "specserve.client", "specserve.cli", "specserve.engine_args", "specserve.server.cli",
              "specserve.client.repl", "specserve.quant.names", "specserve.models.default_paths"]


def test_torch_free_modules_do_not_import_torch():
    code = (f"import sys\nfor name in {TORCH_FREE!r}:\n    __import__(name)\n"
            "from specserve.config import SpecConfig\n"
            "SpecConfig(method='draft_model', model='self-nf4')  # names the quantization, loads nothing\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
            "assert not heavy, heavy[:5]\n")
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr


def test_public_names_still_import_from_the_package():
    proc = _python("-c", "from specserve import LLM, SamplingParams, RequestOutput, CompletionOutput, __version__\n"
                         "import specserve\nassert set(specserve.__all__) <= set(dir(specserve))")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernels_import_with_torch_and_triton_alone():
    """The bare GPU machine (bench/gpu_suite.sh) has torch and triton but not the engine's other
    dependencies: the kernels and the attention backends must import there."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('transformers', 'pydantic', 'xxhash', 'starlette', 'websockets', "
            "'yaml', 'safetensors', 'gguf'):\n"
            "            raise ImportError(f'{name} is not on the bare GPU machine')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import specserve.kernels, specserve.models.layers.torch_attn, specserve.models.layers.triton_attn\n")
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr


# -- (b) the command line --------------------------------------------------------------------------
def _imported(importtime_stderr: str) -> set[str]:
    """Module names from `python -X importtime` ("import time: self | cumulative | name")."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("argv, rc", [(["--help"], 0), (["serve", "--help"], 0),
                                      (["serve", "--port", "notanumber"], 2), (["generate"], 2)])
def test_cli_parses_flags_without_torch(argv, rc):
    t0 = time.perf_counter()
    proc = _python("-X", "importtime", "-m", "specserve.cli", *argv)
    wall = time.perf_counter() - t0
    assert proc.returncode == rc, proc.stderr[-2000:]
    assert "usage: specserve" in proc.stdout + proc.stderr
    heavy = sorted(m for m in _imported(proc.stderr) if m.split(".")[0] in HEAVY)
    # wall time is printed, not asserted: CI machines are noisy; torch alone takes ~1.5 s to import
    print(f"specserve {' '.join(argv)}: {wall:.2f}s")
    assert not heavy, f"`specserve {' '.join(argv)}` imported {heavy[:5]}"


def test_bad_sampling_flags_fail_before_the_model_loads():
    proc = _python("-X", "importtime", "-m", "specserve.cli", "generate", "hi", "--temperature", "-1",
                   "--model", "/nonexistent")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr
    assert not any(m.split(".")[0] in HEAVY for m in _imported(proc.stderr))


# -- (c) no import cycles --------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for file in folder.rglob("*.py"):
            parts = list(file.relative_to(folder).with_suffix("").parts)
            if package == "specserve" and parts[0] == "kernels":
                continue  # the GPU machine's symlink specserve/kernels -> ../kernels
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = file
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_statements(body: list[ast.stmt]):
    """Import statements that run when the module is imported: not in functions, not under
    `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_statements(node.body)
            yield from _import_time_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_time_statements(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _import_time_statements(node.body)


def _all_statements(tree: ast.AST):
    """Every import statement, also those inside functions (deferred), except under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _all_statements(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from _all_statements(node)


def _import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """module -> the package modules its top-level imports name (the module itself for
    `from pkg import submodule`, else the longest prefix that is one of ours); `deferred`: also
    the imports inside functions."""
    modules = _modules()

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        tree = ast.parse(file.read_text(), str(file))
        for node in _all_statements(tree) if deferred else _import_time_statements(tree.body):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                        for alias in node.names]
        graph[name] = {t for t in map(ours, targets) if t is not None and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_covers_the_package():
    graph = _import_graph()
    assert "specserve.kernels.paged_attention" in graph
    assert "specserve.cache.block_pool" in graph["specserve.cache.kv_cache_manager"]
    assert "specserve.engine_args" in graph["specserve.server.cli"]


def test_no_import_cycles():
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles_through_deferred_imports():
    """A function-level import breaks a cycle at import time only: the modules still depend on each
    other."""
    graph = _import_graph(deferred=True)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle)


def test_the_checkout_root_on_sys_path_does_not_shadow_the_package_kernels():
    """kernels/ (installed as specserve.kernels) sits at the checkout's root, which pytest and `python -m`
    put on sys.path; recent transformers depend on a PyPI package named `kernels` and import it even for
    a LlamaConfig. Imported as top-level `kernels`, the folder loads that package in its place (or, with
    none installed, is an empty module: transformers 5.17 imports the name to look for a version); a fresh
    environment with transformers 5.25 failed every test here before."""
    code = ("import importlib.metadata, sys\n"
            "try:\n"
            "    importlib.metadata.version('kernels')\n"
            "    installed = True\n"
            "except importlib.metadata.PackageNotFoundError:\n"
            "    installed = False\n"
            "import kernels\n"
            f"ours = kernels.__file__.startswith({str(ROOT / 'kernels')!r})\n"
            "assert ours != installed, (installed, kernels.__file__)\n"
            "assert not ours or not hasattr(kernels, 'rms_norm') and not hasattr(kernels, '__version__')\n"
            "import specserve.kernels\n"
            f"assert specserve.kernels.__file__.startswith({str(ROOT / 'kernels')!r})\n"
            "assert callable(specserve.kernels.rms_norm)\n"
            "from transformers import LlamaConfig\n"
            "LlamaConfig()\n")
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr


def test_the_checkout_root_on_sys_path_without_the_package_kernels():
    """With no package `kernels` installed (the GPU machine), the folder imported as top-level `kernels` is
    an empty module, which transformers takes as "not installed"."""
    code = ("import sys\n"
            "sys.path = [p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p]\n"
            f"sys.path.append({str(ROOT)!r})\n"
            "import kernels\n"
            f"assert kernels.__file__.startswith({str(ROOT / 'kernels')!r}), kernels.__file__\n"
            "assert not hasattr(kernels, 'rms_norm') and not hasattr(kernels, '__version__')\n")
    proc = _python("-S", "-c", code)
    assert proc.returncode == 0, proc.stderr
