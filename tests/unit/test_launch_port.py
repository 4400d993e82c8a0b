"""The rendezvous port of a single-node job never collides with a port already in use."""

import socket

from sfm.config import JobConfig
from sfm.distributed import launch
from sfm.distributed.job import NodeLaunch, TrainJob


def test_derived_ports_stay_below_the_ephemeral_range():
    ports = {launch.port_for(f"run-{i}") for i in range(2000)}
    assert min(ports) >= 20000 and max(ports) < 32768
    assert len(ports) > 1500  # spread, not a handful of values


def test_a_single_node_job_moves_off_a_taken_port(monkeypatch):
    seen = {}

    def fake_run(cmd, env, timeout):
        seen["port"] = int(next(a for a in cmd if a.startswith("--master-port=")).split("=")[1])

        class Done:
            returncode = 0
        return Done()

    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        launch.launch_node(TrainJob(JobConfig()), NodeLaunch(1, 1, 0, "127.0.0.1", taken))
        assert seen["port"] != taken
        launch.launch_node(TrainJob(JobConfig()), NodeLaunch(2, 1, 0, "127.0.0.1", taken))
        assert seen["port"] == taken  # other nodes derive the same port: a multi-node job keeps it
