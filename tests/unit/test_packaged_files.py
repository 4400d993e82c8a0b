"""Every file the package reads at run time is inside it (issues 46, 55): the data contracts, the default and
example job configs and the three flows, read through importlib.resources, listed in pyproject's package-data.

All are real files of the package, no links (sfm/data_contracts/, sfm/configs/, sfm/flows/); the top-level
``flows/NAME_flow.py`` a checkout runs are entry points that subclass the packaged flow classes, with no code of
their own; the installed-package test (tests/integration/test_installed_package.py) checks that a built wheel
carries the same bytes.
"""

from __future__ import annotations

import ast
import tomllib
from importlib import resources
from pathlib import Path

from sfm.config import CONFIGS_DIR, DEFAULT_TOML, config_file
from sfm.flows import FLOWS, flow_file
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


def test_the_flows_are_packaged_files_and_the_checkout_entry_points_hold_no_code():
    assert FLOW_FILE == flow_file("pretrain") == SFM / "flows" / "pretrain_flow.py"  # what `sfm watch` runs
    assert DEFAULT_TOML == SFM / "default.toml" and DEFAULT_TOML.is_file()
    for name in FLOWS:
        packaged, entry = flow_file(name), PROJECT / "flows" / f"{name}_flow.py"
        assert packaged.is_file() and not packaged.is_symlink() and not entry.is_symlink()
        tree = ast.parse(entry.read_text())
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        assert [ast.unparse(b) for b in cls.bases] == [f"{name}_flow.{cls.name}"]  # the packaged class, subclassed
        assert [type(n).__name__ for n in cls.body] == ["Pass"]  # ... and nothing added
        assert "step" not in entry.read_text() and "Parameter" not in entry.read_text()


def test_a_config_is_named_by_its_file_or_its_packaged_name():
    assert CONFIGS_DIR == SFM / "configs" and not CONFIGS_DIR.is_symlink()
    assert {p.stem for p in CONFIGS_DIR.glob("*.toml")} >= {"quality_cpu", "hyperpod_p5en"}
    assert config_file("quality_cpu") == config_file("quality_cpu.toml") == CONFIGS_DIR / "quality_cpu.toml"
    assert config_file("default") == DEFAULT_TOML
    assert config_file(str(DEFAULT_TOML)) == DEFAULT_TOML  # a file that exists is itself
    assert config_file("no_such_config") == Path("no_such_config")  # left for the reader to refuse
    assert config_file("somewhere/quality_cpu.toml") == Path("somewhere/quality_cpu.toml")  # a path is never a name


def test_package_data_carries_every_packaged_file():
    patterns = tomllib.loads((PROJECT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["sfm"]
    carried = {p.resolve() for pattern in patterns for p in SFM.glob(pattern)}
    read_at_run_time = [DEFAULT_TOML, *CONFIGS_DIR.glob("*.toml"), *(SFM / "data_contracts").glob("*.json")]
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
