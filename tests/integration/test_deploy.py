"""Deployment to Argo Workflows: `argo-workflows create --only-json` carries the cron schedule and the
new-survey event trigger, both taken from the job config's [retrain] section.

Rendering needs no cluster, but Metaflow insists on what a deployment needs: an S3 datastore (the code
package is uploaded there; here a moto_server on loopback), a Kubernetes namespace, and the Argo Events
event/source/service-account names used by @trigger. The `kubernetes` package must be installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import FLOW

pytest.importorskip("kubernetes", reason="argo-workflows create needs the kubernetes client (test extra)")

ARGO_ENV = {
    "METAFLOW_KUBERNETES_NAMESPACE": "sfm",
    "METAFLOW_ARGO_EVENTS_EVENT": "sfm-events",
    "METAFLOW_ARGO_EVENTS_EVENT_BUS": "default",
    "METAFLOW_ARGO_EVENTS_EVENT_SOURCE": "sfm-webhook",
    "METAFLOW_ARGO_EVENTS_SERVICE_ACCOUNT": "sfm-sensor",
}


@pytest.mark.timeout(600)
def test_argo_workflow_template_carries_schedule_and_event_trigger(tmp_path, metaflow_env, s3_env):
    bucket = s3_env.make_bucket("sfm-argo")
    env = {**os.environ, **metaflow_env, **s3_env.env(), **ARGO_ENV, "METAFLOW_DEFAULT_DATASTORE": "s3",
           "METAFLOW_DATASTORE_SYSROOT_S3": f"{bucket}/metaflow"}
    custom = tmp_path / "custom.toml"
    custom.write_text('[retrain]\nschedule = "30 2 * * 1"\nevent = "surveys-landed"\n')
    commands = {
        "default": [sys.executable, str(FLOW), "--datastore", "s3", "argo-workflows", "create", "--only-json"],
        "custom": [sys.executable, str(FLOW), "--config", "config", str(custom), "--datastore", "s3",
                   "argo-workflows", "create", "--only-json"],
    }
    procs = {name: subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in commands.items()}
    templates = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=540)
        assert proc.returncode == 0, err[-3000:]
        templates[name] = json.loads(out)

    for name, (cron, event) in {"default": ("0 0 ? * SUN", "sfm-new-survey"),
                                "custom": ("30 2 * * 1", "surveys-landed")}.items():
        template = templates[name]
        assert template["kind"] == "WorkflowTemplate"
        annotations = template["metadata"]["annotations"]
        assert json.loads(annotations["metaflow/cron"])["schedule"] == cron, name
        assert json.loads(annotations["metaflow/triggers"]) == [{"name": event, "type": "event"}], name
        parameters = {p["name"] for p in template["spec"]["arguments"]["parameters"]}
        # the event's payload fields map onto these parameters
        assert {"surveys", "held-out", "init-from", "data-root"} <= parameters, parameters
    assert any(k.startswith("metaflow/PretrainFlow/") for k in s3_env.keys("sfm-argo"))  # the code package
