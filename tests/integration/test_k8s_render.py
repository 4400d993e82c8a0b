"""HyperPod EKS: the flow rendered offline for Argo Workflows on Kubernetes.

``python flows/pretrain_flow.py --with kubernetes argo-workflows create --only-json`` compiles the
deployment without a cluster (the code package goes to an S3 datastore on a loopback moto_server).
The ``@parallel`` pretrain step must come out as a JobSet of 1 control + (nodes - 1) worker pods,
with the node count, resources, placement and NCCL/EFA environment of the job config's ``[cluster]``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from conftest import FLOW, PROJECT
from sfm.ops.cluster import EFA_ENV, EFA_RESOURCE, INSTANCE_TYPE_LABEL, kubernetes_options, node_environment, pod_resources
from sfm.errors import SFMError
from sfm.ops.network_policy import network_policy

P5EN = PROJECT / "sfm" / "configs" / "hyperpod_p5en.toml"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sfm:0.1.0"  # what deploy/Dockerfile builds, in ECR


def render(s3_server, tmp_path, *args: str) -> dict:
    s3_server.make_bucket("sfm-k8s-render")
    env = {**os.environ, **s3_server.env(),
           "METAFLOW_USER": "sfm-test", "METAFLOW_HOME": str(tmp_path / "mfhome"),
           "METAFLOW_DEFAULT_DATASTORE": "s3", "METAFLOW_DATASTORE_SYSROOT_S3": "s3://sfm-k8s-render/metaflow",
           "METAFLOW_DEFAULT_METADATA": "local", "METAFLOW_KUBERNETES_NAMESPACE": "sfm-train",
           "METAFLOW_KUBERNETES_CONTAINER_IMAGE": "registry.example/sfm:test",
           # @trigger needs an Argo Events bus to compile against
           "METAFLOW_ARGO_EVENTS_EVENT": "sfm-events", "METAFLOW_ARGO_EVENTS_EVENT_BUS": "default",
           "METAFLOW_ARGO_EVENTS_EVENT_SOURCE": "sfm-source", "METAFLOW_ARGO_EVENTS_SERVICE_ACCOUNT": "sfm-events"}
    proc = subprocess.run([sys.executable, str(FLOW), *args, "argo-workflows", "create", "--only-json"],
                          cwd=PROJECT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def jobset_of(template: dict) -> dict:
    """The JobSet manifest (YAML) of a @parallel step's resource template; Argo expressions such as
    ``replicas: {{=asInt(...)}}`` are left unquoted by Metaflow, so quote them for the YAML parser."""
    text = re.sub(r": (\{\{[^\n]*\}\})$", r": '\1'", template["resource"]["manifest"], flags=re.M)
    return yaml.safe_load(text)


@pytest.mark.timeout(300)
def test_pretrain_step_renders_as_multi_node_jobset(s3_server, tmp_path):
    config = tmp_path / "p5en.toml"  # the example config, with its [cluster] image set
    config.write_text(P5EN.read_text().replace('image = ""', f'image = "{IMAGE}"', 1))
    cluster = tomllib.loads(config.read_text())
    assert cluster["cluster"]["image"] == IMAGE
    wt = render(s3_server, tmp_path, "--config", "config", str(config),
                "--with", "kubernetes:node_selector=team=seismic")
    assert wt["kind"] == "WorkflowTemplate"
    templates = {t["name"]: t for t in wt["spec"]["templates"]}

    # the node count: the flow's --nodes defaults to the config's [dist] nodes ...
    params = {p["name"]: p["value"] for p in wt["spec"]["arguments"]["parameters"]}
    assert params["nodes"] == str(cluster["dist"]["nodes"]) == "16"
    assert params["procs-per-node"] == "8"
    # ... launch emits it as num-parallel, and the pretrain JobSet gets num-parallel - 1 workers
    assert "/mnt/out/num_parallel" in json.dumps(templates["launch"]["outputs"])
    fanout = next(t for t in templates.values() if "dag" in t and any(x["name"] == "pretrain" for x in t["dag"]["tasks"]))
    task = next(x for x in fanout["dag"]["tasks"] if x["name"] == "pretrain")
    args = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
    assert "sub(sprig.int(inputs.parameters['num-parallel']),1)" in args["workerCount"]
    top = templates["PretrainFlow"]["dag"]["tasks"]
    to_fanout = next(x for x in top if x["template"] == fanout["name"])
    assert {"name": "num-parallel", "value": "{{tasks.launch.outputs.parameters.num-parallel}}"} in \
        to_fanout["arguments"]["parameters"]

    pretrain = templates["pretrain"]
    assert pretrain["resource"]["action"] == "create"
    assert pretrain["resource"]["successCondition"] == "status.terminalState == Completed"
    jobset = jobset_of(pretrain)
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/") and jobset["kind"] == "JobSet"
    jobs = {j["name"]: j for j in jobset["spec"]["replicatedJobs"]}
    assert jobs["control"]["replicas"] == 1
    assert jobs["worker"]["replicas"] == "{{=asInt(inputs.parameters.workerCount)}}"

    resources = pod_resources(cluster)
    for job in jobs.values():
        pod = job["template"]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == IMAGE  # [cluster] image; the other steps keep Metaflow's default image
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert limits["nvidia.com/gpu"] == "8" == str(resources["gpu"])
        assert limits[EFA_RESOURCE] == requests[EFA_RESOURCE] == "16"
        assert float(requests["cpu"]) == resources["cpu"] == 176
        assert requests["memory"].startswith(str(resources["memory"]))
        # placement: the config's instance type plus the command line's own label
        assert pod["nodeSelector"] == {INSTANCE_TYPE_LABEL: "ml.p5en.48xlarge", "team": "seismic"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert shm and shm[0]["emptyDir"]["sizeLimit"] == "65536Mi"
        env = {e["name"]: e.get("value") for e in container["env"]}
        for key, value in {**EFA_ENV, "NCCL_DEBUG": "WARN"}.items():
            assert env[key] == value, key
        assert env["MF_WORLD_SIZE"] == "{{inputs.parameters.num-parallel}}"
        assert "-control-0-0." in env["MF_MASTER_ADDR"]  # every node rendezvouses at the control pod
        # the NetworkPolicy `sfm network-policy` renders for the namespace selects these pods (issue 46)
        meta = job["template"]["spec"]["template"]["metadata"]
        policy = network_policy(meta["namespace"])
        assert policy["metadata"]["namespace"] == "sfm-train"
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= meta["labels"].items()

    # the other steps stay on ordinary nodes: no GPUs, no instance type, no EFA environment
    for name in ("start", "ingest", "launch", "evaluate"):
        t = templates[name]
        assert t["nodeSelector"] == {"team": "seismic"}, name
        assert t["container"]["image"] == "registry.example/sfm:test", name
        assert "nvidia.com/gpu" not in json.dumps(t["container"]["resources"]), name
        assert not {e["name"] for e in t["container"]["env"]} & set(EFA_ENV), name


def test_default_cluster_section_sets_nothing():
    assert node_environment({}) == {}
    assert kubernetes_options({}) == {}
    assert pod_resources({}) == {"cpu": 1, "memory": 4096, "disk": 10240, "gpu": None, "shared_memory": None}


def test_cluster_section_parsing():
    config = {"cluster": {"node_selector": "a=1, b = 2", "tolerations": "dedicated=train:NoExecute,x:NoSchedule",
                          "env": "NCCL_DEBUG=INFO,X=a=b"}}
    opts = kubernetes_options(config)
    assert opts["node_selector"] == {"a": "1", "b": "2"}
    assert opts["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoExecute"},
                                   {"key": "x", "operator": "Exists", "effect": "NoSchedule"}]
    assert node_environment(config) == {"NCCL_DEBUG": "INFO", "X": "a=b"}
    with pytest.raises(SFMError, match="cluster.tolerations"):
        kubernetes_options({"cluster": {"tolerations": "nvidia.com/gpu"}})
    with pytest.raises(SFMError, match="cluster.env"):
        node_environment({"cluster": {"env": "NCCL_DEBUG"}})
