"""How often each Python process a command starts parses a job config (``JobConfig.from_dict``, which every parse
goes through: ``from_toml``, a job file's ``read``, a flow's ``job_of``).

:func:`counting_env` gives the environment: a ``sitecustomize`` on ``PYTHONPATH`` that, in every interpreter that
starts with it (the CLI, the launcher, each rank, each flow task), counts the calls and writes them with the
process's command line when the process exits; :func:`parse_counts` reads them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SITECUSTOMIZE = '''
import atexit, json, os, sys

_folder = os.environ.get("SFM_PARSE_COUNT_DIR")
if _folder:
    from sfm.config import JobConfig

    _parse, _calls = JobConfig.from_dict.__func__, []

    def _counted(cls, data=None):
        _calls.append(1)
        return _parse(cls, data)

    JobConfig.from_dict = classmethod(_counted)

    @atexit.register
    def _write():
        with open(os.path.join(_folder, f"{os.getpid()}.json"), "w") as fh:
            json.dump({"argv": sys.argv, "calls": len(_calls)}, fh)
'''


def counting_env(folder: Path, project: Path) -> dict[str, str]:
    """The variables that make every process started with them count its parses into ``folder``."""
    site, counts = folder / "site", folder / "counts"
    site.mkdir(parents=True)
    counts.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), str(project), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "SFM_PARSE_COUNT_DIR": str(counts)}


def parse_counts(folder: Path) -> list[dict]:
    """{"argv", "calls"} of every process that exited, in no particular order."""
    return [json.loads(p.read_text()) for p in sorted((folder / "counts").glob("*.json"))]
