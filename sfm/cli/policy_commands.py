"""``sfm iam-policy``, ``sfm network-policy``: the S3 and network policies of a deployment."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_iam_policy(args: argparse.Namespace) -> None:
    """Print the least-privilege IAM policy (JSON) for the pipeline's S3 access to one data root, or with
    --bucket-policy the policy of its bucket (TLS only; with --vpce, only through those endpoints)."""
    from sfm.storage import iam

    if args.bucket_policy:
        from sfm.storage.bucket_policy import bucket_policy

        print(iam.policy_json(bucket_policy(args.data_root, vpce=args.vpce or [],
                                            exempt_principals=args.exempt_principal or [], partition=args.partition)))
        return
    components = args.component or [*iam.COMPONENTS, *(["demo"] if args.demo else [])]
    document = iam.policy(args.data_root, landing=args.landing or [], metaflow_root=args.metaflow_root,
                          components=components, kms_key_arns=args.kms_key_arn or [], partition=args.partition,
                          vpce=args.vpce or [])
    print(iam.policy_json(document))
    size = iam.minified_size(document)
    if size > iam.MANAGED_POLICY_MAX_CHARS:
        print(f"sfm iam-policy: {size} characters is over the {iam.MANAGED_POLICY_MAX_CHARS} of a managed policy; "
              "attach it as an inline role policy (10,240) or split it with --component", file=sys.stderr)


def _cmd_network_policy(args: argparse.Namespace) -> None:
    """Print the Kubernetes NetworkPolicy (JSON) of the pretrain step's pods, for `kubectl apply -f`."""
    from sfm.ops.network_policy import network_policy

    print(json.dumps(network_policy(args.namespace, name=args.name, https_cidrs=tuple(args.https_cidr or ["0.0.0.0/0"]),
                                    extra_egress=tuple(args.allow_egress or [])), indent=2))


def add_commands(sub) -> None:
    """iam-policy, network-policy: the S3 and Kubernetes network policies."""
    p = sub.add_parser("iam-policy", help="print the least-privilege IAM policy for a data root on S3")
    p.add_argument("--data-root", required=True, help="s3://bucket/prefix the pipeline writes to")
    p.add_argument("--landing", action="append", help="s3:// prefix new SEG-Y arrives in (repeatable; "
                   "default <data-root>/landing)")
    p.add_argument("--metaflow-root", default="", help="Metaflow's S3 datastore root "
                   "(METAFLOW_DATASTORE_SYSROOT_S3), to grant the flow its artifacts, logs and cards")
    p.add_argument("--component", action="append", choices=["ingest", "train", "registry", "watcher", "demo"],
                   help="only these components (repeatable; default: ingest, train, registry, watcher)")
    p.add_argument("--demo", action="store_true", help="also let the embedded demo write <data-root>/landing")
    p.add_argument("--kms-key-arn", action="append", help="KMS key of an SSE-KMS bucket (repeatable)")
    p.add_argument("--partition", choices=["aws", "aws-cn", "aws-us-gov"], default="aws", help="ARN partition")
    p.add_argument("--vpce", action="append", help="VPC endpoint id (vpce-...) every S3 grant is limited to "
                   "(aws:SourceVpce; repeatable)")
    p.add_argument("--bucket-policy", action="store_true", help="print instead the data root bucket's policy: "
                   "deny requests without TLS and, with --vpce, from outside those endpoints")
    p.add_argument("--exempt-principal", action="append", metavar="ARN", help="with --bucket-policy --vpce: a "
                   "role or user still allowed from outside the endpoints, e.g. the administrators' (repeatable)")
    p.set_defaults(func=_cmd_iam_policy)

    p = sub.add_parser("network-policy", help="print the Kubernetes NetworkPolicy isolating the pretrain pods (EKS)")
    p.add_argument("--namespace", required=True, help="the flow's namespace (METAFLOW_KUBERNETES_NAMESPACE)")
    p.add_argument("--name", default="sfm-pretrain")
    p.add_argument("--https-cidr", action="append", help="where HTTPS may go (repeatable; default 0.0.0.0/0), "
                   "e.g. the ranges of the region's S3 prefix list")
    p.add_argument("--allow-egress", action="append", metavar="CIDR:PORT",
                   help="more egress, e.g. the Metaflow metadata service (repeatable)")
    p.set_defaults(func=_cmd_network_policy)
