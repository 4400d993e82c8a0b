"""sfm.storage.retry's one backoff: exponential waits with jitter, capped, never past the deadline; permanent
errors, the deadline and a stop end the retries at once with the failure itself."""

from __future__ import annotations

import time

import pytest

from sfm.storage import retry
from sfm.storage.retry import Backoff, retrying


def test_waits_double_with_jitter_up_to_the_cap_and_never_past_the_deadline():
    backoff = Backoff(3600.0)
    waits = [backoff.wait(ConnectionResetError("reset")) for _ in range(12)]
    for k, wait in enumerate(waits):
        full = min(retry.LONGEST_WAIT_S, retry.FIRST_WAIT_S * 2 ** k)
        assert 0.5 * full <= wait <= full, (k, wait)
    assert backoff.retries == 12 and max(waits) <= retry.LONGEST_WAIT_S
    near = Backoff(0.2)
    assert near.wait(TimeoutError("slow")) <= 0.2
    for _ in range(5):
        assert near.wait(TimeoutError("slow")) <= max(0.0, near.deadline - time.monotonic()) + 1e-3


def test_permanent_errors_the_deadline_and_a_stop_re_raise_the_failure():
    with pytest.raises(FileNotFoundError):
        Backoff(60.0).wait(FileNotFoundError("gone"))
    over = Backoff(0.0)
    with pytest.raises(ConnectionResetError):
        over.wait(ConnectionResetError("reset"))
    stopped = Backoff(60.0, stopped=lambda: True)
    with pytest.raises(ConnectionResetError):
        stopped.wait(ConnectionResetError("reset"))
    assert over.retries == stopped.retries == 0


def test_retrying_calls_again_after_transient_failures_only():
    failures = [ConnectionResetError("reset"), TimeoutError("slow")]
    seen = []

    def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    assert retrying(flaky, 60.0, lambda err, backoff: seen.append((type(err), backoff.retries))) == "done"
    assert seen == [(ConnectionResetError, 1), (TimeoutError, 2)]

    calls = []

    def broken() -> None:
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        retrying(broken, 60.0)
    assert len(calls) == 1  # a bug is not retried
