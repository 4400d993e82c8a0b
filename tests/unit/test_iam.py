"""``sfm iam-policy``: the least-privilege policy per component, checked with the policy evaluator the
flow test uses (tests/s3_request_log.py), so both the policy and the evaluator can fail here.

The check against the S3 calls a real run makes is in tests/test_leaks_flow_s3.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.s3_request_log import Call, Request, allowed, s3_calls

from sfm.storage import iam
from sfm.errors import SFMError

ROOT = "s3://acme-seismic/sfm"


def obj(key: str, action: str = "s3:GetObject", bucket: str = "acme-seismic") -> Call:
    return Call(action, f"arn:aws:s3:::{bucket}/{key}")


def listing(prefix: str, bucket: str = "acme-seismic") -> Call:
    return Call("s3:ListBucket", f"arn:aws:s3:::{bucket}", prefix)


def test_each_component_gets_only_its_prefixes_and_actions():
    ingest = iam.policy(ROOT, components=["ingest"])
    train = iam.policy(ROOT, components=["train"])
    registry = iam.policy(ROOT, components=["registry"])
    # ingest: read landing, write surveys and manifest rows; never checkpoints or the registry
    assert allowed(ingest, obj("sfm/landing/a.sgy"))
    assert allowed(ingest, obj("sfm/surveys/0123.zarr/amplitude/c/0/0/0", "s3:PutObject"))
    assert allowed(ingest, obj("sfm/surveys/0123.zarr/zarr.json", "s3:DeleteObject"))
    assert allowed(ingest, obj("sfm/manifest/rows/0123.parquet", "s3:PutObject"))
    assert not allowed(ingest, obj("sfm/manifest/rows/0123.parquet", "s3:DeleteObject"))  # rows are immutable
    assert not allowed(ingest, obj("sfm/landing/a.sgy", "s3:PutObject"))
    assert not allowed(ingest, obj("sfm/checkpoints/R/final/model.safetensors"))
    assert not allowed(ingest, obj("sfm/registry/m/v1/version.json", "s3:PutObject"))
    assert allowed(ingest, listing("sfm/manifest/rows/")) and not allowed(ingest, listing("sfm/checkpoints/"))
    # train: read surveys, own checkpoints (write, prune); never the manifest or the registry's writes
    assert allowed(train, obj("sfm/checkpoints/R/ckpt/step-000050/optimizer.pt", "s3:DeleteObject"))
    assert allowed(train, obj("sfm/registry/m/v3/model.safetensors"))  # continue from a registered model
    assert not allowed(train, obj("sfm/registry/m/v3/model.safetensors", "s3:PutObject"))
    assert not allowed(train, obj("sfm/surveys/a.zarr/zarr.json", "s3:PutObject"))
    assert not allowed(train, obj("sfm/landing/a.sgy"))
    # registry: read only the final exports of runs; write versions, delete nothing
    assert allowed(registry, obj("sfm/checkpoints/PretrainFlow-7/final/model.safetensors"))
    assert not allowed(registry, obj("sfm/checkpoints/PretrainFlow-7/ckpt/step-000050/model.safetensors"))
    assert allowed(registry, obj("sfm/registry/sfm-mae/v2/.claim", "s3:PutObject"))
    assert not any(allowed(registry, obj(f"sfm/{area}/x", "s3:DeleteObject"))
                   for area in ("registry", "checkpoints", "surveys"))
    assert allowed(registry, listing("sfm/manifest/rows/"))


def test_policy_is_scoped_to_the_bucket_and_prefix():
    everything = iam.policy(ROOT, metaflow_root="s3://acme-seismic/metaflow", components=[*iam.COMPONENTS, "demo"])
    near_misses = [obj("sfm/surveys/x", bucket="acme-seismic-other"), obj("sfm2/surveys/x"), obj("sfmx/surveys/x"),
                   obj("surveys/x"), obj("other/sfm/surveys/x"), obj("sfm/secrets.txt"), obj("metaflow2/x"),
                   listing("sfm/"), listing(""), listing("sfm"), listing("sfm/surveys/", bucket="acme-seismic-other"),
                   listing("sfmx/surveys/"), Call("s3:GetObject", "arn:aws:s3:::acme-seismic"),
                   Call("s3:DeleteBucket", "arn:aws:s3:::acme-seismic"), obj("sfm/surveys/x", "s3:PutObjectAcl"),
                   obj("sfm/surveys/x", "s3:GetObjectTagging"), obj("sfm/registry/m/v1/x", "s3:PutBucketPolicy")]
    assert not [str(c) for c in near_misses if allowed(everything, c)]
    actions = {a for st in everything["Statement"] for a in st["Action"]}
    assert actions == {"s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload", "s3:DeleteObject", "s3:ListBucket"}
    assert len({st["Sid"] for st in everything["Statement"]}) == len(everything["Statement"])
    assert iam.minified_size(everything) < iam.MANAGED_POLICY_MAX_CHARS


def test_bucket_root_separate_landing_watcher_and_kms():
    doc = iam.policy("s3://acme-seismic", landing=["s3://acme-raw/incoming/"],
                     kms_key_arns=["arn:aws:kms:us-east-1:111122223333:key/abcd"])
    assert allowed(doc, obj("surveys/a.zarr/zarr.json", "s3:PutObject"))
    assert allowed(doc, obj("incoming/new.sgy", bucket="acme-raw"))
    assert allowed(doc, listing("incoming/", bucket="acme-raw"))
    assert not allowed(doc, listing("surveys/", bucket="acme-raw"))  # each bucket lists only its own prefixes
    assert not allowed(doc, obj("other/new.sgy", bucket="acme-raw"))
    assert not allowed(doc, obj("landing/new.sgy"))  # the landing is elsewhere now
    assert allowed(doc, obj("incoming/bad.sgy", "s3:DeleteObject", bucket="acme-raw"))  # watcher moves it out
    assert allowed(doc, obj("quarantine/0123-bad.sgy", "s3:PutObject"))
    assert allowed(doc, obj("watch/lock.json", "s3:DeleteObject"))
    kms = [st for st in doc["Statement"] if st["Sid"] == "SfmKmsForSseKms"]
    assert kms and kms[0]["Resource"] == ["arn:aws:kms:us-east-1:111122223333:key/abcd"]


@pytest.mark.parametrize("root,why", [("/local/path", "not an s3:// URL"), ("s3://Bad_Bucket/x", "valid S3 bucket"),
                                      ("s3://acme-data/sfm/*", "wildcards"), ("s3://acme-data/a/../b", "wildcards")])
def test_bad_data_roots_are_refused(root, why):
    with pytest.raises(SFMError, match=why):
        iam.policy(root)


def test_request_to_action_mapping():
    def req(method: str, path: str, query: dict | None = None, headers: dict | None = None, body: bytes = b""):
        return s3_calls(Request(0.0, method, path, {k: [v] for k, v in (query or {}).items()}, headers or {}, body))

    assert [str(c) for c in req("HEAD", "/b/k%20x")] == ["s3:GetObject arn:aws:s3:::b/k x"]
    assert req("GET", "/b", {"list-type": "2", "prefix": "d/s/"})[0].prefix == "d/s/"
    assert req("POST", "/b/k", {"uploads": ""})[0].action == "s3:PutObject"
    assert req("DELETE", "/b/k", {"uploadId": "1"})[0].action == "s3:AbortMultipartUpload"
    copy = req("PUT", "/b/dst", headers={"x-amz-copy-source": "/b/src"})
    assert [c.action for c in copy] == ["s3:PutObject", "s3:GetObject"] and copy[1].resource.endswith("b/src")
    body = b"<Delete><Object><Key>d/a</Key></Object><Object><Key>d/b</Key></Object></Delete>"
    assert [c.resource for c in req("POST", "/b", {"delete": ""}, body=body)] == ["arn:aws:s3:::b/d/a",
                                                                                 "arn:aws:s3:::b/d/b"]
    assert req("PUT", "/b/k", {"acl": ""})[0].action.startswith("s3:UNKNOWN")  # unknown kinds are never allowed
    presigned = {"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": "k/20261130/us-east-1/s3/aws4_request",
                 "X-Amz-Date": "20261130T000000Z", "X-Amz-Expires": "3600", "X-Amz-SignedHeaders": "host",
                 "X-Amz-Signature": "0" * 64}
    assert [str(c) for c in req("GET", "/b/d/k", presigned)] == ["s3:GetObject arn:aws:s3:::b/d/k"]
    assert req("GET", "/b/d/k", {**presigned, "acl": ""})[0].action.startswith("s3:UNKNOWN")


def test_cli_prints_the_policy_and_refuses_bad_input():
    proc = subprocess.run([sys.executable, "-m", "sfm.cli", "iam-policy", "--data-root", ROOT, "--landing",
                           "s3://acme-raw/in", "--metaflow-root", "s3://acme-seismic/metaflow", "--demo"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == iam.policy(ROOT, landing=["s3://acme-raw/in"], metaflow_root="s3://acme-seismic/metaflow",
                             components=[*iam.COMPONENTS, "demo"])
    assert allowed(doc, obj("metaflow/PretrainFlow/data/ab/abcdef", "s3:PutObject"))
    bad = subprocess.run([sys.executable, "-m", "sfm.cli", "iam-policy", "--data-root", "./sfm_data"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == ("sfm iam-policy: error: --data-root './sfm_data' is not an s3:// URL; "
                                  "IAM policies cover S3 locations only")
