"""The package stays readable (issue 16's layout): few top-level modules, short modules and functions,
every S3 client built in one module, no private torch API imported at module load."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SFM = Path(__file__).resolve().parents[2] / "sfm"
MODULES = sorted(SFM.rglob("*.py"))


def test_top_level_holds_at_most_six_modules_besides_the_subpackages():
    top = [p.name for p in SFM.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 6, top


def test_no_module_over_500_lines_and_no_function_over_80():
    long_modules = {str(p.relative_to(SFM)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 500}
    long_functions = [f"{p.relative_to(SFM)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
                      for p in MODULES for node in ast.walk(ast.parse(p.read_text()))
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.end_lineno - node.lineno + 1 > 80]
    assert not long_modules and not long_functions, (long_modules, long_functions)


# what constructs an S3 client, and the one module allowed to
CLIENT_CONSTRUCTORS = re.compile(r"boto3\.client\(|\.create_client\(|S3FileSystem\(|fsspec\.filesystem\(\"s3\"|"
                                 r"S3Store\(|S3RangeReader\(")


def test_s3_clients_are_built_in_storage_clients_only():
    builders = {str(p.relative_to(SFM)) for p in MODULES
                if CLIENT_CONSTRUCTORS.search(re.sub(r'""".*?"""', "", p.read_text(), flags=re.S))}
    assert builders == {"storage/clients.py"}, builders


def test_no_private_torch_module_is_imported_at_module_load():
    offenders = []
    for p in MODULES:
        if p.name == "gloo_overlap.py":  # loaded only behind the guard in strategies.apply_strategy
            continue
        for node in ast.parse(p.read_text()).body:  # module level only; lazy imports inside functions are fine
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{p.relative_to(SFM)}: {n}" for n in names
                          if n.startswith("torch") and any(part.startswith("_") for part in n.split("."))]
    assert not offenders, offenders


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (1 if names and names[0].arg in ("self", "cls") else 0)


def test_no_function_takes_more_than_eight_parameters():
    """Related settings travel as the config section (or one small object) they come from (issue 47)."""
    wide = [f"{p.relative_to(SFM)}:{node.name} ({_parameters(node)})" for p in MODULES
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > 8]
    assert not wide, wide


def test_no_module_imports_a_private_name_of_another():
    private = [f"{p.relative_to(SFM)}: from {node.module} import {alias.name}" for p in MODULES
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sfm")
               for alias in node.names if alias.name.startswith("_")]
    assert not private, private


def test_the_config_imports_no_layer_above_it():
    for module in SFM.glob("config*.py"):
        tree = ast.parse(module.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | \
            {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not {m for m in imported if m.startswith("sfm.") and m.partition(".")[2].partition(".")[0] not in
                    ("config", "config_values", "config_downstream", "errors")}, (module.name, imported)


def test_one_rule_says_which_errors_are_worth_retrying():
    rules = [f"{p.relative_to(SFM)}:{node.name}" for p in MODULES for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "transient" in node.name]
    assert rules == ["storage/retry.py:is_transient"], rules
