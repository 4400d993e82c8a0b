"""sfm.storage.ranged_get: the loader's blocking ranged GETs, against moto_server, rclone serve s3, and an
HTTP server that answers what S3 servers sometimes do (ignore the range, 503 SlowDown)."""

from __future__ import annotations

import http.server
import threading

import numpy as np
import pytest

from support.s3_rclone import rclone_s3  # noqa: F401  (fixture)
from sfm.storage.ranged_get import RangeReadError, S3RangeReader, reachable_directly
from sfm.storage.retry import is_transient

BODY = np.random.default_rng(7).integers(0, 256, size=3_000_001, dtype=np.uint8).tobytes()
RANGES = [(0, 1), (0, 1 << 20), (1_234_567, 2_500_000), (len(BODY) - 5, len(BODY)), (0, len(BODY))]


def read_ranges(reader: S3RangeReader, key: str) -> None:
    out = np.empty(len(BODY), np.uint8)
    for start, end in RANGES:
        got = reader.read_into(key, start, end, out)
        assert got is not None and got.tobytes() == BODY[start:end], (start, end)
        assert np.shares_memory(got, out)  # into the caller's buffer, not a copy


@pytest.mark.timeout(120)
def test_reads_exact_ranges_from_moto_into_the_callers_buffer(s3_env):
    s3_env.make_bucket("ranges")
    s3_env.client().put_object(Bucket="ranges", Key="dir/obj", Body=BODY)
    reader = S3RangeReader("ranges")
    read_ranges(reader, "dir/obj")
    out = np.empty(16, np.uint8)
    assert reader.read_into("dir/missing", 0, 8, out) is None  # NoSuchKey: no object, as zarr expects
    with pytest.raises(ValueError, match="at least 32 bytes"):
        reader.read_into("dir/obj", 0, 32, out)
    with pytest.raises(RangeReadError) as err:  # a missing bucket is not a missing key
        S3RangeReader("no-such-bucket").read_into("dir/obj", 0, 8, out)
    assert err.value.status == 404 and not is_transient(err.value)
    assert "X-Amz" not in str(err.value) and s3_env.env()["AWS_ACCESS_KEY_ID"] not in str(err.value)


@pytest.mark.timeout(120)
def test_accepts_rclones_200_answer_carrying_the_range(rclone_s3, monkeypatch):  # noqa: F811
    for key, value in rclone_s3.env().items():
        monkeypatch.setenv(key, value)
    rclone_s3.make_bucket("ranges")
    path = rclone_s3.local_path("s3://ranges/dir/obj")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(BODY)
    read_ranges(S3RangeReader("ranges"), "dir/obj")


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    """/b/whole: 200 with the whole object whatever the range; /b/shifted: 206 from the wrong offset;
    /b/slow: 503 SlowDown."""

    def do_GET(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path.endswith("/slow"):
            body = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
            self.send_response(503)
        elif path.endswith("/shifted"):
            body = BODY[1:9]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 1-8/{len(BODY)}")
        else:
            body = BODY
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.timeout(60)
def test_answers_that_are_not_the_range_are_errors_never_data(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("SFM_S3_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "sfmtestaccesskey0001")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sfmtestsecretkey0001")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        reader = S3RangeReader("b")
        out = np.empty(64, np.uint8)
        for key in ("whole", "shifted"):
            with pytest.raises(RangeReadError, match="not the requested range") as err:
                reader.read_into(key, 0, 8, out)
            assert not is_transient(err.value)
        assert reader.read_into("whole", 0, len(BODY), np.empty(len(BODY), np.uint8)).tobytes() == BODY
        with pytest.raises(RangeReadError, match="HTTP 503 SlowDown") as err:
            reader.read_into("slow", 0, 8, out)
        assert is_transient(err.value)  # retried by the loader
        assert "sfmtest" not in str(err.value) and "Signature" not in str(err.value)
    finally:
        server.shutdown()


def test_not_used_behind_a_proxy(monkeypatch):
    for key in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(key, raising=False)
    assert reachable_directly("http://127.0.0.1:9000") and reachable_directly(None)
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128")
    assert not reachable_directly(None) and reachable_directly("http://127.0.0.1:9000")
    monkeypatch.setenv("no_proxy", "s3.amazonaws.com")
    assert reachable_directly(None)
