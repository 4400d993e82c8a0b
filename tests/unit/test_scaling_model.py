"""The step-time model behind BENCHMARKS.md "Scaling (issue 6)": its traffic follows the strategies'
formulas, efficiency is 1 on one node and falls with nodes, and the recommended setup stays >= 95 %."""

from __future__ import annotations

import math

import pytest

from sfm.ops import scaling_model as sm


def test_traffic_per_strategy():
    flops, fwd, params, units = sm.model_numbers("large", (128, 128, 128))
    n, busbw = 128, sm.LINK_EFFICIENCY * sm.EFA_PER_NODE
    latency = sm.LATENCY_INTRA + 2 * 4 * sm.LATENCY_NET_HOP  # 16 nodes: 4 tree levels
    comm = {s: sm.step_time(sm.Setup(preset="large", strategy=s, nodes=16))["comm_s"] for s in sm.STRATEGIES}
    buckets = math.ceil(4 * params / sm.DDP_BUCKET)
    assert comm["ddp"] == pytest.approx(2 * (n - 1) / n * 4 * params / busbw + buckets * latency)
    gather = (n - 1) / n * 2 * params / busbw + units * latency
    scatter = (n - 1) / n * 4 * params / busbw + units * latency
    assert comm["fsdp2-zero2"] == pytest.approx(gather + scatter)
    assert comm["fsdp2-full"] == pytest.approx(2 * gather + scatter)
    one_node = sm.step_time(sm.Setup(preset="large", strategy="ddp", nodes=1))  # NVLink, no network
    assert one_node["comm_s"] == pytest.approx(2 * 7 / 8 * 4 * params / (sm.LINK_EFFICIENCY * sm.NVLINK_ONE_WAY)
                                               + buckets * sm.LATENCY_INTRA)


def test_efficiency_falls_with_nodes_and_small_batches():
    for strategy in sm.STRATEGIES:
        curve = [sm.efficiency(sm.Setup(preset="base", strategy=strategy, nodes=n))["efficiency"] for n in sm.NODES]
        assert curve[0] == pytest.approx(1.0)
        assert all(a >= b for a, b in zip(curve, curve[1:])), (strategy, curve)
        small = sm.efficiency(sm.Setup(preset="base", strategy=strategy, nodes=16, micro_batch=4))["efficiency"]
        assert small < curve[-1]


def test_recommended_setup_reaches_95_percent_on_16_nodes():
    for mfu in (0.4, 0.6):
        r = sm.efficiency(sm.Setup(preset="huge", strategy="fsdp2-zero2", nodes=16, micro_batch=32, mfu=mfu))
        assert r["efficiency"] >= 0.95, mfu
