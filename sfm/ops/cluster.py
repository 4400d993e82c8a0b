"""What the pretrain step's nodes ask of a cluster, read from the job config's ``[cluster]`` section.

One source for both cluster engines:

- HyperPod EKS (``sfm flow pretrain --with kubernetes run``): the flow's ``pretrain`` step
  takes :func:`pod_resources` through ``@resources``, :func:`node_environment` through
  ``@environment`` and, only when it runs on Kubernetes, :class:`kubernetes_placement` adds the node
  selector (instance type), tolerations, image and EFA devices to its ``@kubernetes`` decorator.
  Metaflow runs the ``@parallel`` step as a JobSet: one control pod plus ``nodes - 1`` worker pods.
- HyperPod Slurm (``sfm slurm-script``): the sbatch script exports :func:`node_environment` on
  every node (see sfm/ops/slurm.py).

Nothing here matters for local runs: ``@resources`` is ignored there and the default ``[cluster]``
sets no environment.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from metaflow import StepMutator
from metaflow.user_decorators.mutable_step import MutableStep

from sfm.config import ClusterConfig, JobConfig
from sfm.errors import SFMError
from sfm.ops.network_policy import POD_LABELS

# libfabric + aws-ofi-nccl settings for NCCL over EFA (AWS "Get started with EFA and NCCL"); the
# image must carry the EFA installer's libfabric and the aws-ofi-nccl plugin (docs/cluster.md).
EFA_ENV = {
    "FI_PROVIDER": "efa",  # NCCL's inter-node traffic over EFA, not TCP sockets
    "FI_EFA_USE_DEVICE_RDMA": "1",  # GPUDirect RDMA on p4d/p5/p5en
    "FI_EFA_FORK_SAFE": "1",  # DataLoader workers fork after libfabric is loaded
    "NCCL_SOCKET_IFNAME": "^lo,docker,veth",  # NCCL's bootstrap on the host network, never loopback
}
EFA_RESOURCE = "vpc.amazonaws.com/efa"  # the EFA device plugin's extended resource
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def job_of(config: Any) -> JobConfig:
    """The JobConfig of a TOML dict or Metaflow ConfigValue, defaults filled: what a flow's config expressions
    (its parameters' defaults, its decorators' arguments) and its ``start`` read. Metaflow evaluates those in every
    process of a run, so each process parses a config once (:func:`_parsed`); every call gets its own copy."""
    return copy.deepcopy(_parsed(json.dumps(dict(config or {}), sort_keys=True, default=str)))


# what a flow reads from its config when it is built (decorators: resources, environment, placement, schedule,
# trigger), before any parameter: ``--set`` cannot reach it, so it is refused there
BUILD_TIME_SECTIONS = ("cluster", "retrain")
SET_HELP = ("config keys set on top of the config and the parameters: section.key=value, several separated by ';' "
            "(e.g. 'train.lr=1e-3;data.batch_size=4'; sfm flow also joins a repeated --set); [cluster] and [retrain] "
            "only in the --config file")


def flow_job(config: Any, overrides: str = "", **named: Any) -> JobConfig:
    """The job a flow's ``start`` makes: its config (:func:`job_of`) with its named parameters, then its ``--set``
    (``overrides``: ``section.key=value`` items separated by ``;``) on top (:meth:`JobConfig.override`). A
    ``--set`` of a section the flow reads when it is built (:data:`BUILD_TIME_SECTIONS`) is refused: it belongs in
    the ``--config`` file. Nothing is checked here (the flow's start validates)."""
    from sfm.config_values import split_assignments

    for item in split_assignments(overrides):
        if item.partition(".")[0].strip() in BUILD_TIME_SECTIONS:
            raise SFMError(f"--set {item}: [{item.partition('.')[0].strip()}] is read when the flow is built, before "
                           "--set; put it in the --config config FILE")
    return job_of(config).override(overrides, **named)


@functools.lru_cache(maxsize=4)
def _parsed(config_json: str) -> JobConfig:
    return JobConfig.from_dict(json.loads(config_json))


def cluster_of(config: Any) -> ClusterConfig:
    return job_of(config).cluster


def pod_resources(config: Any) -> dict[str, int | None]:
    """``@resources`` arguments of one training node (None: Metaflow's default)."""
    c = cluster_of(config)
    return {"cpu": c.cpu, "memory": c.memory_mb, "disk": c.disk_mb, "gpu": c.gpu or None,
            "shared_memory": c.shared_memory_mb or None}


def node_environment(config: Any) -> dict[str, str]:
    """Environment of every training process: the EFA settings when the nodes have EFA, then ``env``."""
    c = config if isinstance(config, ClusterConfig) else cluster_of(config)
    env = dict(EFA_ENV) if c.efa > 0 else {}
    env.update(_pairs(c.env, "cluster.env"))
    return env


def kubernetes_options(config: Any) -> dict[str, Any]:
    """``@kubernetes`` arguments that place the training pods: only what ``[cluster]`` sets."""
    c = cluster_of(config)
    options: dict[str, Any] = {}
    selector = _pairs(c.node_selector, "cluster.node_selector")
    if c.instance_type:
        selector[INSTANCE_TYPE_LABEL] = c.instance_type
    if selector:
        options["node_selector"] = selector
    if c.tolerations:
        options["tolerations"] = _tolerations(c.tolerations)
    if c.image:
        options["image"] = c.image
    if c.efa > 0:
        options["extended_resources"] = {EFA_RESOURCE: str(c.efa)}
    return options


class kubernetes_placement(StepMutator):
    """On Kubernetes only (the step has ``@kubernetes``, e.g. from ``--with kubernetes``), add
    :func:`kubernetes_options` to it, and the pod labels the pretrain NetworkPolicy selects
    (:data:`sfm.ops.network_policy.POD_LABELS`); what the command line set explicitly wins. Elsewhere a no-op,
    so local runs and other steps stay where they are."""

    def mutate(self, mutable_step: MutableStep) -> None:
        specs = mutable_step.get_decorator_specs("kubernetes")
        if not specs:
            return
        config = dict(next((value for name, value in mutable_step.flow.configs if name == "config"), {}))
        current = specs[0][3]
        merged = dict(current)
        for key, value in kubernetes_options(config).items():
            if isinstance(value, dict):  # selector labels / extended resources: union, command line wins
                merged[key] = {**value, **_as_dict(current.get(key))}
            elif not current.get(key):
                merged[key] = value
        merged["labels"] = {**POD_LABELS, **_as_dict(current.get("labels"))}  # what `sfm network-policy` selects
        mutable_step.add_decorator("kubernetes", deco_kwargs=merged, duplicates=MutableStep.OVERRIDE)


def _as_dict(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return _pairs(value, "@kubernetes node_selector")
    return dict(value or {})


def _pairs(text: str, key: str) -> dict[str, str]:
    """``"A=1,B=2"`` -> {"A": "1", "B": "2"}."""
    out = {}
    for item in filter(None, (part.strip() for part in str(text or "").split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SFMError(f"config {key} entry {item!r} is not NAME=VALUE; write e.g. {key.split('.')[-1]} = \"A=1,B=2\"")
        out[name.strip()] = value.strip()
    return out


def _tolerations(text: str) -> list[dict[str, str]]:
    """``"nvidia.com/gpu:NoSchedule,team=ml:NoExecute"`` -> Kubernetes toleration dicts."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, sep, effect = item.rpartition(":")
        if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise SFMError(f"config cluster.tolerations entry {item!r} must look like key[=value]:Effect with "
                           "Effect NoSchedule, PreferNoSchedule or NoExecute")
        key, eq, value = spec.partition("=")
        out.append({"key": key, "operator": "Equal", "value": value, "effect": effect} if eq
                   else {"key": key, "operator": "Exists", "effect": effect})
    return out
