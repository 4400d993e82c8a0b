"""The one storage resilience layer (sfm.storage.retry, issue 47): the transient rule over the errors every S3
client of the pipeline really raises (botocore, s3fs, obstore, the loader's ranged GETs) for each kind of
answer, and the ranged reader ingest uses and the loader's store wrapper retrying through the same backoff
while a server throttles, resets and restarts, and giving up at the same deadline."""

from __future__ import annotations

import http.server
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY, free_port
from support.s3_rclone import fault_proxy, rclone_s3  # noqa: F401  (fixtures)
from sfm.storage import clients
from sfm.storage.ranged_file import S3File
from sfm.storage.ranged_get import S3RangeReader
from sfm.storage.resilient_store import open_survey_store
from sfm.storage.retry import is_transient, range_unsupported

# object name -> (HTTP status, S3 error code) the server answers with (None: 200 with the whole object)
ANSWERS = {
    "slow-down": (503, "SlowDown"), "unavailable": (503, "ServiceUnavailable"), "internal": (500, "InternalError"),
    "gateway": (502, "BadGateway"), "too-many": (429, "TooManyRequests"), "request-timeout": (400, "RequestTimeout"),
    "denied": (403, "AccessDenied"), "no-bucket": (404, "NoSuchBucket"), "bad-range": (416, "InvalidRange"),
    "bad-request": (400, "InvalidArgument"), "whole": None,
}
TRANSIENT = {"slow-down", "unavailable", "internal", "gateway", "too-many", "request-timeout"}
BODY = bytes(range(100))


class _Answers(http.server.BaseHTTPRequestHandler):
    """Answers each object as :data:`ANSWERS` says, as S3 would (an XML error body)."""

    protocol_version = "HTTP/1.1"

    def _answer(self, body_too: bool) -> None:
        answer = ANSWERS.get(self.path.split("?", 1)[0].rsplit("/", 1)[-1], (404, "NoSuchKey"))
        if answer is None:
            body = BODY
            self.send_response(200)  # ignoring the range: what obstore refuses
        else:
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{answer[1]}</Code><Message>as asked'
                    "</Message><RequestId>1</RequestId></Error>").encode()
            self.send_response(answer[0])
            self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body_too:
            self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        self._answer(True)

    def do_HEAD(self):  # noqa: N802
        self._answer(False)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def answering():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def endpoint(monkeypatch):
    """Point the S3 clients at an endpoint; each client makes as few attempts of its own as it can."""

    def point(url: str) -> None:
        # the test credentials every test uses: boto3's default session keeps the first it sees for the process
        for key, value in {"SFM_S3_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
                           "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_MAX_ATTEMPTS": "1"}.items():
            monkeypatch.setenv(key, value)

    return point


def failure(client: str, key: str) -> BaseException | None:
    """What ``client`` raises reading bytes 0-9 of ``s3://b/p/<key>`` (None: it read something or nothing)."""
    try:
        if client == "boto":
            clients.boto_client().get_object(Bucket="b", Key=f"p/{key}", Range="bytes=0-9")
        elif client == "http":
            S3RangeReader("b").read_into(f"p/{key}", 0, 10, np.empty(16, np.uint8))
        else:
            store = (clients.obstore_zarr_store("s3://b/p") if client == "obstore" else
                     clients.s3fs_zarr_store("s3://b/p", short_retries=True))
            sync(store.get(key, default_buffer_prototype(), RangeByteRequest(0, 10)))
    except Exception as err:  # noqa: BLE001  (the error is what the test looks at)
        return err
    return None


