"""The model registry under ``<data-root>/registry/<model>/``: numbered versions and a champion alias.

::

    registry/<model>/v<N>/.claim              created if absent: allocates N (safe under concurrency)
    registry/<model>/v<N>/model.safetensors
    registry/<model>/v<N>/config.json
    registry/<model>/v<N>/version.json        written last: the version is complete (registry_version contract)
    registry/<model>/champion/<seq>.json      one immutable entry per promotion (registry_champion contract);
                                              the highest seq names the champion

Concurrency uses one primitive, :func:`claim`: :func:`sfm.storage.objects.write_bytes_if_absent` (a hard
link locally, a conditional ``If-None-Match: *`` PUT on S3) of a unique token, read back to confirm.
AWS S3 makes the conditional PUT atomic; some S3-compatible servers only check, then write (moto_server
does: two racing PUTs can both succeed, the later one's bytes stay), and the read-back after a short
settle time turns that into one winner. A server that ignores the condition altogether is detected
(a repeated conditional PUT must fail) and refused. It holds on a shared disk and on S3 alike, with no
lock server:

- two registrations racing for ``v<N>`` both try to create its ``.claim``; one wins, the other
  moves on to ``v<N+1>``. Each writes only inside its own folder, so nothing is lost.
- a promotion reads the newest champion entry ``seq``, decides, and creates ``seq + 1``. If another
  promotion created it first, the decision is taken again against the new champion. The champion's
  metric therefore only improves (or a forced promotion overrides it), whatever the interleaving.

A version whose registration died before ``version.json`` keeps its claimed number and is never
listed. A new version becomes champion only if its held-out metric (:class:`Champion`: ``[registry]
champion_metric``, ``masked_nmse`` by default, or a downstream gain such as ``ft_ap_gain_b4``; a task
model's held-out ``ap``) beats the champion's by at least the configured margin, unless promotion is
forced. Encoders (``sfm-mae``) and task models (``sfm-<task>``, whose config.json has a ``task`` section:
:mod:`sfm.model.segmenter`) live side by side; :func:`models` lists them all.

A version folder is a Hugging Face model folder but for its card (``from_pretrained`` opens it:
:mod:`sfm.model.hub`); :func:`export` writes one with the card. Users name a version by a reference,
``NAME[:vN|:N|:latest|:champion]``, which :func:`resolve_reference` reads; :func:`find` is what every command
that names a model calls (a reference, or a model folder). Every registration and promotion is
also logged to MLflow when one is configured (:func:`sync_mlflow`, :mod:`sfm.model.mlflow_sync`): the registry
stays the source of truth, and an MLflow that fails costs one line, never the registration.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sfm import storage
from sfm.config import RegistryConfig
from sfm.formats.contracts import validate
from sfm.errors import SFMError
from sfm.model import mlflow_sync
from sfm.model.model_card import CARD, model_card

METRIC = RegistryConfig.champion_metric  # the default champion metric (of encoders)
LOWER_IS_BETTER = ("nmse", "loss", "error")  # metric names ending so are errors; every other metric is a score
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_VERSION = re.compile(r"^v(\d+)$")
_ENTRY = re.compile(r"^(\d{8})\.json$")
FILES = ("model.safetensors", "config.json")
_MAX_RACES = 1000  # promotion attempts lost to concurrent promotions before giving up (a bug if reached)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def model_root(data_root: str, model_name: str) -> str:
    if not _NAME.match(model_name) or ".." in model_name:
        raise SFMError(f"model name {model_name!r} is not allowed; use letters, digits, '.', '_' and '-'")
    return storage.join(data_root, "registry", model_name)


def version_url(data_root: str, model_name: str, version: int) -> str:
    return storage.join(model_root(data_root, model_name), f"v{int(version)}")


def versions(data_root: str, model_name: str) -> list[int]:
    """Complete versions (those with version.json), ascending."""
    root = model_root(data_root, model_name)
    found = []
    for name in storage.list_dir(root):
        match = _VERSION.match(name)
        if match and storage.exists(storage.join(root, name, "version.json")):
            found.append(int(match.group(1)))
    return sorted(found)


S3_SETTLE_S = 0.25  # wait before reading a claim back on S3 (see the module docstring)


def claim(url: str, payload: dict[str, Any]) -> bool:
    """Create ``url`` holding ``payload`` plus a unique token if nothing is there yet; True if this call won.

    On S3 the token is read back after :data:`S3_SETTLE_S`, so a server that checks the condition and
    writes in two steps still yields one winner when two writers race; and a second conditional PUT
    of the same key must be refused, or the server ignores the condition and is rejected.
    """
    token = uuid.uuid4().hex
    data = json.dumps({**payload, "claim_token": token}, sort_keys=True).encode()
    if not storage.write_bytes_if_absent(url, data):
        return False
    if not storage.is_s3(url):
        return True  # a hard link: atomic
    if storage.write_bytes_if_absent(url, data):  # same bytes: harmless if it went through
        raise SFMError(f"the S3 endpoint of {url} does not honour conditional writes (If-None-Match), which the "
                       "registry and `sfm watch` need to allocate names safely; use AWS S3 or a server that does")
    time.sleep(S3_SETTLE_S)
    return json.loads(storage.read_bytes(url)).get("claim_token") == token


def _claimed(data_root: str, model_name: str) -> list[int]:
    root = model_root(data_root, model_name)
    return sorted(int(m.group(1)) for m in map(_VERSION.match, storage.list_dir(root)) if m)


def _allocate(data_root: str, model_name: str, owner: str) -> int:
    """Claim the next free version number; safe when several processes register at once."""
    claimed = _claimed(data_root, model_name)
    version = (claimed[-1] if claimed else 0) + 1
    while not claim(storage.join(version_url(data_root, model_name, version), ".claim"),
                    {"owner": owner, "claimed_at": _now()}):
        version += 1
    return version


def resolve(data_root: str, model_name: str, version: int | str = "champion") -> int:
    """The version number meant by ``version``: a number, ``"v3"``, ``"latest"`` or ``"champion"``."""
    text = str(version).strip()
    if text == "champion":
        champion = champion_version(data_root, model_name)
        if champion is None:
            raise SFMError(f"model {model_name!r} in {data_root} has no champion yet; register a version first")
        return champion
    if text == "latest":
        found = versions(data_root, model_name)
        if not found:
            raise SFMError(f"model {model_name!r} has no versions in {data_root}; register one first")
        return found[-1]
    number = text[1:] if text.startswith("v") else text
    if not number.isdigit() or int(number) < 1:
        raise SFMError(f"version {version!r} is not a version; use N, vN, latest or champion")
    return int(number)


_VERSION_WORDS = re.compile(r"^(v?\d+|latest|champion)$")


def is_folder_url(text: str) -> bool:
    """Whether ``text`` is a folder (a path with a '/', a leading '.', or a URL such as s3://...) rather than a
    model reference: callers that accept either check this first."""
    text = str(text).strip()
    return "://" in text or "/" in text or text.startswith(".")


def resolve_reference(data_root: str, ref: str, *, default_model: str = "") -> tuple[str, int]:
    """The (model name, version number) a model reference names in ``data_root``'s registry, the version
    checked to exist (complete):

    - ``NAME``: its champion;
    - ``NAME:vN`` or ``NAME:N``: version N; ``NAME:latest``: its newest version; ``NAME:champion``: its champion;
    - with ``default_model`` (e.g. ``[registry] model_name``), a bare ``vN``, ``N``, ``latest`` or ``champion``
      names a version of that model, as the flows' ``--encoder`` and ``--init-from`` take them.

    A folder URL is not a reference (:func:`is_folder_url`); SFMError, naming the forms, for anything else."""
    text = str(ref).strip()
    if default_model and _VERSION_WORDS.match(text):
        name, version = default_model, text
    else:
        name, sep, version = text.partition(":")
        if not name or (sep and not version) or ":" in version or is_folder_url(text):
            raise SFMError(f"{text!r} is not a model reference; use NAME, NAME:vN, NAME:latest or NAME:champion "
                           "(e.g. sfm-mae:v3), or a model folder where one is accepted")
    if not versions(data_root, name):  # also refuses a name the registry does not allow
        raise SFMError(f"model {name!r} is not in the registry at {data_root}; see `sfm registry list "
                       f"--data-root {data_root}`, or pass the --data-root it was registered in")
    number = resolve(data_root, name, version or "champion")
    get(data_root, name, number)  # a version that is not there (or not complete) is refused
    return name, number


@dataclass(frozen=True)
class ModelRef:
    """What a model reference named (:func:`find`): a registry version (``name``, ``version``, the ``data_root`` it is
    registered in) or a model folder elsewhere (``url`` alone); ``url`` is where its files are."""

    url: str
    name: str = ""
    version: int = 0
    data_root: str = ""

    def __str__(self) -> str:
        return f"{self.name}:v{self.version}" if self.name else self.url


_VERSION_FOLDER = re.compile(r"^(?P<root>.+)/registry/(?P<name>[^/]+)/v(?P<version>\d+)$")


def find(data_root: str, ref: str, *, default_model: str = "", flag: str = "") -> ModelRef:
    """The model ``ref`` names, wherever a user names one (``--encoder``, ``--init-from``, ``--model``, ``sfm registry
    show|promote|load|export|sync``): a reference of ``data_root``'s registry (:func:`resolve_reference`: ``NAME``,
    ``NAME:vN``, ``NAME:latest``, ``NAME:champion``), or a folder URL (:func:`is_folder_url`). A registry version's
    folder (``<root>/registry/NAME/vN``) is that version, in that root; any other folder is taken as it is.

    ``default_model``: the model a bare ``vN``, ``latest`` or ``champion`` used to name (``--encoder``,
    ``--init-from``); that spelling still works, with a one-line notice naming ``flag``, for one release."""
    from sfm.user_errors import deprecated

    text = str(ref).strip()
    if is_folder_url(text):
        url = storage.normalize(text).rstrip("/")
        match = _VERSION_FOLDER.match(url)
        if match and storage.exists(storage.join(url, "version.json")):
            return ModelRef(url, match["name"], int(match["version"]), match["root"])
        return ModelRef(url)
    if default_model and _VERSION_WORDS.match(text):
        deprecated(f"{flag} {text}".strip(), f"{flag} {default_model}:{text}".strip())
    name, version = resolve_reference(data_root, text, default_model=default_model)
    return ModelRef(version_url(data_root, name, version), name, version, data_root)


def get(data_root: str, model_name: str, version: int | str = "champion") -> dict[str, Any]:
    """The validated version record (``version.json``)."""
    number = resolve(data_root, model_name, version)
    url = storage.join(version_url(data_root, model_name, number), "version.json")
    if not storage.exists(url):
        raise SFMError(f"model {model_name!r} has no version v{number} in {data_root}; see `sfm registry list`")
    record = json.loads(storage.read_bytes(url))
    validate("registry_version", record, url)
    return record


# ---- champion --------------------------------------------------------------------------------


def _champion_dir(data_root: str, model_name: str) -> str:
    return storage.join(model_root(data_root, model_name), "champion")


def champion_history(data_root: str, model_name: str) -> list[dict[str, Any]]:
    """Every promotion, oldest first."""
    folder = _champion_dir(data_root, model_name)
    entries = []
    for name in storage.list_dir(folder):
        if _ENTRY.match(name):
            url = storage.join(folder, name)
            entry = json.loads(storage.read_bytes(url))
            validate("registry_champion", entry, url)
            entries.append(entry)
    return sorted(entries, key=lambda e: e["seq"])


def _latest_entry(data_root: str, model_name: str) -> dict[str, Any] | None:
    folder = _champion_dir(data_root, model_name)
    seqs = sorted(int(m.group(1)) for m in map(_ENTRY.match, storage.list_dir(folder)) if m)
    if not seqs:
        return None
    url = storage.join(folder, f"{seqs[-1]:08d}.json")
    entry = json.loads(storage.read_bytes(url))
    validate("registry_champion", entry, url)
    return entry


def champion_version(data_root: str, model_name: str) -> int | None:
    entry = _latest_entry(data_root, model_name)
    return None if entry is None else int(entry["version"])


@dataclass(frozen=True)
class Champion:
    """What makes a champion: a held-out ``metric`` every version records, better by at least ``margin``.
    Lower is better for names ending in nmse, loss or error (:data:`LOWER_IS_BETTER`), higher for the
    others (AP, F1, a fine-tuning gain)."""

    metric: str = METRIC
    margin: float = 0.0

    @property
    def lower_is_better(self) -> bool:
        return self.metric.endswith(LOWER_IS_BETTER)

    def beats(self, candidate: float, incumbent: float | None) -> bool:
        """The margin rule; an incumbent without the metric loses to any candidate that has it."""
        if incumbent is None:
            return True
        if self.lower_is_better:
            return candidate <= incumbent - self.margin
        return candidate >= incumbent + self.margin

    @classmethod
    def of(cls, registry_config) -> Champion:
        """The rule a ``JobConfig.registry`` section sets."""
        return cls(registry_config.champion_metric, float(registry_config.margin))


def maybe_promote(data_root: str, model_name: str, version: int, *, champion: Champion = Champion(),
                  force: bool = False) -> bool:
    """Make ``version`` the champion if forced, if there is none, or if it beats the champion by the rule.

    Returns whether ``version`` is the champion afterwards. Safe under concurrent promotions: the
    decision is re-taken whenever another promotion lands first.
    """
    candidate = get(data_root, model_name, version)
    value = candidate["metrics"].get(champion.metric)
    if value is None and not force:
        raise SFMError(f"{model_name} v{version} has no {champion.metric} metric; evaluate it, set [registry] "
                       "champion_metric to a metric it has, or promote with force")
    for _ in range(_MAX_RACES):
        current = _latest_entry(data_root, model_name)
        if current is not None and current["version"] == candidate["version"]:
            return True
        if current is not None and not force:
            incumbent = get(data_root, model_name, current["version"])["metrics"].get(champion.metric)
            if not champion.beats(value, incumbent):
                return False
        seq = (current["seq"] if current else 0) + 1
        entry = {"seq": seq, "version": candidate["version"], "metric": champion.metric, "value": value,
                 "forced": bool(force), "previous": current["version"] if current else None,
                 "margin": float(champion.margin), "promoted_at": _now()}
        validate("registry_champion", entry, f"{model_name} champion entry {seq}")
        if claim(storage.join(_champion_dir(data_root, model_name), f"{seq:08d}.json"), entry):
            return True
    raise RuntimeError(f"promotion of {model_name} v{version} lost {_MAX_RACES} races in a row")


# ---- register and load -------------------------------------------------------------------------


def code_version() -> str:
    """What code made a version (its lineage's ``code_version``): the package version plus the git commit of the
    checkout, when there is one."""
    import sfm

    here = Path(__file__).resolve().parent
    try:
        top, _, commit = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short=12", "HEAD"],
                                        capture_output=True, text=True, cwd=here, timeout=10).stdout.partition("\n")
    except (OSError, subprocess.SubprocessError):
        top, commit = "", ""
    commit = commit.strip() if top and Path(top) == here.parent.parent else ""  # not another repository a venv sits in
    return f"{sfm.__version__}+g{commit}" if commit else sfm.__version__


def register(data_root: str, model_name: str, model_url: str, *, config: dict, metrics: dict, lineage: dict,
             champion: Champion = Champion(), force_champion: bool = False) -> dict[str, Any]:
    """Copy an exported model into a new version and maybe promote it; returns the version record
    plus ``champion`` (whether it is the champion now)."""
    owner = lineage.get("run_pathspec", "") or "unknown"
    version = _allocate(data_root, model_name, owner)
    target = version_url(data_root, model_name, version)
    files = {}
    for name in FILES:
        data = storage.read_bytes(storage.join(model_url, name))
        storage.write_bytes(storage.join(target, name), data)
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    record = {
        "model_name": model_name, "version": version, "created_at": _now(),
        "files": files, "config": config, "metrics": metrics, "lineage": lineage,
    }
    validate("registry_version", record, f"{model_name} v{version}")
    storage.write_bytes(storage.join(target, "version.json"), json.dumps(record, indent=1, sort_keys=True).encode())
    record["champion"] = maybe_promote(data_root, model_name, version, champion=champion, force=force_champion)
    mirrored = _mirror(data_root, model_name, version, config=config)
    if mirrored is not None:
        record["mlflow"] = mirrored
    return record


def promote(data_root: str, model_name: str, version: int, *, mlflow_uri: str = "") -> None:
    """Make ``version`` the champion whatever its metric (``sfm registry promote``), and move MLflow's
    ``champion`` alias with it when MLflow is configured (see :func:`sync_mlflow` for ``mlflow_uri``)."""
    maybe_promote(data_root, model_name, version, force=True)
    _mirror(data_root, model_name, version, mlflow_uri)


# ---- MLflow, a mirror ----------------------------------------------------------------------------


def sync_mlflow(data_root: str, model_name: str, version: int, mlflow_uri: str = "", *,
                config: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Log ``version`` to MLflow unless it is there already, and point the registered model's ``champion`` alias
    at the registry's champion (:func:`sfm.model.mlflow_sync.publish`); prints one line and returns what it did,
    or None when no MLflow is configured. The tracking URI: ``mlflow_uri``, else the ``[registry] mlflow_uri`` of
    the job config the version was registered with (``config``, read from its record if not given), else
    ``MLFLOW_TRACKING_URI``. SFMError (one line) when MLflow was not updated."""
    if not mlflow_uri:
        job = get(data_root, model_name, version)["config"] if config is None else config
        mlflow_uri = (job.get("registry") or {}).get("mlflow_uri") or ""
    uri = mlflow_sync.tracking_uri(mlflow_uri)
    if not uri:
        return None
    outcome = mlflow_sync.publish(uri, RegisteredModel(data_root, model_name), version)
    print(outcome["line"], flush=True)
    return outcome


def _mirror(data_root: str, model_name: str, version: int, mlflow_uri: str = "", *,
            config: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """:func:`sync_mlflow` after a registration or promotion: an MLflow that was not updated is one line on stderr,
    never an error (the registry, the source of truth, holds the change; ``sfm registry sync`` catches up)."""
    try:
        return sync_mlflow(data_root, model_name, version, mlflow_uri, config=config)
    except SFMError as err:
        print(f"sfm mlflow: {err}", file=sys.stderr, flush=True)
        return {"error": str(err)}


@dataclass(frozen=True)
class RegisteredModel:
    """One model of a registry as a mirror or an export reads it: records, files and the champion."""

    data_root: str
    name: str

    def record(self, version: int) -> dict[str, Any]:
        return get(self.data_root, self.name, version)

    def url(self, version: int) -> str:
        return version_url(self.data_root, self.name, version)

    def folder(self, version: int) -> dict[str, bytes]:
        """The Hugging Face model folder of a version: its files (checked) plus a README.md model card."""
        files = verified_files(self.data_root, self.name, version)
        card = model_card(json.loads(files["config.json"]), self.record(version), weights=files["model.safetensors"])
        return {**files, CARD: card.encode()}

    def champion(self) -> int | None:
        return champion_version(self.data_root, self.name)


EXPORT_FORMATS = ("hf", "files")


def export(data_root: str, model_name: str, version: int, out: str, fmt: str = "hf") -> list[str]:
    """Write a version into the folder ``out`` (local or s3://) and return the file names: ``hf``, a Hugging Face
    model folder (model.safetensors, config.json and a README.md model card: what ``from_pretrained`` and the
    Hub read); ``files``, the registered files byte for byte. The files are checked against the record first."""
    if fmt not in EXPORT_FORMATS:
        raise SFMError(f"export format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    model = RegisteredModel(data_root, model_name)
    files = model.folder(version) if fmt == "hf" else verified_files(data_root, model_name, version)
    for name in sorted(files, key=lambda n: n == "config.json"):  # config.json last: the folder is complete
        storage.write_bytes(storage.join(out, name), files[name])
    return sorted(files)


def verified_files(data_root: str, model_name: str, version: int | str = "champion") -> dict[str, bytes]:
    """The version's files, each checked against the size and sha256 its record holds."""
    record = get(data_root, model_name, version)
    folder = version_url(data_root, model_name, record["version"])
    out = {}
    for name, expected in record["files"].items():
        data = storage.read_bytes(storage.join(folder, name))
        if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise SFMError(f"{storage.join(folder, name)} does not match its registry record (size or sha256); "
                           "the version is damaged: re-register it")
        out[name] = data
    return out


def models(data_root: str) -> list[str]:
    """The names of every model registered in ``data_root`` (encoders and task models), sorted."""
    return sorted(name for name in storage.list_dir(storage.join(data_root, "registry")) if _NAME.match(name))


def is_task_model(record: dict[str, Any]) -> bool:
    """Whether a version record is a task model's (a segmentation network; else an encoder)."""
    return "task" in record["lineage"]


def load(data_root: str, model_name: str, version: int | str = "champion"):
    """The registered model of that version, its files verified: a ``sfm.model.MaskedAutoencoder3D``, or
    for a task model its :class:`sfm.model.segmenter.Segmenter`."""
    from sfm.model.mae import MaskedAutoencoder3D
    from sfm.model.segmenter import Segmenter

    files = verified_files(data_root, model_name, version)
    kind = Segmenter if "task" in json.loads(files["config.json"]) else MaskedAutoencoder3D
    return kind.from_folder_files(files["config.json"], files["model.safetensors"],
                                  f"{model_name} {version} in {data_root}")
