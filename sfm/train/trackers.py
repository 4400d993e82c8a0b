"""Where a run's figures go while it runs: Accelerate's experiment trackers (``[train] trackers``: tensorboard,
mlflow, wandb, aim, ..., the names Accelerate's ``log_with`` takes), on the main process, and the live copy of
the files they write to ``<run_root>/tensorboard/``. Pretraining (:mod:`sfm.train.trainer`) and fine-tuning
(:mod:`sfm.finetune.job`, and its held-out scores) report through it::

    trackers = Trackers(cfg, run_root, "sfm-pretrain", enabled=main)
    trackers.start(run_params(cfg, world_size=8), first_step=restored + 1)
    trackers.log({"loss": 0.41, "lr": 1e-3}, step=120)
    trackers.close()  # every tracker finished, the files copied a last time

The trackers write to a local folder; :class:`FolderSync`, a thread of its own, copies what grew there to
``<run_root>/tensorboard/<project>/`` every ``[train] tracker_sync_s`` seconds (event files only grow: on S3 a
whole-object PUT of each grown file, on a local or shared file system the new bytes appended), off the step's
path, and a last time when the run ends or raises. A run that is killed (SIGKILL; SIGTERM, on which Python ends a
process without cleaning up; a node lost) keeps what the last copy held: at most ``tracker_sync_s`` seconds of
figures are lost. A hung step goes on being copied until the watchdog ends the process (``step_timeout_s``).

A resumed run does not show a step twice: its TensorBoard writer opens a new event file with ``purge_step`` =
the first step it runs (:meth:`Trackers.start`), and TensorBoard, which reads every event file of the folder in
order, drops what earlier files logged from that step on (the killed attempt's steps after its last
checkpoint). A rollback to a checkpoint does the same (:meth:`Trackers.restart`). Other trackers keep their own
history: MLflow starts a run per attempt, named after the run root.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from sfm import storage
from sfm.config import JobConfig
from sfm.errors import SFMError, redact

log = logging.getLogger("sfm.train.trackers")

Track = Callable[[dict[str, float], int], None]  # (figures by name, step) -> logged
RUN_ROOT_TAG = "sfm.run_root"  # the MLflow runs' tag naming the run root they log


def run_params(cfg: JobConfig, **facts: Any) -> dict[str, str]:
    """What the trackers record of the run: the job config as {section.key: text} (the MLflow tracking URI left
    out, every value redacted) and ``facts`` of this run (world size, strategy, ...)."""
    from sfm.model.mlflow_sync import config_params

    params = dict(config_params(cfg.to_dict()))
    params.update({k: str(v) for k, v in facts.items()})
    return {k: redact(v) for k, v in params.items()}


class FolderSync:
    """Copies the files under ``local`` that changed since their last copy (size or modification time) to
    ``url``, keeping the relative paths: every ``every_s`` seconds on a daemon thread (none for 0), and once more
    at :meth:`stop`. A failed copy is retried at the next one; the first failure of a series is logged."""

    def __init__(self, local: str, url: str, every_s: float):
        self.local, self.url, self.every_s = Path(local), url, every_s
        self.copied: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) copied
        self.failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sfm-tracker-sync", daemon=True) if every_s > 0 else None

    def start(self) -> "FolderSync":
        if self._thread is not None:
            self._thread.start()
        return self

    def sync(self) -> int:
        """Copy what changed; returns the number of files copied."""
        count = 0
        for path in sorted(self.local.rglob("*")):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key = path.relative_to(self.local).as_posix()
            seen = (st.st_size, st.st_mtime_ns)
            before = self.copied.get(key)
            if before == seen:
                continue
            grown_from = before[0] if before is not None and before[0] <= st.st_size else 0
            storage.upload_grown(path, storage.join(self.url, key), grown_from)
            self.copied[key] = seen
            count += 1
        return count

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sync()
            except Exception as err:  # the next sync tries again; training goes on
                if not self.failing:
                    log.warning("could not copy the trackers' files to %s (%s); trying again every %gs",
                                self.url, redact(str(err)), self.every_s)
                self.failing = True
            else:
                if self.failing:
                    log.info("the trackers' files reach %s again", self.url)
                self.failing = False

    def stop(self) -> int:
        """End the thread (after the copy it is in), then copy what changed since; returns the files copied."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
        return self.sync()


