"""Registry versions mirrored to MLflow, for teams that track experiments and register models there.

The registry (:mod:`sfm.model.registry`) stays the source of truth; MLflow gets a copy of each version and a
``champion`` alias that follows the registry's champion::

    experiment <model>                  one run per version, named <model>-v<N>
        params      the job config, flattened (train.max_steps, registry.champion_metric, ...)
        metrics     the version's numeric metrics (masked_nmse, ft_ap_gain_b4, ap, ...; nested ones dotted)
        tags        sfm.model, sfm.version, sfm.kind, sfm.registry (the version folder), sfm.lineage.<key>
                    (run, manifest and code version, surveys, encoder, labels), the model card as the run's note
        artifacts   model/: model.safetensors, config.json, README.md (the model card), version.json
    registered model <model>            one model version per registry version, tagged sfm.version=N, from model/
        alias "champion"                the model version of the registry's champion

MLflow numbers its model versions itself, so its version 3 is the registry's v3 only when every version reached
it; the ``sfm.version`` tag and the alias say which is which. :func:`publish` is idempotent: a version with a
finished run is not logged again, and a champion MLflow never got (it was down then) is logged when the alias
moves to it. Nothing secret reaches MLflow: the configured tracking URI is not a parameter, and every value is
redacted (:func:`sfm.errors.redact`); give MLflow credentials through its own variables
(``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` / ``MLFLOW_TRACKING_TOKEN``), never in the URI.

The MLflow client is the ``mlflow`` extra (``pip install 'sfm[mlflow]'``, mlflow-skinny); it is imported here
only, on use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from sfm.errors import SFMError, redact

ALIAS = "champion"
VERSION_TAG = "sfm.version"
URI_ENV = "MLFLOW_TRACKING_URI"
# The client's HTTP settings while it logs a version, unless the user set them: a few retries instead of its
# default seven with doubling backoff (minutes against an unreachable server, while a flow step waits), and no
# "View run" lines of its own (publish prints one line)
_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "60", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
_SECRET_KEYS = ("registry.mlflow_uri",)  # config keys never sent (a URI may carry a token)


def tracking_uri(configured: str = "") -> str:
    """The MLflow tracking URI to log to: ``configured`` (``[registry] mlflow_uri``), else ``MLFLOW_TRACKING_URI``,
    else "" (none: nothing is logged)."""
    return str(configured or os.environ.get(URI_ENV, "")).strip()


def publish(uri: str, model, version: int) -> dict[str, Any]:
    """Log ``version`` of ``model`` to the MLflow at ``uri`` unless it is there, then point the ``champion`` alias
    at the model's champion. ``model``: a :class:`sfm.model.registry.RegisteredModel` (``name``, ``record(v)``,
    ``url(v)``, ``folder(v)``, ``champion()``). Returns {"uri", "run_id", "model_version", "champion": [registry
    version, MLflow version] or None, "line": the one line to print}; SFMError, one line, when MLflow was not
    updated (unreachable, refused, no client installed)."""
    shown = redact(uri)
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise SFMError(f"{model.name} v{version} is registered, but MLflow at {shown} was not updated: the MLflow "
                       "client is not installed; pip install 'sfm[mlflow]', then: sfm registry sync "
                       f"{model.name}:v{version}") from None
    try:
        with _client_settings():
            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            run_id, mlflow_version = _log_version(client, model, version)
            champion = _move_alias(client, model)
    except Exception as err:  # whatever MLflow or its transport raised: the registration stands, MLflow lags
        reason = redact(" ".join(str(err).split()))[:300]
        raise SFMError(f"{model.name} v{version} is registered, but MLflow at {shown} was not updated "
                       f"({type(err).__name__}: {reason}); once it is reachable: sfm registry sync "
                       f"{model.name}:v{version}") from None
    line = (f"sfm mlflow: {model.name} v{version} is run {run_id} and model version {mlflow_version} at {shown}"
            + (f"; alias {ALIAS} -> model version {champion[1]} (v{champion[0]})" if champion else ""))
    return {"uri": shown, "run_id": run_id, "model_version": mlflow_version, "champion": champion, "line": line}


@contextlib.contextmanager
def _client_settings() -> Iterator[None]:
    added = [key for key in _CLIENT_ENV if key not in os.environ]
    os.environ.update({key: _CLIENT_ENV[key] for key in added})
    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(logging.WARNING)  # not its INFO lines ("Waiting up to 300 seconds for model version ...")
    try:
        yield
    finally:
        logger.setLevel(level)
        for key in added:
            os.environ.pop(key, None)


def _log_version(client, model, version: int) -> tuple[str, str]:
    """(run id, MLflow model version) of a registry version, logging the run and the model version if missing."""
    experiment = client.get_experiment_by_name(model.name)
    experiment_id = experiment.experiment_id if experiment else _create_experiment(client, model.name)
    runs = client.search_runs([experiment_id], max_results=1, filter_string=(
        f"tags.`{VERSION_TAG}` = '{version}' and attributes.status = 'FINISHED'"))
    run = runs[0] if runs else _log_run(client, experiment_id, model, version)
    _create_registered_model(client, model.name)
    found = client.search_model_versions(f"name = '{model.name}' and run_id = '{run.info.run_id}'")
    if found:
        return run.info.run_id, found[0].version
    created = client.create_model_version(model.name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id,
                                          tags={VERSION_TAG: str(version)},
                                          description=redact(f"{model.name} v{version} of the sfm registry at "
                                                             f"{model.url(version)}"))
    return run.info.run_id, created.version


def _log_run(client, experiment_id: str, model, version: int):
    from mlflow.entities import Metric, Param
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VAL_LENGTH

    record = model.record(version)
    folder = model.folder(version)
    tags = {"sfm.model": model.name, VERSION_TAG: str(version), "sfm.registry": model.url(version),
            "sfm.kind": "task" if "task" in record["lineage"] else "encoder", "sfm.created_at": record["created_at"],
            "mlflow.note.content": folder["README.md"].decode()}
    tags.update({f"sfm.lineage.{k}": v if isinstance(v, str) else json.dumps(v, sort_keys=True)
                 for k, v in record["lineage"].items()})
    run = client.create_run(experiment_id, run_name=f"{model.name}-v{version}",
                            tags={k: redact(v)[:MAX_TAG_VAL_LENGTH] for k, v in tags.items()})
    try:
        now = int(time.time() * 1000)
        params = [Param(k, redact(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in config_params(record["config"])]
        metrics = [Metric(k, v, now, 0) for k, v in metric_numbers(record["metrics"])]
        for start in range(0, max(len(params), len(metrics)), MAX_PARAMS_TAGS_PER_BATCH):
            client.log_batch(run.info.run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH],
                             metrics=metrics[start:start + MAX_PARAMS_TAGS_PER_BATCH])
        with tempfile.TemporaryDirectory(prefix="sfm-mlflow-") as tmp:
            files = {**folder, "version.json": redact(json.dumps(record, indent=1, sort_keys=True)).encode()}
            for name, data in files.items():
                Path(tmp, name).write_bytes(data)
            client.log_artifacts(run.info.run_id, tmp, artifact_path="model")
        client.set_terminated(run.info.run_id, "FINISHED")
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(run.info.run_id, "FAILED")  # not a finished run: a later sync logs it again
        raise
    return client.get_run(run.info.run_id)


def _move_alias(client, model) -> tuple[int, str] | None:
    """Point the alias at the MLflow version of the registry's champion, logging the champion first if MLflow never
    got it; re-read the champion afterwards and repeat if it changed meanwhile, so of two registrations that race,
    the later alias write is the newer champion's. (registry version, MLflow version), or None without a champion."""
    for _ in range(5):
        champion = model.champion()
        if champion is None:
            return None
        found = client.search_model_versions(f"name = '{model.name}' and tags.`{VERSION_TAG}` = '{champion}'")
        mlflow_version = found[0].version if found else _log_version(client, model, champion)[1]
        client.set_registered_model_alias(model.name, ALIAS, mlflow_version)
        if model.champion() == champion:
            return champion, mlflow_version
    raise RuntimeError(f"the champion of {model.name} kept changing while MLflow's alias was moved")


def _create_experiment(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, tags={"sfm.model": name})
    except MlflowException as err:  # created by a registration racing this one
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def _create_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, tags={"sfm.model": name}, description=(
            f"{name}: the sfm registry's versions; alias {ALIAS} is its champion"))
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def _flat(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def config_params(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The job config as (section.key, text) pairs, lists as JSON, the tracking URI left out (what a registered
    version's run and a training run's trackers record, sfm.train.trackers)."""
    return [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in _flat(config) if k not in _SECRET_KEYS]


def metric_numbers(metrics: dict[str, Any]) -> list[tuple[str, float]]:
    """The metrics MLflow can chart: finite numbers (booleans as 0/1), nested dicts' as dotted names."""
    out = []
    for key, value in _flat(metrics):
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out.append((key, float(value)))
    return out
