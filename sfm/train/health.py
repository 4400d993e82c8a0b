"""Training health: fail a hung step with every thread's stack, skip non-finite steps, publish a heartbeat.

Three small parts the training loop drives, each usable and tested on its own:

- :class:`Watchdog`: a thread that fails the process when the loop makes no progress for
  ``timeout_s`` (a hung data loader, S3 read or collective). It first writes the stack of every thread
  to the log, then ends the process with :data:`HANG_EXIT_CODE`; torchrun stops the other ranks and
  the flow step fails, so ``@retry`` or ``resume`` continue from the last checkpoint. A C-level
  backstop (``faulthandler.dump_traceback_later``) fires too if a hang holds the GIL.
- :class:`NonFiniteGuard`: counts steps whose loss or gradient norm is not finite; says ``skip`` for
  each (do not apply the update) and ``rollback`` after ``max_consecutive`` in a row (reload the last
  good checkpoint); after ``max_rollbacks`` rollbacks the run is declared diverged.
- :class:`Heartbeat`: ``<run_root>/heartbeat.json`` (step, loss, throughput, time, status), written
  through :mod:`sfm.storage.objects` at most every ``every_s`` seconds; ``sfm status`` reads it.

Typical use in the loop (rank 0 writes the heartbeat; every rank runs the watchdog and the guard)::

    guard = NonFiniteGuard(max_consecutive=3, max_rollbacks=2)
    beat = Heartbeat(run_root, max_steps=max_steps, enabled=is_main)
    with Watchdog(timeout_s=600, first_timeout_s=1800) as dog:
        for step in ...:
            loss, grad_norm = ...                              # before optimizer.step()
            verdict = guard.observe(all_ranks_finite(loss, grad_norm, reduce=lambda t: accelerator.reduce(t, "sum")))
            if verdict == SKIP: zero the gradients, do not step
            elif verdict == ROLLBACK: reload the newest checkpoint; guard.rolled_back()
            dog.progress(step)
            beat.beat(step, loss=..., samples_per_s=..., skipped_nonfinite=guard.skipped, rollbacks=guard.rollbacks)
    beat.finish(step)                                          # status="failed" from an except clause
"""

from __future__ import annotations

import datetime as dt
import faulthandler
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple, TextIO

from sfm import storage
from sfm.errors import SFMError

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: a transient failure; retrying (or resuming) may succeed
HEARTBEAT = "heartbeat.json"
OK, SKIP, ROLLBACK = "ok", "skip", "rollback"


# ---- hang watchdog ---------------------------------------------------------------------------------------

def thread_stacks() -> str:
    """The current Python stack of every thread of this process, each headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        lines.append(f"--- thread {names.get(ident, '?')} (id {ident}) ---")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    return "\n".join(lines)


def _end_process(exit_code: int) -> None:
    """Terminate this process's children (data loader workers), then exit at once without cleanup."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            child.terminate()
        psutil.wait_procs(children, timeout=5)
        for child in children:
            if child.is_running():
                child.kill()
    except Exception:  # psutil missing, or children already gone: exiting still ends the step
        pass
    os._exit(exit_code)


