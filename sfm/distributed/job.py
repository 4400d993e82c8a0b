"""The jobs a node launches, typed: :class:`NodeLaunch` (where the node sits in the job), :class:`JobFile` (a job
its ranks read from a JSON file) and pretraining's :class:`TrainJob` (fine-tuning's is
:class:`sfm.finetune.job.FinetuneJob`).

A job's config is parsed once per process, where the process starts (a flow task's ``job_of``, ``sfm train``, a
rank reading its job file with :meth:`JobFile.read`); from there the typed job is passed, never a dict.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from sfm import storage
from sfm.config import JobConfig
from sfm.errors import SFMError


@dataclass(frozen=True)
class NodeLaunch:
    """Where this node sits in the job: ``nodes`` x ``procs_per_node`` processes (the job's ``[dist]``, whose
    :meth:`sfm.config.DistConfig.check` refuses counts under 1), this node's index, and the rendezvous."""

    nodes: int
    procs_per_node: int
    node_rank: int
    main_addr: str
    main_port: int

    def check(self, run_root: str) -> None:
        """This node's index and rendezvous valid, and ``run_root`` reachable from every node, or SFMError."""
        if not 0 <= self.node_rank < self.nodes:
            raise SFMError(f"--node-rank {self.node_rank} is outside 0..{self.nodes - 1}; pass this node's index")
        if not 0 < self.main_port < 65536:
            raise SFMError(f"--main-port {self.main_port} is not a TCP port; pick one in 1024..65535")
        if self.nodes > 1 and not (storage.is_s3(run_root) or run_root.startswith("/")):
            raise SFMError(f"--run-root {run_root} must be shared by all {self.nodes} nodes: an s3:// URL or an "
                           "absolute path on a shared filesystem (e.g. /fsx/...)")


class JobFile:
    """A job a node launches (:func:`sfm.distributed.launch.run_node`) and each of its ranks reads from a JSON file,
    ``python -m <module> JOB.json``: its resolved config and run root, and its file. A subclass (a dataclass) says
    what the file holds: ``to_dict``, and ``from_dict``, which reads it back to an equal job."""

    module: ClassVar[str]  # what each rank runs
    config: JobConfig
    run_root: str

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def read(cls, path: str) -> Self:
        """The job in the job file at ``path`` (a rank's entry: the one parse of its config)."""
        with open(path) as fh:
            return cls.from_dict(json.load(fh))


@dataclass
class TrainJob(JobFile):
    """What every rank of a pretraining run reads (``python -m sfm.train.trainer JOB.json``): the resolved config,
    the survey stores it trains on, and the run root all its state lives under."""

    config: JobConfig
    surveys: list[str] = field(default_factory=list)
    run_root: str = ""
    module: ClassVar[str] = "sfm.train.trainer"

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "surveys": list(self.surveys), "run_root": self.run_root}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainJob":
        return cls(JobConfig.from_dict(data.get("config")), list(data["surveys"]), data["run_root"])


def node_job(cfg: JobConfig, surveys: list[str], run_root: str, node: NodeLaunch) -> TrainJob:
    """The job this node's processes train: a copy of ``cfg`` sized to the launch's nodes x processes and checked,
    the survey stores, the run root."""
    cfg = copy.deepcopy(cfg)
    cfg.set("dist.nodes", node.nodes)
    cfg.set("dist.procs_per_node", node.procs_per_node)
    cfg.validate()
    node.check(run_root)
    from sfm.model import model_config_for

    model_config_for(cfg)  # the model layer's check: the preset makes a model at the job's crop and masking
    return TrainJob(cfg, list(surveys), run_root)
