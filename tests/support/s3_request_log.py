"""A logging reverse proxy in front of the loopback S3 server, and an IAM policy evaluator.

Every process of a test (the flow's tasks, torchrun workers, the Client API, the test itself) talks
to S3 through :class:`S3RequestLog` when its endpoint points at the proxy, so the test sees every S3
call the pipeline really makes. :func:`s3_calls` turns each HTTP request into the IAM authorisation
checks AWS would make for it (action, resource ARN, ``s3:prefix``), and :func:`allowed` evaluates
those against a policy's Allow statements the way IAM does for identity policies; :func:`denied` says
whether a policy's Deny statements (a bucket policy's) refuse a call, with the request's endpoint, TLS and
principal in its context.
"""

from __future__ import annotations

import fnmatch
import http.client
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
                "expect"}


@dataclass
class Request:
    t: float  # time.time() when the request arrived
    method: str
    path: str  # raw path, percent-encoded
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes = b""  # kept only for multi-object delete (the keys are in the body)
    status: int = 0


@dataclass
class Call:
    """One IAM authorisation check: ``action`` on ``resource`` with ``s3:prefix`` for ListBucket."""

    action: str
    resource: str
    prefix: str | None = None
    request: Request | None = field(default=None, repr=False)
    vpce: str | None = None  # aws:SourceVpce: the VPC endpoint the request came through, if any
    secure: bool = True  # aws:SecureTransport
    principal: str | None = None  # aws:PrincipalArn

    def __str__(self) -> str:
        where = f" prefix={self.prefix!r}" if self.prefix is not None else ""
        return f"{self.action} {self.resource}{where}"


class S3RequestLog:
    """``with S3RequestLog(upstream) as log:`` a proxy on ``log.endpoint`` recording ``log.requests``."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname, parts.port
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        log = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out as two writes: with Nagle on, the body waits for the client's
            # delayed ACK (40 ms a response on Linux)
            disable_nagle_algorithm = True

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline().strip():
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self):
                t = time.time()
                body = self._body()
                parts = urlsplit(self.path)
                req = Request(t, self.command, parts.path, parse_qs(parts.query, keep_blank_values=True),
                              {k.lower(): v for k, v in self.headers.items()},
                              body if self.command == "POST" and "delete" in parts.query else b"")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(log.upstream_host, log.upstream_port, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                req.status = resp.status
                with log._lock:
                    log.requests.append(req)
                self.send_response_only(resp.status, resp.reason)
                for key, value in resp.getheaders():
                    if key.lower() in _HOP_HEADERS or (key.lower() == "content-length" and self.command != "HEAD"):
                        continue
                    self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "S3RequestLog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)


# ---- HTTP request -> IAM authorisation checks ------------------------------------------------------------

_QUERY_AUTH = {"X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-Security-Token",
               "X-Amz-Signature", "X-Amz-SignedHeaders"}


def _obj(bucket: str, key: str) -> str:
    return f"arn:aws:s3:::{bucket}/{key}"


def s3_calls(req: Request) -> list[Call]:
    """The IAM checks AWS makes for one path-style S3 request (an unknown kind maps to ``s3:UNKNOWN``)."""
    path = req.path.lstrip("/")
    bucket, _, raw_key = path.partition("/")
    key = unquote(raw_key)
    # a presigned URL (query-string authentication) authorises the same action as a signed header
    q = {k: v for k, v in req.query.items() if k not in _QUERY_AUTH}
    m = req.method

    def call(action: str, resource: str, prefix: str | None = None) -> Call:
        return Call(action, resource, prefix, req)

    if not key:  # bucket-level
        if m in ("GET", "HEAD") and not (set(q) - {"list-type", "prefix", "delimiter", "max-keys", "encoding-type",
                                                   "continuation-token", "start-after", "marker",
                                                   "fetch-owner"}):
            return [call("s3:ListBucket", f"arn:aws:s3:::{bucket}", q.get("prefix", [""])[0])]
        if m == "GET" and "location" in q:
            return [call("s3:GetBucketLocation", f"arn:aws:s3:::{bucket}")]
        if m == "GET" and "uploads" in q:
            return [call("s3:ListBucketMultipartUploads", f"arn:aws:s3:::{bucket}")]
        if m == "POST" and "delete" in q:
            root = ET.fromstring(req.body)
            keys = [el.text or "" for el in root.iter() if el.tag.endswith("Key")]
            return [call("s3:DeleteObject", _obj(bucket, k)) for k in keys]
        return [call(f"s3:UNKNOWN:{m}:bucket:{sorted(q)}", f"arn:aws:s3:::{bucket}")]

    resource = _obj(bucket, key)
    if m == "POST" and "uploads" in q:  # CreateMultipartUpload
        return [call("s3:PutObject", resource)]
    sub = set(q) - {"versionId", "partNumber", "uploadId", "x-id", "response-content-type"}
    if sub:
        return [call(f"s3:UNKNOWN:{m}:object:{sorted(sub)}", resource)]
    copy_source = req.headers.get("x-amz-copy-source")
    if m in ("GET", "HEAD"):
        return [call("s3:ListMultipartUploadParts" if "uploadId" in q and m == "GET" else "s3:GetObject", resource)]
    if m in ("PUT", "POST"):  # PutObject, UploadPart, Create/CompleteMultipartUpload, CopyObject
        calls = [call("s3:PutObject", resource)]
        if copy_source:
            src = unquote(copy_source.split("?", 1)[0]).lstrip("/")
            calls.append(call("s3:GetObject", f"arn:aws:s3:::{src}"))
        return calls
    if m == "DELETE":
        return [call("s3:AbortMultipartUpload" if "uploadId" in q else "s3:DeleteObject", resource)]
    return [call(f"s3:UNKNOWN:{m}", resource)]


# ---- policy evaluation ---------------------------------------------------------------------------------

def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _glob(pattern: str, value: str) -> bool:
    """IAM wildcard match: ``*`` any run of characters (``/`` included), ``?`` one character."""
    return fnmatch.fnmatchcase(value, pattern.replace("[", "[[]"))


def _context(call: Call) -> dict[str, str | None]:
    """The request's values of the condition keys this evaluator knows (None: absent from the request)."""
    return {"s3:prefix": call.prefix, "aws:SourceVpce": call.vpce, "aws:PrincipalArn": call.principal,
            "aws:SecureTransport": str(call.secure).lower()}


