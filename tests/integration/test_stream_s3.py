"""The crop loader against S3 servers on loopback that go away mid-stream.

- ``rclone serve s3`` (disk-backed) is killed and restarted while the loader reads, with a fetch per
  crop and with the region pool: the stream neither crashes nor skips nor repeats a batch (compared
  with the same stream read from the same store as a local folder), and the loader did retry.
- A proxy in front of moto_server resets connections, then throttles (503 SlowDown), while DataLoader
  worker processes read through sfm.storage.ranged_get, or through obstore: same result.
- A read that keeps failing past ``retry_seconds`` raises one SFMError naming the survey and region.
"""

from __future__ import annotations

import threading

import pytest
import torch

from support.crop_stores import stream as crop_stream
from support.crop_stores import survey_with_holes
from support.s3_rclone import fault_proxy, rclone_s3  # noqa: F401  (fixtures)
from sfm import data
from sfm.errors import SFMError

CROP = (16, 16, 16)


def open_stream(url: str, *, workers: int = 0, **settings):
    """Batches of 4 crops with every augmentation, read on 4 threads (each worker with this process's
    environment: the S3 endpoint the test set), retrying for 60 s, unless ``settings`` say otherwise."""
    settings = {"seed": 31, "client": "auto", "retry_seconds": 60.0, **settings}
    return crop_stream([url], batch=4, workers=workers, crop=CROP, augment=data.AUGMENTATIONS, read_threads=4,
                       prefetch=1, **settings)


def take(stream: data.BatchStream, n: int) -> list[torch.Tensor]:
    return [next(stream) for _ in range(n)]


def assert_same_batches(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"batch {step} differs from the uninterrupted stream"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("k", [1, 4])
def test_stream_survives_a_restart_of_rclone_serve_s3(rclone_s3, monkeypatch, tmp_path, k):  # noqa: F811
    for key, value in rclone_s3.env().items():
        monkeypatch.setenv(key, value)
    rclone_s3.make_bucket("stream")  # one bucket: rclone lists the buckets it serves once, at start
    url, _, _ = survey_with_holes(tmp_path, f"s3://stream/root-{k}", shape=(48, 40, 64), seed=3)
    pools = [dict(crops_per_region=k, pool_dir=str(tmp_path / f"pool-{n}")) for n in range(2)]
    reference = open_stream(str(rclone_s3.local_path(url)), **pools[0])  # the same bytes, as a local folder
    want = take(reference, 12)
    reference.close()

    stream = open_stream(url, **pools[1])
    assert stream.dataset.surveys.store(0).range_reader is not None  # "auto": bricks over sfm.storage.ranged_get
    got = take(stream, 3)
    rclone_s3.stop()  # killed mid-stream: open connections reset, new ones refused
    restart = threading.Timer(3.0, rclone_s3.start)
    restart.start()
    try:
        got += take(stream, 9)
    finally:
        restart.join()
        stream.close()
    assert_same_batches(got, want)
    assert stream.dataset.surveys.fetch_stats()["retries"] > 0  # the outage did hit the loader's reads


@pytest.mark.timeout(240)
@pytest.mark.parametrize("client", ["http", "obstore"])
def test_workers_survive_connection_resets_and_throttling(s3_env, fault_proxy, monkeypatch, tmp_path,  # noqa: F811
                                                          client):
    bucket = s3_env.make_bucket(f"stream-faults-{client}")
    url, _, _ = survey_with_holes(tmp_path, f"{bucket}/root", shape=(48, 40, 64), seed=4)
    reference = open_stream(url, client="fsspec")
    want = take(reference, 14)
    reference.close()

    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", fault_proxy.endpoint)  # the loader reads through the proxy
    stream = open_stream(url, workers=2, client=client)
    got = take(stream, 2)
    fault_proxy.faults_for("reset", 2.0)
    got += take(stream, 4)
    fault_proxy.faults_for("throttle", 2.0)
    got += take(stream, 8)
    stream.close()
    assert_same_batches(got, want)
    assert fault_proxy.faults > 0


@pytest.mark.timeout(120)
def test_a_read_that_keeps_failing_names_the_survey_and_region(s3_env, fault_proxy, monkeypatch,  # noqa: F811
                                                                tmp_path):
    bucket = s3_env.make_bucket("stream-down")
    url, _, _ = survey_with_holes(tmp_path, f"{bucket}/root", shape=(48, 40, 64), seed=5)
    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", fault_proxy.endpoint)
    for client in ("http", "obstore", "fsspec"):
        stream = open_stream(url, client=client, retry_seconds=1.5)
        fault_proxy.set_mode("refuse")  # the endpoint goes away for good after the store was opened
        with pytest.raises(SFMError) as err:
            take(stream, 3)
        stream.close()
        fault_proxy.set_mode("pass")
        message = str(err.value)
        assert "\n" not in message and url in message and "holes-5-48x40x64" in message
        assert "region [inline" in message and "crossline" in message and "sample" in message
