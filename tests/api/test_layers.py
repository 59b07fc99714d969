"""The package's layers (ckptstore/__init__.py's docstring, issue 27): each subpackage imports only the layers
before it, nothing below the facade imports the facade, the command line or an integration, and ``import ckptstore``
loads no trainer and no optional object-store backend."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ckptstore

PKG = Path(ckptstore.__file__).resolve().parent
#: lowest first; a module may import its own layer and those before it
LAYERS = ["util", "storage", "state", "format", "io", "lifecycle", "distributed", "remote", "orchestration",
          "memtier"]
TOP = {"store": len(LAYERS), "cli": len(LAYERS) + 1, "integrations": len(LAYERS) + 1}


def layer_of(dotted: str) -> int:
    """``ckptstore.format.blobs`` -> the index of ``format``; the package itself (its ``__init__``) is the top."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return len(LAYERS) + 2
    head = parts[1]
    if head in LAYERS:
        return LAYERS.index(head)
    assert head in TOP, f"{dotted}: a module outside the layers (add it to a subpackage)"
    return TOP[head]


def imports_of(path: Path):
    """Every ckptstore module ``path`` imports, at the top or inside a function, as absolute dotted names."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ckptstore" or target.startswith("ckptstore."):
                yield mod, target, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ckptstore"):
                    yield mod, a.name, node.lineno


def test_every_module_imports_only_its_own_layer_and_those_before_it():
    """Top-level and function-level imports alike: a lazy import upwards is a cycle all the same."""
    wrong = []
    modules = sorted(PKG.rglob("*.py"))
    assert len(modules) > 40
    for path in modules:
        for mod, target, line in imports_of(path):
            if mod.startswith("ckptstore.integrations."):         # they use the public API, as users do
                if target != "ckptstore":
                    wrong.append(f"{path.relative_to(PKG.parent)}:{line}: {mod} imports {target}, not the public API")
                continue
            if mod == "ckptstore" or target == "ckptstore.util.version":
                continue
            if layer_of(target) > layer_of(mod) or target == "ckptstore":
                wrong.append(f"{path.relative_to(PKG.parent)}:{line}: {mod} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_every_subpackage_says_what_it_owns_and_what_it_may_import():
    for name in LAYERS:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text()))
        assert doc and "Imports:" in doc, name
    listed = ckptstore.__doc__
    for name in LAYERS:
        assert f"    {name}/" in listed, name


def test_import_ckptstore_loads_no_trainer_and_no_optional_backend():
    heavy = ["transformers", "lightning", "pytorch_lightning", "accelerate", "torchtitan", "s3fs", "gcsfs",
             "boto3", "botocore", "aiobotocore", "safetensors", "click", "rich"]
    code = ("import sys, ckptstore; print(','.join(sorted({m.split('.')[0] for m in sys.modules} & set(%r))))"
            % (heavy,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import ckptstore loaded {out}"
