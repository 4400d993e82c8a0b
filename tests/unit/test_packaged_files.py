"""Every file the package reads at run time is inside it (issue 46): the data contracts, the default job
config and the flow `sfm watch` runs, read through importlib.resources, listed in pyproject's package-data.

The data contracts are a real folder of the package (``sfm/data_contracts``, no link); ``sfm/flows/pretrain_flow.py``
links to the documented top-level ``flows/pretrain_flow.py``; the installed-package test
(tests/integration/test_installed_package.py) checks that a built wheel carries the same bytes.
"""

from __future__ import annotations

import ast
import tomllib
from importlib import resources
from pathlib import Path

from sfm.config import DEFAULT_TOML
from sfm.formats.contracts import CONTRACTS_DIR
from sfm.ops.watch import FLOW_FILE

PROJECT = Path(__file__).resolve().parents[2]
SFM = PROJECT / "sfm"


def test_packaged_contracts_are_the_documented_ones():
    packaged = resources.files("sfm") / "data_contracts"
    folder = SFM / "data_contracts"
    assert folder.is_dir() and not folder.is_symlink()  # a real folder: a checkout without links works
    assert not any(p.is_symlink() for p in folder.iterdir())
    assert len(list(folder.glob("*.schema.json"))) >= 5
    assert Path(str(packaged)).resolve() == folder.resolve()
    assert str(CONTRACTS_DIR) == str(packaged)


def test_packaged_flow_is_the_documented_entry_point():
    assert (SFM / "flows" / "pretrain_flow.py").resolve() == PROJECT / "flows" / "pretrain_flow.py"
    assert FLOW_FILE == PROJECT / "flows" / "pretrain_flow.py"  # what `sfm watch` runs from a checkout
    assert DEFAULT_TOML == SFM / "default.toml" and DEFAULT_TOML.is_file()


def test_package_data_carries_every_packaged_file():
    patterns = tomllib.loads((PROJECT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["sfm"]
    carried = {p.resolve() for pattern in patterns for p in SFM.glob(pattern)}
    read_at_run_time = [DEFAULT_TOML, FLOW_FILE, *(SFM / "data_contracts").glob("*.json")]
    assert all(p.resolve() in carried for p in read_at_run_time), sorted(set(read_at_run_time) - carried)


def test_no_module_finds_files_through_its_own_path():
    """``__file__`` and ``parents[...]`` lead outside an installed package; only the code version's git
    lookup (which asks git about the package's own folder) may use them."""
    offenders = []
    for path in sorted(SFM.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "__file__" and path.name != "registry.py":
                offenders.append(f"{path.relative_to(SFM)}:{node.lineno}")
    assert not offenders, offenders
