"""The least-privilege IAM policy the pipeline needs on S3, per component, for one data root.

Each component gets only the prefixes of the data root it touches (``<root>/`` stands for the data
root's key prefix)::

    ingest    read landing, surveys/, manifest/; write surveys/ (delete: a store is rewritten whole
              after an interrupted ingest) and manifest/ (rows are written once, never deleted)
    train     read surveys/, checkpoints/, registry/ (continue from a registered model);
              write and delete checkpoints/ (old checkpoints are pruned)
    registry  read checkpoints/*/final/ and registry/; write registry/ (versions are claimed with a
              conditional PUT, If-None-Match, which needs only s3:PutObject); list manifest/ (lineage)
    watcher   read landing, manifest/, registry/ (the champion to continue from); write watch/ (lease,
              per-survey state, digest cache) and quarantine/; delete from landing (a quarantined
              file is moved out) and watch/ (the lease). Running the flow itself needs the other
              components too; with ``sfm watch --publish-event`` the watcher role needs only this one.
    demo      write <root>/landing/ (only the embedded demo writes its synthetic surveys there)
    metaflow  read and write Metaflow's datastore root (artifacts, logs, cards), when it is on S3

Listing is granted with ``s3:ListBucket`` limited by ``s3:prefix`` conditions, so a role can list only
the prefixes it may read. HEAD requests are covered by ``s3:GetObject``; multipart uploads by
``s3:PutObject`` plus ``s3:AbortMultipartUpload`` to clean up after a failed one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from sfm.errors import SFMError

COMPONENTS = ("ingest", "train", "registry", "watcher")
OPTIONAL_COMPONENTS = ("demo",)
READ = ("s3:GetObject",)
WRITE = ("s3:PutObject", "s3:AbortMultipartUpload")
DELETE = ("s3:DeleteObject",)
# Managed policies hold at most 6,144 characters (whitespace not counted); inline role policies 10,240.
MANAGED_POLICY_MAX_CHARS = 6144

_VPCE = re.compile(r"^vpce-([0-9a-f]{8}|[0-9a-f]{17})$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
# The watcher's prefixes under the data root (sfm/ops/watch.py writes only there: state_url(), quarantine()).
WATCH_STATE = "watch"
WATCH_QUARANTINE = "quarantine"


@dataclass(frozen=True)
class S3Location:
    """An ``s3://bucket/prefix`` URL split for IAM: ``prefix`` is "" or ends with "/"."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str, what: str) -> "S3Location":
        url = str(url).strip()
        if not url.startswith("s3://"):
            raise SFMError(f"{what} {url!r} is not an s3:// URL; IAM policies cover S3 locations only")
        bucket, _, key = url[len("s3://"):].partition("/")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise SFMError(f"{what} {url!r} does not name a valid S3 bucket; use s3://BUCKET/PREFIX")
        key = key.strip("/")
        if any(ch in key for ch in "*?$") or ".." in key.split("/"):
            raise SFMError(f"{what} {url!r} contains '*', '?', '$' or '..', which IAM would read as wildcards "
                           "or variables; use a plain prefix")
        return cls(bucket, f"{key}/" if key else "")

    def sub(self, *parts: str) -> "S3Location":
        return S3Location(self.bucket, self.prefix + "".join(f"{p.strip('/')}/" for p in parts))


@dataclass
class _Grants:
    """Object actions on key patterns, and listable prefixes, of one component."""

    objects: dict[tuple[str, ...], list[tuple[str, str]]] = field(default_factory=dict)  # actions -> (bucket, pattern)
    lists: dict[str, list[str]] = field(default_factory=dict)  # bucket -> s3:prefix patterns

    def allow(self, actions: tuple[str, ...], loc: S3Location, pattern: str = "*") -> None:
        self.objects.setdefault(actions, []).append((loc.bucket, loc.prefix + pattern))

    def listing(self, loc: S3Location) -> None:
        patterns = self.lists.setdefault(loc.bucket, [])
        wanted = [f"{loc.prefix}*"] if loc.prefix else ["*"]
        if loc.prefix:
            wanted.append(loc.prefix.rstrip("/"))  # "does this folder exist" probes list the bare name
        patterns.extend(p for p in wanted if p not in patterns)


def _grants(component: str, root: S3Location, landing: list[S3Location], metaflow: S3Location | None) -> _Grants:
    g = _Grants()
    surveys, manifest = root.sub("surveys"), root.sub("manifest")
    checkpoints, registry = root.sub("checkpoints"), root.sub("registry")
    if component == "ingest":
        for loc in landing:
            g.allow(READ, loc)
        for loc in (surveys, manifest):
            g.allow(READ, loc)
            g.allow(WRITE, loc)
        g.allow(DELETE, surveys)
        for loc in (*landing, surveys, manifest):
            g.listing(loc)
    elif component == "train":
        for loc in (surveys, checkpoints, registry):
            g.allow(READ, loc)
        g.allow(WRITE, checkpoints)
        g.allow(DELETE, checkpoints)
        for loc in (surveys, checkpoints, registry):
            g.listing(loc)
    elif component == "registry":
        g.allow(READ, checkpoints, "*/final/*")
        g.allow(READ, registry)
        g.allow(WRITE, registry)
        for loc in (registry, manifest):
            g.listing(loc)
    elif component == "watcher":
        state, quarantine = root.sub(WATCH_STATE), root.sub(WATCH_QUARANTINE)
        for loc in (*landing, state, quarantine, manifest, registry):
            g.allow(READ, loc)
            g.listing(loc)
        for loc in (state, quarantine):
            g.allow(WRITE, loc)
        for loc in (*landing, state):  # a quarantined file moves out of landing; the lease is released
            g.allow(DELETE, loc)
    elif component == "demo":
        g.allow(READ, root.sub("landing"))
        g.allow(WRITE, root.sub("landing"))
        g.listing(root.sub("landing"))
    elif component == "metaflow" and metaflow is not None:
        g.allow(READ, metaflow)
        g.allow(WRITE, metaflow)
        g.listing(metaflow)
    return g