CLIENTS = ["boto", "s3fs", "obstore", "http"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("client", CLIENTS)
def test_each_answer_is_classified_alike_whatever_the_client(client, answering, endpoint):
    endpoint(answering)
    for key in ANSWERS:
        err = failure(client, key)
        if key == "whole":  # 200 with the whole object: refused by obstore and the ranged GETs, read by the others
            assert (err is not None) == (client in ("obstore", "http")), (key, err)
            assert err is None or not is_transient(err)
            assert (err is not None and range_unsupported(err)) == (client == "obstore")
            continue
        if key == "no-bucket" and client in ("s3fs", "obstore"):  # zarr stores read a missing object as None
            assert err is None
            continue
        assert err is not None, key
        assert is_transient(err) == (key in TRANSIENT), (key, type(err), err)
        assert not range_unsupported(err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("client", CLIENTS)
def test_no_answer_at_all_is_transient(client, endpoint):
    endpoint(f"http://127.0.0.1:{free_port()}")  # nothing listens there: every connection is refused
    err = failure(client, "anything")
    assert err is not None and is_transient(err), (type(err), err)


def test_errors_that_retrying_cannot_fix_are_permanent_by_type():
    import botocore.exceptions as bx

    from sfm.errors import SFMError

    for err in (FileNotFoundError("gone"), PermissionError("denied"), EOFError("truncated"), ValueError("a bug"),
                KeyError("a bug"), SFMError("bad input"), bx.NoCredentialsError()):
        assert not is_transient(err), err
    for err in (ConnectionResetError(104, "reset"), ConnectionRefusedError(111, "refused"), TimeoutError("slow"),
                bx.EndpointConnectionError(endpoint_url="http://x"), OSError(5, "Input/output error")):
        assert is_transient(err), err


# ------------------------------------------------------------------------------------------------
# the ranged reader and the store wrapper retry alike


@pytest.fixture
def landed(s3_env) -> str:
    """The URL of a 1 MiB object ``<bucket>/store/obj`` on the session's moto_server."""
    bucket = s3_env.make_bucket(f"retry-{uuid.uuid4().hex[:8]}")
    body = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    s3_env.client().put_object(Bucket=bucket[len("s3://"):], Key="store/obj", Body=body)
    return f"{bucket}/store/obj"


def open_both(url: str, retry_seconds: float):
    """The object at ``url`` opened by the ranged reader ingest uses (:class:`S3File`) and its folder by the
    loader's store wrapper (ranged GETs for bricks, obstore for the rest)."""
    return S3File(url, retry_seconds=retry_seconds), open_survey_store(url.rsplit("/", 1)[0], "http", retry_seconds)


def reads(ranged: S3File, store) -> dict[str, Callable[[], bytes]]:
    """The object whole, by the ranged reader, by the store wrapper's ranged GETs and by its zarr reads."""
    size = ranged.size
    return {"ranged file": lambda: bytes(ranged.read(0, size)),
            "store ranges": lambda: store.read_range_into("obj", 0, size, np.empty(size, np.uint8)).tobytes(),
            "store zarr": lambda: sync(store.get("obj", default_buffer_prototype())).to_bytes()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["throttle", "reset"])
def test_both_retry_through_throttling_and_resets(mode, landed, fault_proxy, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", fault_proxy.endpoint)
    ranged, store = open_both(landed, 60.0)
    body, retries = None, []
    try:
        for name, read in reads(ranged, store).items():
            before = ranged.retries + store.retries
            fault_proxy.faults_for(mode, 1.0)
            got = read()
            assert body is None or got == body, name
            body = got
            retries.append(ranged.retries + store.retries - before)
    finally:
        ranged.close()
    assert all(n > 0 for n in retries), retries


@pytest.mark.timeout(240)
def test_both_retry_through_a_server_restart(rclone_s3, monkeypatch):  # noqa: F811
    for key, value in rclone_s3.env().items():
        monkeypatch.setenv(key, value)
    bucket = rclone_s3.make_bucket("restart")  # rclone's one bucket in this module (it lists them once)
    path = rclone_s3.local_path(f"{bucket}/store/obj")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    ranged, store = open_both(f"{bucket}/store/obj", 60.0)
    try:
        for name, read in reads(ranged, store).items():
            before = ranged.retries + store.retries
            rclone_s3.stop()  # gone: open connections reset, new ones refused, until it is back
            restart = threading.Timer(1.0, rclone_s3.start)
            restart.start()
            try:
                assert read() == path.read_bytes(), name
            finally:
                restart.join()
            assert ranged.retries + store.retries > before, name
    finally:
        ranged.close()


@pytest.mark.timeout(120)
def test_both_give_up_at_the_same_deadline_with_the_last_transient_error(landed, fault_proxy,  # noqa: F811
                                                                        monkeypatch):
    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", fault_proxy.endpoint)
    ranged, store = open_both(landed, 1.5)
    fault_proxy.set_mode("throttle")  # for good
    for read in (lambda: ranged.read_into(0, bytearray(16)),
                 lambda: store.read_range_into("obj", 0, 16, np.empty(16, np.uint8))):
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:
            read()
        assert is_transient(err.value) and "SlowDown" in str(err.value)
        assert 1.5 <= time.monotonic() - t0 < 10
    ranged.close()
    assert ranged.retries > 0 and store.retries > 0