def _condition_holds(condition: dict, call: Call, unknown: bool = False) -> bool:
    """Every test of ``condition`` holds for ``call``; a key or operator this evaluator does not know counts
    as ``unknown`` (False for an Allow, fail closed; True for a Deny, which then refuses)."""
    context = _context(call)
    for operator, tests in condition.items():
        for key, patterns in tests.items():
            if key not in context:
                return unknown
            value, patterns = context[key], _as_list(patterns)
            if operator in ("StringLike", "ArnLike"):
                holds = value is not None and any(_glob(p, value) for p in patterns)
            elif operator in ("StringEquals", "Bool"):
                holds = value is not None and value in patterns
            elif operator in ("StringNotLike", "ArnNotLike"):  # negated: holds when the key is absent
                holds = value is None or not any(_glob(p, value) for p in patterns)
            elif operator == "StringNotEquals":
                holds = value is None or value not in patterns
            else:
                return unknown
            if not holds:
                return False
    return True


def _applies(st: dict, call: Call, unknown: bool) -> bool:
    return (any(_glob(a.lower(), call.action.lower()) for a in _as_list(st["Action"]))
            and any(_glob(r, call.resource) for r in _as_list(st["Resource"]))
            and ("Condition" not in st or _condition_holds(st["Condition"], call, unknown)))


def allowed(policy: dict, call: Call) -> bool:
    """True if some Allow statement of ``policy`` grants ``call`` (action, resource and conditions)."""
    return any(st.get("Effect") == "Allow" and _applies(st, call, unknown=False) for st in policy["Statement"])


def denied(policy: dict, call: Call) -> bool:
    """True if some Deny statement of ``policy`` (for every principal) refuses ``call``."""
    return any(st.get("Effect") == "Deny" and st.get("Principal") in ("*", {"AWS": "*"}) and _applies(st, call, True)
               for st in policy["Statement"])
