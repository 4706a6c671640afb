"""Importing the package, its references or any one kernel file changes no environment variable (in a clean
subprocess), `mtp_triton.reference` and the twins beside the kernels import no triton, and the interpreter is an
explicit, checked choice."""
import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, os, sys
before = dict(os.environ)
import importlib
importlib.import_module(sys.argv[1])
after = dict(os.environ)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
print(json.dumps({"changed": changed, "triton": "triton" in sys.modules}))
"""

MODULES = ["mtp_triton", "mtp_triton.reference", "mtp_triton.kernels", "mtp_triton.kernels.accept",
           "mtp_triton.kernels.drafting", "mtp_triton.kernels.kv_append", "mtp_triton.kernels.tree_attention"]


def _probe(module, env_extra=None):
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_import_changes_no_environment(module):
    assert _probe(module)["changed"] == []


@pytest.mark.parametrize("module", ["mtp_triton", "mtp_triton.reference"])
def test_package_and_reference_import_no_triton(module):
    assert _probe(module)["triton"] is False


def _cpu_only(code):
    """Run `code` in a fresh interpreter without CUDA and without TRITON_INTERPRET; its stdout + stderr."""
    import os
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return out.stdout + out.stderr


def test_kernel_on_cpu_without_interpreter_says_what_to_do():
    out = _cpu_only(r"""
import torch
from mtp_triton.kernels.accept import tree_accept
try:
    tree_accept(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([-1, 0]), torch.zeros(1, 2, dtype=torch.int64))
except RuntimeError as e:
    print("RAISED", e)
""")
    assert "RAISED" in out and "use_interpreter" in out, out


def test_use_interpreter_refuses_after_a_compiled_import():
    out = _cpu_only(r"""
import mtp_triton as mt
import mtp_triton.kernels.kv_append
try:
    mt.use_interpreter()
except RuntimeError as e:
    print("RAISED", e)
""")
    assert "RAISED" in out and "restart" in out, out


def test_triton_ops_on_cpu_need_the_interpreter():
    out = _cpu_only(r"""
import mtp_triton as mt
try:
    mt.ops.get_ops("triton", "cpu")
except RuntimeError as e:
    print("RAISED", e)
mt.use_interpreter()
print("KIND", mt.ops.get_ops("triton", "cpu").kind)
""")
    assert "RAISED" in out and "KIND triton" in out, out


def _import_graph():
    """{module: modules of the package or the lab it imports}, from every import statement (function-level ones
    included), over mtp_triton/ and mtp_lab/."""
    import ast
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    names = {".".join(p.relative_to(repo).with_suffix("").parts).removesuffix(".__init__"): p
             for top in ("mtp_triton", "mtp_lab") for p in (repo / top).rglob("*.py")}
    graph = {}
    for name, path in names.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1]) if node.level else ""
                target = ".".join(x for x in (base, node.module) if x)
                found = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in names]
                graph[name] |= set(found or ([target] if target in names else []))
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in names}
        graph[name].discard(name)
    return graph


def test_no_import_circles_and_the_package_never_imports_the_lab():
    """No module reaches itself through its imports (a package's own __init__ aside: it re-exports); nothing in
    mtp_triton/ imports mtp_lab/ (not even by name through importlib); and only the command lines (demo,
    __main__) import the lab's bench/ from outside it."""
    from pathlib import Path
    graph = _import_graph()
    inner = {m: {t for t in ts if t not in ("mtp_triton", "mtp_lab")} for m, ts in graph.items()
             if m not in ("mtp_triton", "mtp_lab")}
    for start in inner:
        seen, todo = set(), list(inner[start])
        while todo:
            m = todo.pop()
            assert m != start, f"{start} imports itself through its imports"
            if m not in seen:
                seen.add(m)
                todo += inner.get(m, ())
    up = {m: sorted(t for t in ts if t.startswith("mtp_lab")) for m, ts in graph.items() if m.startswith("mtp_triton")}
    assert not any(up.values()), {m: ts for m, ts in up.items() if ts}
    package = Path(__file__).resolve().parents[1] / "mtp_triton"
    named = [str(p.relative_to(package)) for p in package.rglob("*.py") if "mtp_lab" in p.read_text()]
    assert not named, f"package files that name the lab: {named}"
    outside = {m for m, ts in graph.items() if not m.startswith("mtp_lab.bench") and
               any(t.startswith("mtp_lab.bench") for t in ts)}
    assert outside <= {"mtp_lab.demo", "mtp_lab.__main__"}, outside