class Trackers:
    """The experiment trackers of one run (``cfg.train.trackers``) on its main process; with ``enabled`` False (the
    other ranks) or no tracker named, every call does nothing. ``project``: the TensorBoard run folder and the
    MLflow experiment (``sfm-pretrain``, ``sfm-finetune``). Built before the run, started once its first step is
    known (:meth:`start`), closed once (:meth:`close`; also at the process's exit, should it end otherwise)."""

    def __init__(self, cfg: JobConfig, run_root: str, project: str, *, enabled: bool = True):
        self.names = tuple(cfg.train.trackers) if enabled else ()
        self.project, self.run_root, self.every_s = project, run_root, cfg.train.tracker_sync_s
        self.mlflow_uri = cfg.registry.mlflow_uri
        self.url = storage.join(run_root, "tensorboard")
        self.local: str | None = None  # the folder the trackers write to, once started
        self.started: list = []  # accelerate.tracking.GeneralTracker
        self.sync: FolderSync | None = None

    def start(self, params: dict[str, str] | None = None, first_step: int | None = None) -> "Trackers":
        """Start every tracker and record ``params`` (:func:`run_params`) with each. ``first_step``: the first step
        this run logs; TensorBoard drops what earlier event files of the folder logged from it on (a resumed or
        retried run's attempts before it). None: nothing is dropped (scores added to a finished run)."""
        if not self.names:
            return self
        from accelerate import PartialState

        # Accelerate's trackers log through its logger, which needs its process state: the trainer's Accelerator made
        # it; elsewhere (a fine-tuning rank, the evaluate step) it describes the process as it is (its group, if any)
        PartialState()
        self.local = tempfile.mkdtemp(prefix="sfm-tb-")
        atexit.register(self.close)
        for name in self.names:
            self.started.append(self._tracker(name, first_step))
        if params:
            for tracker in self.started:
                tracker.store_init_configuration(params)
        self.sync = FolderSync(self.local, self.url, self.every_s).start()
        return self

    def _tracker(self, name: str, first_step: int | None):
        """Accelerate's tracker ``name``, started; its files (if any) under the local folder."""
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        options: dict[str, Any] = {}
        if name == "tensorboard" and first_step is not None:
            options["purge_step"] = first_step
        if name == "mlflow":
            options.update(run_name=os.path.basename(self.run_root.rstrip("/")) or self.project,
                           tags={RUN_ROOT_TAG: redact(self.run_root)}, run_id=self._mlflow_run(first_step))
        kind = LOGGER_TYPE_TO_CLASS[name]
        tracker = kind(self.project, self.local, **options) if kind.requires_logging_directory else \
            kind(self.project, **options)
        tracker.main_process_only = False  # built on the main process only (a fine-tuning rank has no Accelerator)
        try:
            tracker.start()
        except Exception as err:
            first = (redact(str(err)).splitlines() or [type(err).__name__])[0]
            where = " (registry.mlflow_uri or MLFLOW_TRACKING_URI)" if name == "mlflow" else ""
            raise SFMError(f"train.trackers: {name} did not start ({first}); fix its settings{where} or leave it "
                           "out of train.trackers") from err
        return tracker

    def _mlflow_run(self, first_step: int | None) -> str | None:
        """Set MLflow up: it logs where the registry mirrors versions (sfm.model.mlflow_sync.tracking_uri),
        asynchronously (a slow or unreachable server never holds a step up; the run's end waits for what is
        queued). The run to continue: for scores added to a finished run (``first_step`` None) its newest MLflow
        run, if there is one; else None, a new run."""
        import mlflow

        from sfm.model.mlflow_sync import URI_ENV, tracking_uri

        uri = tracking_uri(self.mlflow_uri)
        if uri:
            before = os.environ.get(URI_ENV)
            mlflow.set_tracking_uri(uri)  # which also exports MLFLOW_TRACKING_URI: later code of this process (a
            if before is None:  # registration that would mirror to it) must not see the job's URI as the user's
                os.environ.pop(URI_ENV, None)
            else:
                os.environ[URI_ENV] = before
        mlflow.config.enable_async_logging(True)
        root = redact(self.run_root)
        if first_step is not None or "'" in root:
            return None
        runs = mlflow.search_runs(experiment_names=[self.project], filter_string=f"tags.`{RUN_ROOT_TAG}` = '{root}'",
                                  order_by=["attributes.start_time DESC"], max_results=1, output_format="list")
        return runs[0].info.run_id if runs else None

    def log(self, values: dict[str, float], step: int) -> None:
        """``values`` (numbers by name) at ``step``, to every tracker."""
        for tracker in self.started:
            tracker.log(values, step=step)

    def under(self, prefix: str) -> Track | None:
        """:meth:`log` with every name under ``prefix`` (``probe`` -> ``probe/loss``); None while nothing is tracked
        (the other ranks: no figure need be computed for it)."""
        if not self.started:
            return None
        return lambda values, step: self.log({f"{prefix}/{k}": v for k, v in values.items()}, step)

    def restart(self, step: int) -> None:
        """The run goes back and logs from ``step`` again (a rollback to a checkpoint): TensorBoard continues in a
        new event file that drops what this run logged from ``step`` on."""
        for i, tracker in enumerate(self.started):
            if tracker.name == "tensorboard":
                tracker.finish()
                self.started[i] = self._tracker("tensorboard", step)

    def close(self) -> None:
        """Finish every tracker (flushing what they hold) and copy the files a last time; the local folder goes.
        Idempotent. A failed last copy is logged, not raised: the run's outcome is not the logs'."""
        atexit.unregister(self.close)
        started, self.started = self.started, []
        for tracker in started:
            try:
                tracker.finish()
            except Exception as err:
                log.warning("tracker %s did not finish cleanly: %s", tracker.name, redact(str(err)))
        if self.sync is not None:
            sync, self.sync = self.sync, None
            try:
                sync.stop()
            except Exception as err:
                log.warning("the trackers' last files did not reach %s: %s", self.url, redact(str(err)))
        if self.local is not None:
            shutil.rmtree(self.local, ignore_errors=True)
            self.local = None


def log_scores(cfg: JobConfig, run_root: str, project: str, scores: dict[str, Any], step: int, prefix: str) -> None:
    """The numbers among ``scores`` (nested ones dotted) added to a finished run's trackers at ``step``, each name under
    ``prefix`` (a fine-tuned model's held-out scores: ``held_out/ap``): TensorBoard in a new event file of the run's
    folder, MLflow in the run's newest MLflow run."""
    from sfm.model.mlflow_sync import metric_numbers

    trackers = Trackers(cfg, run_root, project).start()
    try:
        trackers.log({f"{prefix}/{k}": v for k, v in metric_numbers(scores)}, step)
    finally:
        trackers.close()
