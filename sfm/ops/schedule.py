"""When the deployed flow runs: its cron schedule and the event that triggers it, from ``[retrain]``.

The flow's ``@schedule`` and ``@trigger`` decorators evaluate these on the job config.
"""

from __future__ import annotations

from typing import Any

from sfm.ops.cluster import job_of
from sfm.errors import SFMError


_NAMED_SCHEDULES = {"hourly": "0 * * * ? *", "daily": "0 0 * * ? *", "weekly": "0 0 ? * SUN *"}


def schedule_cron(config: dict | None) -> str | None:
    """The ``@schedule`` cron expression from the job config's ``[retrain] schedule`` (None: no schedule).

    ``hourly``/``daily``/``weekly`` are Metaflow's own expressions; anything else is taken as a cron
    expression as written.
    """
    value = job_of(config).retrain.schedule.strip()
    return _NAMED_SCHEDULES.get(value.lower(), value) or None


def trigger_event(config: dict | None) -> dict[str, Any]:
    """The ``@trigger`` event: ``[retrain] event``, its payload fields mapped onto the flow's parameters."""
    name = job_of(config).retrain.event.strip()
    if not name:
        raise SFMError("config [retrain] event is empty; name the Argo Event that triggers retraining")
    fields = ("surveys", "held_out", "init_from", "data_root")  # payload fields, as `sfm watch` publishes them
    return {"name": name, "parameters": {f.replace("_", "-"): f for f in fields}}
