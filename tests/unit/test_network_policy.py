"""``sfm network-policy``: the NetworkPolicy of the pretrain pods on EKS, validated by the Kubernetes client's
own models (nothing dropped, nothing misspelt), then read the way a cluster enforces it: which peer may
reach the pretrain pods on which port, and where they may go. That the JobSet's pods carry the labels it
selects is checked on the rendered deployment (tests/integration/test_k8s_render.py)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from kubernetes.client import ApiClient

from sfm.distributed.launch import port_for
from sfm.errors import SFMError
from sfm.ops.network_policy import EPHEMERAL_PORTS, POD_LABELS, network_policy

NS = "sfm-train"


@dataclass
class Peer:
    """A pod (labels, namespace) or an address outside the cluster."""

    labels: dict[str, str] = field(default_factory=dict)
    namespace: str = NS
    ip: str = "10.1.2.3"


JOB_POD = Peer(dict(POD_LABELS))
OTHER_POD = Peer({"app": "notebook"})
DNS = Peer({"k8s-app": "kube-dns"}, "kube-system", "172.20.0.10")


class _Response:  # what ApiClient.deserialize reads: the body of an API response
    def __init__(self, document: dict):
        self.data = json.dumps(document)


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(rule_peer: dict, peer: Peer, namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        block = rule_peer["ipBlock"]
        ip = ipaddress.ip_address(peer.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and \
            not any(ip in ipaddress.ip_network(c) for c in block.get("except", []))
    if "namespaceSelector" in rule_peer:
        in_namespace = _matches(rule_peer["namespaceSelector"], {"kubernetes.io/metadata.name": peer.namespace})
    else:
        in_namespace = peer.namespace == namespace  # a bare podSelector means the policy's own namespace
    return in_namespace and _matches(rule_peer.get("podSelector", {}), peer.labels)


def admits(policy: dict, direction: str, peer: Peer, port: int, protocol: str = "TCP") -> bool:
    """Whether ``policy`` lets the selected pods exchange ``direction`` ("ingress" from / "egress" to) traffic
    with ``peer`` on ``port``: some rule must admit both the peer and the port."""
    key = "from" if direction == "ingress" else "to"
    for rule in policy["spec"].get(direction, []):
        peers, ports = rule.get(key), rule.get("ports")
        if peers and not any(_peer_matches(p, peer, policy["metadata"]["namespace"]) for p in peers):
            continue
        if ports and not any(p.get("protocol", "TCP") == protocol and p["port"] <= port <= p.get("endPort", p["port"])
                             for p in ports):
            continue
        return True
    return False


def test_the_kubernetes_models_take_the_policy_as_it_is():
    policy = network_policy(NS, extra_egress=("10.0.12.0/24:8080",))
    api = ApiClient()
    model = api.deserialize(_Response(policy), "V1NetworkPolicy")
    assert api.sanitize_for_serialization(model) == policy  # every field known to the API, none dropped
    assert model.spec.pod_selector.match_labels == POD_LABELS
    assert model.spec.policy_types == ["Ingress", "Egress"]  # no rule listed: nothing admitted


def test_only_the_jobs_own_pods_reach_it_on_the_rendezvous_and_collective_ports():
    policy = network_policy(NS)
    rendezvous = [port_for(f"run-{i}") for i in range(50)]
    for port in (*rendezvous, EPHEMERAL_PORTS.start, EPHEMERAL_PORTS.stop - 1):
        assert admits(policy, "ingress", JOB_POD, port) and admits(policy, "egress", JOB_POD, port), port
    assert not admits(policy, "ingress", JOB_POD, 22) and not admits(policy, "ingress", JOB_POD, 8080)
    assert not admits(policy, "ingress", JOB_POD, rendezvous[0], "UDP")
    assert not admits(policy, "ingress", OTHER_POD, rendezvous[0])
    assert not admits(policy, "ingress", Peer(dict(POD_LABELS), namespace="elsewhere"), rendezvous[0])
    assert not admits(policy, "ingress", Peer(ip="52.216.8.10"), 443)


def test_egress_is_dns_https_and_the_pod_identity_agent():
    policy = network_policy(NS)
    assert admits(policy, "egress", DNS, 53, "UDP") and admits(policy, "egress", DNS, 53, "TCP")
    assert not admits(policy, "egress", Peer({"k8s-app": "kube-dns"}, "other"), 53, "UDP")
    assert admits(policy, "egress", Peer(ip="52.216.8.10"), 443)  # S3 (through the VPC endpoint)
    assert not admits(policy, "egress", Peer(ip="52.216.8.10"), 80)
    assert admits(policy, "egress", Peer(ip="169.254.170.23"), 80)
    assert not admits(policy, "egress", Peer(ip="169.254.169.254"), 80)  # not the node's instance metadata
    assert not admits(policy, "egress", OTHER_POD, 8080)

    narrow = network_policy(NS, https_cidrs=("52.216.0.0/15",), extra_egress=("10.0.12.0/24:8080",))
    assert admits(narrow, "egress", Peer(ip="52.217.1.1"), 443)
    assert not admits(narrow, "egress", Peer(ip="8.8.8.8"), 443)
    assert admits(narrow, "egress", Peer(ip="10.0.12.7"), 8080)
    assert not admits(narrow, "egress", Peer(ip="10.0.13.7"), 8080)


def test_bad_input_is_one_line():
    with pytest.raises(SFMError, match="CIDR:PORT"):
        network_policy(NS, extra_egress=("10.0.0.0/8",))
    with pytest.raises(SFMError, match="--https-cidr"):
        network_policy(NS, https_cidrs=("10.0.0.1/8",))
    proc = subprocess.run([sys.executable, "-m", "sfm.cli", "network-policy", "--namespace", NS,
                           "--allow-egress", "10.0.12.0/24:8080"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout) == network_policy(NS, extra_egress=("10.0.12.0/24:8080",))
