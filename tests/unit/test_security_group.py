"""deploy/hyperpod-security-group.yaml, the training nodes' security group on HyperPod Slurm: valid
CloudFormation (cfn-lint, against the resource schemas it carries), and its rules as the reference deployed
them: every protocol between members (EFA), no other ingress, egress HTTPS (plus S3's prefix list and
Lustre to FSx, when given)."""

from __future__ import annotations

from pathlib import Path

import cfnlint.api
import yaml

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "hyperpod-security-group.yaml"
SELF = {"Fn::GetAtt": ["TrainingNodes", "GroupId"]}


def lint(text: str) -> list[str]:
    return [f"{m.rule.id} {m.message}" for m in cfnlint.api.lint(text, regions=["us-east-1", "us-west-2"])]


def test_cfn_lint_passes_and_would_catch_a_mistake():
    text = TEMPLATE.read_text()
    assert lint(text) == []
    broken = text.replace("SourceSecurityGroupId:", "SourceGroupId:", 1)
    assert any(m.startswith("E") for m in lint(broken))  # the linter reads the properties: a typo fails


def test_members_reach_each_other_and_nothing_else_gets_in():
    resources = yaml.safe_load(TEMPLATE.read_text())["Resources"]
    groups = [r for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroup"]
    assert len(groups) == 1 and "SecurityGroupIngress" not in groups[0]["Properties"]
    ingress = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    assert ingress == [{"GroupId": SELF, "IpProtocol": "-1", "SourceSecurityGroupId": SELF,
                        "Description": ingress[0]["Description"]}]

    egress = {name: r for name, r in resources.items() if r["Type"] == "AWS::EC2::SecurityGroupEgress"}
    assert all(r["Properties"]["GroupId"] == SELF for r in egress.values())
    members = [r["Properties"] for r in egress.values() if r["Properties"].get("DestinationSecurityGroupId") == SELF]
    assert len(members) == 1 and members[0]["IpProtocol"] == "-1" and "Condition" not in egress["MembersOut"]
    (inline,) = groups[0]["Properties"]["SecurityGroupEgress"]
    assert (inline["IpProtocol"], inline["FromPort"], inline["ToPort"]) == ("tcp", 443, 443)
    # the rest only when their parameter is given: HTTPS to S3's prefix list, Lustre to FSx's group
    optional = {name: (r["Condition"], r["Properties"]["FromPort"], r["Properties"]["ToPort"])
                for name, r in egress.items() if name != "MembersOut"}
    assert optional == {"S3Out": ("HasS3PrefixList", 443, 443), "LustreOut": ("HasFsx", 988, 988),
                        "LustreDataOut": ("HasFsx", 1018, 1023)}
