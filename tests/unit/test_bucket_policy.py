"""S3 pinned to the VPC (issue 46): ``sfm iam-policy --vpce`` limits every S3 grant of the roles to the VPC
endpoint, and ``--bucket-policy`` refuses requests without TLS or from outside the endpoint. Both documents
are checked against the policy grammar (a JSON Schema of what IAM accepts, for the elements sfm writes),
then evaluated request by request with the evaluator the flow's S3 test uses (tests/support/s3_request_log.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
from support.s3_request_log import Call, allowed, denied

from sfm.errors import SFMError
from sfm.storage import iam
from sfm.storage.bucket_policy import bucket_policy

ROOT = "s3://acme-seismic/sfm"
VPCE = "vpce-0123456789abcdef0"
ADMIN = "arn:aws:iam::123456789012:role/StorageAdmin"
KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"

_ONE_OR_MORE = {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]}
POLICY_GRAMMAR = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object", "required": ["Version", "Statement"], "additionalProperties": False,
    "properties": {
        "Version": {"const": "2012-10-17"},
        "Statement": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["Sid", "Effect", "Action", "Resource"], "additionalProperties": False,
            "properties": {
                "Sid": {"type": "string", "pattern": "^[A-Za-z0-9]+$"},
                "Effect": {"enum": ["Allow", "Deny"]},
                "Principal": {"oneOf": [{"const": "*"}, {"type": "object", "propertyNames": {"enum": ["AWS"]}}]},
                "Action": {**_ONE_OR_MORE, "items": {"type": "string", "pattern": "^(s3|kms):[A-Za-z*]+$"}},
                "Resource": {**_ONE_OR_MORE, "items": {"type": "string", "pattern": "^arn:aws[a-z-]*:(s3|kms):"}},
                "Condition": {
                    "type": "object", "minProperties": 1,
                    "propertyNames": {"enum": ["StringEquals", "StringNotEquals", "StringLike", "StringNotLike",
                                               "ArnLike", "ArnNotLike", "Bool"]},
                    "additionalProperties": {"type": "object", "minProperties": 1,
                                             "additionalProperties": _ONE_OR_MORE},
                },
            },
        }},
    },
}


def check_grammar(document: dict) -> None:
    jsonschema.validate(document, POLICY_GRAMMAR)
    sids = [st["Sid"] for st in document["Statement"]]
    assert len(sids) == len(set(sids)), sids
    assert iam.minified_size(document) <= iam.MANAGED_POLICY_MAX_CHARS


def obj(key: str, action: str = "s3:GetObject", **context) -> Call:
    return Call(action, f"arn:aws:s3:::acme-seismic/{key}", **context)


def listing(prefix: str, **context) -> Call:
    return Call("s3:ListBucket", "arn:aws:s3:::acme-seismic", prefix, **context)


def test_vpce_limits_every_s3_grant_to_the_endpoint():
    plain = iam.policy(ROOT, metaflow_root="s3://acme-seismic/metaflow", kms_key_arns=[KMS_KEY])
    pinned = iam.policy(ROOT, metaflow_root="s3://acme-seismic/metaflow", kms_key_arns=[KMS_KEY], vpce=[VPCE])
    check_grammar(pinned)
    calls = [obj("sfm/surveys/a.zarr/zarr.json"), obj("sfm/checkpoints/R/final/model.safetensors", "s3:PutObject"),
             obj("metaflow/PretrainFlow/data/ab/abcd"), listing("sfm/manifest/rows/"), listing("sfm/surveys/")]
    for call in calls:
        assert allowed(plain, call), call  # what the roles may do ...
        assert allowed(pinned, Call(call.action, call.resource, call.prefix, vpce=VPCE)), call  # ... through it
        assert not allowed(pinned, call), call  # ... and not from outside the VPC
        assert not allowed(pinned, Call(call.action, call.resource, call.prefix, vpce="vpce-0fedcba9876543210")), call
    # the same grants, each with the endpoint condition; S3 calls KMS itself, so the key's grant keeps none
    strip = [{k: v for k, v in st.items() if k != "Condition"} for st in pinned["Statement"]]
    assert strip == [{k: v for k, v in st.items() if k != "Condition"} for st in plain["Statement"]]
    for st in pinned["Statement"]:
        endpoint = st.get("Condition", {}).get("StringEquals", {}).get("aws:SourceVpce")
        assert endpoint == ([VPCE] if st["Action"][0].startswith("s3:") else None), st["Sid"]


def test_bucket_policy_refuses_plain_http_and_requests_from_outside_the_endpoint():
    policy = bucket_policy(ROOT, vpce=[VPCE], exempt_principals=[ADMIN])
    check_grammar(policy)
    role = "arn:aws:iam::123456789012:role/sfm-pipeline"
    for call in (obj("sfm/surveys/a.zarr/zarr.json", principal=role, vpce=VPCE),
                 obj("other/prefix/x", "s3:PutObject", principal=role, vpce=VPCE),
                 listing("", principal=role, vpce=VPCE)):
        assert not denied(policy, call), call  # through the endpoint, over TLS
        assert denied(policy, Call(call.action, call.resource, call.prefix, principal=role)), call  # outside it
        assert denied(policy, Call(call.action, call.resource, call.prefix, principal=role, vpce=VPCE, secure=False))
    # the administrators still reach it from outside the VPC, but never without TLS
    assert not denied(policy, obj("sfm/registry/m/v1/version.json", principal=ADMIN))
    assert denied(policy, obj("sfm/registry/m/v1/version.json", principal=ADMIN, secure=False))
    assert not denied(policy, Call("s3:GetObject", "arn:aws:s3:::another-bucket/x", principal=role))

    tls_only = bucket_policy(ROOT)  # without --vpce: the TLS rule docs/security.md recommends, alone
    check_grammar(tls_only)
    assert [st["Sid"] for st in tls_only["Statement"]] == ["SfmDenyWithoutTls"]
    assert not denied(tls_only, obj("sfm/x", principal=role))
    assert denied(tls_only, obj("sfm/x", principal=role, secure=False))


def test_bad_input_is_one_line():
    with pytest.raises(SFMError, match="not a VPC endpoint id"):
        iam.policy(ROOT, vpce=["vpc-0123456789abcdef0"])
    with pytest.raises(SFMError, match="not an IAM role or user ARN"):
        bucket_policy(ROOT, vpce=[VPCE], exempt_principals=["StorageAdmin"])
    with pytest.raises(SFMError, match="give --vpce too"):
        bucket_policy(ROOT, exempt_principals=[ADMIN])


def test_the_command_line_prints_them():
    def cli(*args: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "sfm.cli", "iam-policy", "--data-root", ROOT, *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    assert cli("--vpce", VPCE) == iam.policy(ROOT, vpce=[VPCE])
    assert cli("--vpce", VPCE, "--bucket-policy", "--exempt-principal", ADMIN) == \
        bucket_policy(ROOT, vpce=[VPCE], exempt_principals=[ADMIN])
