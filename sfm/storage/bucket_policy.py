"""The bucket policy that pins a data root's bucket to the VPC, the S3 half of the network isolation the
reference deployed (``sfm iam-policy --bucket-policy``); the roles' half is :func:`sfm.storage.iam.policy`
with ``vpce``.

Two refusals, for every principal, on the whole bucket (keep the pipeline's data in a bucket of its own):

- requests without TLS (``aws:SecureTransport`` false);
- with ``vpce``: requests that do not come through one of those VPC endpoints (``aws:SourceVpce``), except
  from ``exempt_principals`` (``aws:PrincipalArn``): the administrators' roles, and whoever uploads SEG-Y to a
  landing prefix in this bucket from outside the VPC. Without an exemption the bucket, and its policy, can
  then be managed only from inside the VPC.

Apply it with ``aws s3api put-bucket-policy --bucket BUCKET --policy file://bucket-policy.json``.
"""

from __future__ import annotations

import re

from sfm.errors import SFMError
from sfm.storage.iam import S3Location, vpce_ids

_PRINCIPAL = re.compile(r"^arn:[a-z-]+:(iam|sts)::\d{12}:[\w+=,.@/*-]+$")


def bucket_policy(data_root: str, *, vpce: list[str] | tuple[str, ...] = (),
                  exempt_principals: list[str] | tuple[str, ...] = (), partition: str = "aws") -> dict:
    """The bucket policy (a dict ready for ``json.dumps``) of ``data_root``'s bucket."""
    bucket = S3Location.parse(data_root, "--data-root").bucket
    resources = [f"arn:{partition}:s3:::{bucket}", f"arn:{partition}:s3:::{bucket}/*"]
    statements = [{"Sid": "SfmDenyWithoutTls", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
                   "Resource": resources, "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]
    if vpce:
        outside = {"StringNotEquals": {"aws:SourceVpce": vpce_ids(vpce)}}
        if exempt_principals:
            for arn in exempt_principals:
                if not _PRINCIPAL.match(str(arn)):
                    raise SFMError(f"--exempt-principal {arn!r} is not an IAM role or user ARN; use "
                                   f"arn:{partition}:iam::ACCOUNT:role/NAME")
            outside["ArnNotLike"] = {"aws:PrincipalArn": sorted(set(exempt_principals))}
        statements.append({"Sid": "SfmDenyOutsideVpcEndpoint", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
                           "Resource": resources, "Condition": outside})
    elif exempt_principals:
        raise SFMError("--exempt-principal exempts from the VPC endpoint rule: give --vpce too")
    return {"Version": "2012-10-17", "Statement": statements}