def _sid(*words: str) -> str:
    return "Sfm" + "".join(w[:1].upper() + w[1:] for w in words)


_ACTION_WORD = {READ: "Read", WRITE: "Write", DELETE: "Delete"}


def policy(data_root: str, *, landing: list[str] | tuple[str, ...] = (), metaflow_root: str = "",
           components: list[str] | tuple[str, ...] = COMPONENTS, kms_key_arns: list[str] | tuple[str, ...] = (),
           partition: str = "aws", vpce: list[str] | tuple[str, ...] = ()) -> dict:
    """The IAM policy document (a dict ready for ``json.dumps``) for ``components`` on ``data_root``.

    ``landing``: where new SEG-Y arrives (default ``<data_root>/landing``); ``metaflow_root``: Metaflow's
    S3 datastore root (adds the "metaflow" component); ``kms_key_arns``: customer-managed KMS keys of
    SSE-KMS buckets (adds kms:Decrypt and kms:GenerateDataKey on exactly those keys); ``vpce``: VPC endpoint
    ids every S3 grant is limited to (``aws:SourceVpce``), so the role reaches the bucket only from inside
    the VPC (the KMS grant keeps none: S3 itself calls KMS, not through the endpoint).
    """
    root = S3Location.parse(data_root, "--data-root")
    lands = [S3Location.parse(u, "--landing") for u in landing] or [root.sub("landing")]
    meta = S3Location.parse(metaflow_root, "--metaflow-root") if metaflow_root else None
    wanted = list(dict.fromkeys(components))
    unknown = [c for c in wanted if c not in (*COMPONENTS, *OPTIONAL_COMPONENTS, "metaflow")]
    if unknown:
        raise SFMError(f"unknown component {unknown[0]!r}; choose from {', '.join((*COMPONENTS, *OPTIONAL_COMPONENTS))}")
    if meta is not None and "metaflow" not in wanted:
        wanted.append("metaflow")
    arn = f"arn:{partition}:s3:::"
    statements = []
    for component in wanted:
        g = _grants(component, root, lands, meta)
        for actions, resources in g.objects.items():
            statements.append({"Sid": _sid(component, _ACTION_WORD[actions]), "Effect": "Allow",
                               "Action": list(actions),
                               "Resource": sorted({f"{arn}{bucket}/{pattern}" for bucket, pattern in resources})})
        for n, (bucket, prefixes) in enumerate(sorted(g.lists.items())):
            statements.append({"Sid": _sid(component, "List", str(n) if len(g.lists) > 1 else ""),
                               "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"{arn}{bucket}"],
                               "Condition": {"StringLike": {"s3:prefix": sorted(prefixes)}}})
    if vpce:
        ids = vpce_ids(vpce)
        for st in statements:
            st.setdefault("Condition", {})["StringEquals"] = {"aws:SourceVpce": ids}
    if kms_key_arns:
        for key in kms_key_arns:
            if not str(key).startswith(f"arn:{partition}:kms:") or "*" in str(key):
                raise SFMError(f"--kms-key-arn {key!r} is not a KMS key ARN; use arn:{partition}:kms:REGION:ACCOUNT:key/ID")
        statements.append({"Sid": "SfmKmsForSseKms", "Effect": "Allow",
                           "Action": ["kms:Decrypt", "kms:GenerateDataKey"], "Resource": sorted(set(kms_key_arns))})
    return {"Version": "2012-10-17", "Statement": statements}


def vpce_ids(values: list[str] | tuple[str, ...]) -> list[str]:
    """VPC endpoint ids, checked (``vpce-`` and 8 or 17 hex digits), distinct and sorted."""
    for value in values:
        if not _VPCE.match(str(value)):
            raise SFMError(f"--vpce {value!r} is not a VPC endpoint id; use vpce-0123456789abcdef0 "
                           "(aws ec2 describe-vpc-endpoints)")
    return sorted(set(values))


def policy_json(document: dict) -> str:
    return json.dumps(document, indent=2)


def minified_size(document: dict) -> int:
    """Characters IAM counts against a policy's size quota (whitespace excluded)."""
    return len(json.dumps(document, separators=(",", ":")))


__all__ = ["policy", "policy_json", "minified_size", "vpce_ids", "COMPONENTS", "S3Location"]
