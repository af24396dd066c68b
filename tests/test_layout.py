"""The dependency rule, checked on the source: server → engine front end → (IPC) → engine core → worker.

Nothing outside compiled/ and the benchmark package imports torch; engine/ and server/ never import
compiled/ (the engine core reaches its worker by name, engine/executor.py); compiled/ imports from
engine/ only the step contract, config, message types and the sockets' security; nothing imports the
benchmarks but `kiln bench`.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "compiled", "server")
BENCH = "server/bench"
WORKER_MAY_IMPORT = {
    "engine.cluster",
    "engine.config",
    "engine.messages",
    "engine.model_files",
    "engine.params",
    "engine.processes",
    "engine.step",
}
MAX_LINES = 400


def modules() -> dict[str, Path]:
    return {str(p.relative_to(ROOT)): p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """Every module an import statement names, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_import_graph_keeps_the_dependency_rule():
    bad = []
    for rel, path in modules().items():
        names = imports(path)
        in_bench = rel.startswith(BENCH)
        # `kiln bench` (server/cli.py) hands over to the benchmarks' own command line.
        if (
            not in_bench
            and rel != "server/cli.py"
            and any(top(n) == "server" and ".bench" in n for n in names)
        ):
            bad.append(f"{rel} imports the benchmarks")
        if rel.startswith("compiled/"):
            bad += [
                f"{rel} imports {n}"
                for n in names
                if top(n) == "engine"
                and n not in WORKER_MAY_IMPORT
                and not any(n.startswith(m + ".") for m in WORKER_MAY_IMPORT)
            ]
            bad += [f"{rel} imports {n}" for n in names if top(n) == "server"]
        elif not in_bench:
            bad += [f"{rel} imports {n}" for n in names if top(n) in ("torch", "compiled")]
    assert not bad, "\n".join(bad)


def test_the_worker_imports_only_torch_free_engine_modules():
    for name in WORKER_MAY_IMPORT:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert not {n for n in imports(path) if top(n) in ("torch", "compiled")}, name


def test_the_front_end_and_server_import_no_torch():
    code = (
        "import sys, engine, engine.llm, engine.async_llm, server.api, server.cli; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_front_end_generates_without_importing_torch(tiny_chat_model):
    code = (
        "import sys; from engine.llm import LLM, SamplingParams\n"
        f"llm = LLM({tiny_chat_model!r}, dtype='float32', enforce_eager=True, kv_cache_memory=50_000_000)\n"
        "params = SamplingParams(max_tokens=3, ignore_eos=True)\n"
        "out = llm.chat([{'role': 'user', 'content': 'hi'}], params, use_tqdm=False)\n"
        "llm.shutdown()\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "assert 'torch' not in sys.modules, 'the front end imported torch'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_product_module_is_over_the_limit():
    sizes = {
        rel: len(p.read_text().splitlines()) for rel, p in modules().items() if not rel.startswith(BENCH)
    }
    assert max(sizes.values()) <= MAX_LINES, {rel: n for rel, n in sizes.items() if n > MAX_LINES}


def test_compiled_code_assigns_no_class_attribute_and_replaces_no_forward():
    """How a step computes travels in its plan (compiled/plan.py): nothing flips a class's attribute, and
    no module's forward is swapped for another callable."""
    bad = []
    for rel, path in modules().items():
        if not rel.startswith("compiled"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in (e for x in targets for e in (x.elts if isinstance(x, (ast.Tuple, ast.List)) else [x])):
                on_class = (
                    isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id[0].isupper()
                )
                if on_class or (isinstance(t, ast.Attribute) and t.attr == "forward"):
                    bad.append(f"{rel}:{node.lineno}")
    assert bad == []