class Watchdog:
    """Fail the process when :meth:`progress` is not called for ``timeout_s`` seconds.

    ``first_timeout_s`` (default ``timeout_s``) covers the slow first step (compile, opening surveys).
    The backstop (``faulthandler``, from a C thread) dumps the stacks and exits with status 1
    ``backstop_grace_s`` after the deadline (default max(10 s, a quarter of the timeout)) in case
    the hang holds the GIL so this watchdog's own thread cannot run.
    ``on_hang(report)`` replaces the default action (write the report, end the process with
    ``exit_code``); tests use it to observe a hang without exiting. ``stream`` is where the report
    goes (default ``sys.stderr``, which the flow captures into the task log).
    """

    def __init__(self, timeout_s: float, *, first_timeout_s: float | None = None, name: str = "training step",
                 exit_code: int = HANG_EXIT_CODE, on_hang: Callable[[str], None] | None = None,
                 stream: TextIO | None = None, backstop: bool = True, backstop_grace_s: float | None = None):
        if timeout_s <= 0:
            raise SFMError(f"watchdog timeout {timeout_s!r} must be positive seconds")
        self.timeout_s = float(timeout_s)
        self.first_timeout_s = float(first_timeout_s or timeout_s)
        self.name = name
        self.exit_code = exit_code
        self.on_hang = on_hang
        self.stream = stream
        self.backstop = backstop and on_hang is None
        self.backstop_grace_s = backstop_grace_s
        self.last_step: int | None = None
        self.fired = False
        self._deadline = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- driving it
    def start(self) -> "Watchdog":
        self._arm(self.first_timeout_s)
        self._thread = threading.Thread(target=self._watch, name="sfm-watchdog", daemon=True)
        self._thread.start()
        return self

    def progress(self, step: int | None = None) -> None:
        """The loop made progress (call once per step, or more often): the timeout starts again."""
        self.last_step = step if step is not None else self.last_step
        self._arm(self.timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self.backstop:
            faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inside
    def _arm(self, seconds: float) -> None:
        with self._lock:
            self._deadline = time.monotonic() + seconds
            self._armed_for = seconds
        if self.backstop:  # fires from a C thread even if a hang holds the GIL; exits with code 1
            grace = self.backstop_grace_s if self.backstop_grace_s is not None else max(10.0, 0.25 * seconds)
            faulthandler.dump_traceback_later(seconds + grace, repeat=False,
                                              file=sys.__stderr__, exit=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                remaining = self._deadline - time.monotonic()
                armed_for = self._armed_for
            if remaining <= 0:
                self._fire(armed_for)
                return
            self._stop.wait(min(remaining, 1.0))

    def _fire(self, waited_s: float) -> None:
        self.fired = True
        where = f"after step {self.last_step}" if self.last_step is not None else "before the first step"
        report = (f"sfm health: {self.name} made no progress for {waited_s:.0f}s ({where}); the stacks of all "
                  f"threads of process {os.getpid()} follow. Failing so that @retry / resume continue from the "
                  f"last checkpoint.\n{thread_stacks()}\nsfm health: end of stacks")
        if self.on_hang is not None:
            self.on_hang(report)
            return
        stream = self.stream or sys.stderr
        try:
            print(report, file=stream, flush=True)
        except Exception:  # a closed stream must not keep a hung process alive
            pass
        _end_process(self.exit_code)


# ---- non-finite loss / gradients -----------------------------------------------------------------------------

class NonFiniteGuard:
    """Decide what to do with a step whose loss or gradient norm may be NaN or infinite.

    :meth:`observe` returns ``"ok"``, ``"skip"`` (do not apply this step's update) or ``"rollback"``
    (``max_consecutive`` non-finite steps in a row: reload the last good checkpoint, then call
    :meth:`rolled_back`). A further run of bad steps after ``max_rollbacks`` rollbacks raises
    :class:`SFMError` (the run diverged). All ranks must pass the same flag (see :func:`all_ranks_finite`).
    """

    def __init__(self, max_consecutive: int = 3, max_rollbacks: int = 2):
        if max_consecutive < 1 or max_rollbacks < 0:
            raise SFMError("non-finite guard: max_consecutive must be >= 1 and max_rollbacks >= 0")
        self.max_consecutive = int(max_consecutive)
        self.max_rollbacks = int(max_rollbacks)
        self.skipped = 0  # non-finite steps seen in this run (all attempts that share this guard)
        self.consecutive = 0
        self.rollbacks = 0

    def observe(self, finite: bool) -> str:
        if finite:
            self.consecutive = 0
            return OK
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive < self.max_consecutive:
            return SKIP
        if self.rollbacks >= self.max_rollbacks:
            raise SFMError(f"training diverged: {self.consecutive} non-finite steps in a row after {self.rollbacks} "
                           "rollback(s); lower train.lr, raise train.warmup_steps or set train.grad_clip, then resume")
        return ROLLBACK

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.consecutive = 0

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "consecutive": self.consecutive, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped, self.consecutive, self.rollbacks = state["skipped"], state["consecutive"], state["rollbacks"]


class RunHealth(NamedTuple):
    """The health parts of one training process: every rank runs the watchdog and the guard; the
    heartbeat writes on rank 0 only."""

    watchdog: Watchdog
    heartbeat: Heartbeat
    guard: NonFiniteGuard


def all_ranks_finite(*values, reduce: Callable | None = None) -> bool:
    """True if every tensor in ``values`` is finite on every rank.

    values: scalar tensors (loss, gradient norm) on this rank's device; None entries are ignored.
    ``reduce`` takes this rank's count of non-finite values (a float32 scalar tensor) and returns the
    sum (or max) over ranks: ``lambda t: accelerator.reduce(t, "sum")``, or ``torch.distributed.all_reduce``
    with its default SUM; None means one process. Every rank gets the same answer, so every rank
    skips or rolls back together.
    """
    import torch

    tensors = [v.detach() for v in values if v is not None]
    bad = sum((~torch.isfinite(t)).sum() for t in tensors) if tensors else torch.zeros(())
    bad = torch.as_tensor(bad, dtype=torch.float32)
    if reduce is not None:
        bad = reduce(bad)
    return bool(bad.item() == 0)


# ---- heartbeat -------------------------------------------------------------------------------------------

def heartbeat_url(run_root: str) -> str:
    return storage.join(run_root, HEARTBEAT)


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; a null loss says "not finite"
    if hasattr(value, "item"):
        return _json_number(value.item())
    return value


class Heartbeat:
    """Writes ``<run_root>/heartbeat.json`` at most every ``every_s`` seconds (always on ``force``).

    Only the process with ``enabled=True`` (rank 0) writes. Each beat replaces the object whole
    (:func:`sfm.storage.objects.write_bytes`), so readers never see half a heartbeat.
    """

    def __init__(self, run_root: str, *, every_s: float = 30.0, max_steps: int | None = None, enabled: bool = True,
                 world_size: int = 1, clock: Callable[[], float] = time.time):
        self.url = heartbeat_url(run_root)
        self.every_s = float(every_s)
        self.max_steps = max_steps
        self.enabled = enabled
        self.world_size = world_size
        self.clock = clock
        self.started_at = clock()
        self.last_written = -math.inf
        self.writes = 0

    def beat(self, step: int, *, loss: float | None = None, samples_per_s: float | None = None,
             status: str = "running", force: bool = False, **extra: Any) -> bool:
        """Record progress; returns True if the heartbeat was written now."""
        now = self.clock()
        if not self.enabled or (not force and now - self.last_written < self.every_s):
            return False
        record = {
            "status": status, "step": int(step), "max_steps": self.max_steps, "loss": _json_number(loss),
            "samples_per_s": _json_number(samples_per_s), "time": _iso(now), "unix_time": now,
            "started_at": _iso(self.started_at), "host": socket.gethostname(), "pid": os.getpid(),
            "world_size": self.world_size, **{k: _json_number(v) for k, v in extra.items()},
        }
        storage.write_bytes(self.url, json.dumps(record, sort_keys=True).encode())
        self.last_written = now
        self.writes += 1
        return True

    def finish(self, step: int, *, status: str = "finished", **fields: Any) -> bool:
        return self.beat(step, status=status, force=True, **fields)


def _iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).isoformat(timespec="seconds")


def read_heartbeat(run_root: str) -> dict[str, Any] | None:
    url = heartbeat_url(run_root)
    if not storage.exists(url):
        return None
    return json.loads(storage.read_bytes(url))


def resolve_run_root(run: str, data_root: str = "") -> str:
    """``run`` as a run root: a URL or path as given, or a run name under ``<data_root>/checkpoints/``.

    Run names are ``<Flow>-<run id>`` (a Metaflow pathspec ``<Flow>/<run id>`` is accepted too).
    """
    run = str(run).strip()
    if storage.is_s3(run) or run.startswith(("/", "./", "../", "file://", "~")) or os.path.isdir(run):
        return storage.normalize(run)
    if not data_root:
        raise SFMError(f"{run!r} is a run name; also pass --data-root so it can be found under checkpoints/")
    name = run.replace("/", "-", 1) if run.count("/") == 1 else run
    return storage.safe_join(storage.join(storage.normalize(data_root), "checkpoints"), name, what="run name")


def describe(record: dict[str, Any], *, now: float | None = None, stale_after_s: float = 600.0) -> dict[str, Any]:
    """The heartbeat plus ``age_s`` and a ``state``: running, stale (no beat for ``stale_after_s``), or its status."""
    now = time.time() if now is None else now
    age = max(0.0, now - float(record.get("unix_time", now)))
    state = record.get("status", "running")
    if state == "running" and age > stale_after_s:
        state = "stale"
    return {**record, "age_s": round(age, 1), "state": state}


def summary_line(info: dict[str, Any]) -> str:
    step = f"step {info.get('step')}" + (f"/{info['max_steps']}" if info.get("max_steps") else "")
    loss = info.get("loss")
    sps = info.get("samples_per_s")
    parts = [f"{info['state']}: {step}", f"loss {loss:.4f}" if isinstance(loss, (int, float)) else "loss n/a",
             f"{sps:.1f} samples/s" if isinstance(sps, (int, float)) else None,
             f"skipped {info['skipped_nonfinite']} non-finite" if info.get("skipped_nonfinite") else None,
             f"{info['rollbacks']} rollback(s)" if info.get("rollbacks") else None,
             f"last heartbeat {info['age_s']:.0f}s ago ({info.get('time')}) from {info.get('host')}"]
    return ", ".join(p for p in parts if p)


__all__ = ["Watchdog", "NonFiniteGuard", "Heartbeat", "RunHealth", "all_ranks_finite", "read_heartbeat", "resolve_run_root",
           "describe", "summary_line", "thread_stacks", "HANG_EXIT_CODE", "OK", "SKIP", "ROLLBACK"]
