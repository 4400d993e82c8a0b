"""Network isolation of the pretrain step on HyperPod EKS: the Kubernetes NetworkPolicy deployed with the
flow (``sfm network-policy``), selecting the pods of the pretrain JobSet by the labels the flow gives them
(:data:`POD_LABELS`, added to the step's ``@kubernetes`` by :class:`sfm.ops.cluster.kubernetes_placement`).

What the training pods may do, and nothing else:

- accept from, and open to, the other pods of the pretrain step: torchrun's rendezvous port
  (:data:`sfm.distributed.launch.RENDEZVOUS_PORTS`) and the ports NCCL and gloo listen on, which they bind
  to port 0: the kernel's ephemeral range (:data:`EPHEMERAL_PORTS`, Linux's default). NCCL's RDMA traffic
  over EFA does not pass through the pod network; the nodes' security group governs it
  (deploy/hyperpod-security-group.yaml);
- ask the cluster DNS (kube-dns in kube-system, UDP and TCP 53): the workers find the control pod by its
  JobSet host name;
- HTTPS (TCP 443): S3 through the VPC's gateway endpoint (``sfm iam-policy --vpce`` ties the role and the
  bucket to it), STS and the other AWS APIs; ``https_cidrs`` narrows it, e.g. to the S3 prefix list's ranges;
- fetch the pod role's credentials from the EKS Pod Identity agent (:data:`POD_IDENTITY_AGENT`, TCP 80);
- anything in ``extra_egress`` (e.g. the Metaflow metadata service's address and port).

A NetworkPolicy cannot select "pods of my own run", so the policy admits every run of the pretrain step in
its namespace: deploy one flow per namespace to keep concurrent runs apart.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from sfm.distributed.launch import RENDEZVOUS_PORTS
from sfm.errors import SFMError

POD_LABELS = {"sfm.dev/component": "pretrain"}  # on the pretrain JobSet's pods, and nowhere else
EPHEMERAL_PORTS = range(32768, 61000)  # net.ipv4.ip_local_port_range's default: where port 0 binds land
DNS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
POD_IDENTITY_AGENT = ("169.254.170.23/32", 80)


def _port_range(ports: range) -> dict[str, Any]:
    return {"protocol": "TCP", "port": ports.start, "endPort": ports.stop - 1}


def _cidr(text: str, what: str) -> str:
    try:
        return str(ipaddress.ip_network(text.strip(), strict=True))
    except ValueError:
        raise SFMError(f"{what} {text!r} is not a network in CIDR notation; write e.g. 10.0.0.0/16") from None


def _egress_rule(spec: str) -> dict[str, Any]:
    """``"CIDR:PORT"`` -> an egress rule to that network on that TCP port."""
    cidr, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SFMError(f"--allow-egress {spec!r} is not CIDR:PORT; write e.g. 10.0.12.0/24:8080")
    return {"to": [{"ipBlock": {"cidr": _cidr(cidr, "--allow-egress network")}}],
            "ports": [{"protocol": "TCP", "port": int(port)}]}


def network_policy(namespace: str, *, name: str = "sfm-pretrain", https_cidrs: tuple[str, ...] = ("0.0.0.0/0",),
                   extra_egress: tuple[str, ...] = ()) -> dict[str, Any]:
    """The NetworkPolicy manifest (a dict, JSON for ``kubectl apply -f``) of the pretrain pods in ``namespace``."""
    if not namespace.strip():
        raise SFMError("the NetworkPolicy needs the namespace the flow's pods run in (METAFLOW_KUBERNETES_NAMESPACE)")
    job_pods = [{"podSelector": {"matchLabels": dict(POD_LABELS)}}]
    job_ports = [_port_range(RENDEZVOUS_PORTS), _port_range(EPHEMERAL_PORTS)]
    agent, agent_port = POD_IDENTITY_AGENT
    egress = [
        {"to": job_pods, "ports": job_ports},
        {"to": [DNS_PEER], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        {"to": [{"ipBlock": {"cidr": _cidr(c, "--https-cidr")}} for c in https_cidrs],
         "ports": [{"protocol": "TCP", "port": 443}]},
        {"to": [{"ipBlock": {"cidr": agent}}], "ports": [{"protocol": "TCP", "port": agent_port}]},
        *(_egress_rule(spec) for spec in extra_egress),
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace.strip(), "labels": dict(POD_LABELS)},
        "spec": {"podSelector": {"matchLabels": dict(POD_LABELS)}, "policyTypes": ["Ingress", "Egress"],
                 "ingress": [{"from": job_pods, "ports": job_ports}], "egress": egress},
    }

