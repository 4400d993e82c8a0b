"""Model folders the Hugging Face tools open: ``from_pretrained``, ``save_pretrained`` and ``push_to_hub``.

A model folder holds ``model.safetensors`` and ``config.json`` (sfm's export format: :func:`sfm.model.io.save`,
:func:`sfm.model.segmenter.save_segmenter`) and a ``README.md`` model card (:mod:`sfm.model.model_card`): what
huggingface_hub's ``PyTorchModelHubMixin`` saves, with sfm's config. A registry version folder
(``registry/<model>/vN``) is one without the card, and ``sfm registry export NAME:vN DIR`` writes one with it.

:class:`HubFolder` gives :class:`sfm.model.mae.MaskedAutoencoder3D` and :class:`sfm.model.segmenter.Segmenter`
the mixin's three methods, with its arguments. It is not the mixin itself: that would import huggingface_hub
with the model (a third of a second in every training process and `sfm` command) and wrap the constructor the
distributed strategies wrap too. huggingface_hub is imported only to reach the Hub (a repo id, a push), so
a local folder loads with torch alone, offline (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from sfm.errors import SFMError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"


def config_bytes(config: dict[str, Any]) -> bytes:
    """A model folder's config.json, as every writer of one encodes it."""
    return json.dumps(config, indent=2, sort_keys=True).encode()


class HubFolder:
    """``from_pretrained`` / ``save_pretrained`` / ``push_to_hub`` for a model class that says how its folder's
    files are made (:meth:`folder_files`) and read (:meth:`from_folder_files`)."""

    def folder_files(self, meta: dict[str, Any] | None = None) -> dict[str, bytes]:
        """{``model.safetensors``: the weights, ``config.json``: the architecture plus ``meta``'s keys}."""
        raise NotImplementedError

    @classmethod
    def from_folder_files(cls, config: bytes, weights: bytes, where: str):
        """The model a config.json and a model.safetensors describe (``where`` names them in errors)."""
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, folder_or_repo: str | os.PathLike, *, revision: str | None = None,
                        token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                        local_files_only: bool = False, force_download: bool = False, map_location: str = "cpu"):
        """The model of a folder (a local path, an s3:// URL, a registry version folder) or of a Hub repo id
        (``org/name``; downloaded through huggingface_hub's cache, with ``revision``, ``token`` and the rest
        meaning what they mean there), on ``map_location``, in eval mode."""
        config, weights, where = read_folder(folder_or_repo, revision=revision, token=token, cache_dir=cache_dir,
                                             local_files_only=local_files_only, force_download=force_download)
        return cls.from_folder_files(config, weights, where).to(map_location).eval()

    def save_pretrained(self, save_directory: str | os.PathLike, *, card: str | None = None,
                        push_to_hub: bool = False, repo_id: str | None = None, **push_kwargs) -> str | None:
        """Write the folder: model.safetensors, config.json and, unless the folder has one, a README.md model
        card (``card``, or one made from the config). With ``push_to_hub``, push it to ``repo_id`` (default: the
        folder's name) and return the commit's URL."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        files = self.folder_files()
        for name in (WEIGHTS, CONFIG):
            (folder / name).write_bytes(files[name])
        if not (folder / CARD).exists():
            (folder / CARD).write_text(card if card is not None else self.model_card(files))
        if push_to_hub:
            return self.push_to_hub(repo_id or folder.name, card=card, **push_kwargs)
        return None

    def push_to_hub(self, repo_id: str, *, card: str | None = None, private: bool | None = None,
                    token: str | None = None, branch: str | None = None, create_pr: bool | None = None,
                    commit_message: str = "Push sfm model") -> str:
        """Create ``repo_id`` on the Hub if needed and upload the folder :meth:`save_pretrained` writes, in one
        commit; returns the commit's URL. To publish a registered version with its full card, push the folder
        ``sfm registry export`` wrote instead (``hf upload ORG/NAME DIR``)."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo = api.create_repo(repo_id=repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory(prefix="sfm-push-") as tmp:
            self.save_pretrained(tmp, card=card)
            return str(api.upload_folder(repo_id=repo, folder_path=tmp, commit_message=commit_message,
                                         revision=branch, create_pr=create_pr))

    @staticmethod
    def model_card(files: dict[str, bytes]) -> str:
        """The card of a model outside the registry: what its config and weights say."""
        import json

        from .model_card import model_card

        return model_card(json.loads(files[CONFIG]), weights=files[WEIGHTS])


def read_folder(folder_or_repo: str | os.PathLike, **hub: Any) -> tuple[bytes, bytes, str]:
    """(config.json, model.safetensors, where) of a local folder, a storage URL (s3://, file://) or a Hub repo id;
    ``hub``: huggingface_hub's download arguments (revision, token, cache_dir, local_files_only, force_download)."""
    text = os.fspath(folder_or_repo)
    if os.path.isdir(text):
        folder = Path(text)
        missing = [name for name in (CONFIG, WEIGHTS) if not (folder / name).is_file()]
        if missing:
            raise SFMError(f"{text} is not a model folder (no {' or '.join(missing)}); give a folder that "
                           "save_pretrained or `sfm registry export` wrote")
        return (folder / CONFIG).read_bytes(), (folder / WEIGHTS).read_bytes(), text
    if "://" in text:
        from sfm import storage

        url = storage.normalize(text)
        if not storage.exists(storage.join(url, CONFIG)):
            raise SFMError(f"{text} holds no model folder (no {CONFIG}); give the folder save_pretrained or "
                           "`sfm registry export` wrote")
        return storage.read_bytes(storage.join(url, CONFIG)), storage.read_bytes(storage.join(url, WEIGHTS)), url
    return _download(text, **hub)


def _download(repo_id: str, **hub: Any) -> tuple[bytes, bytes, str]:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=[CONFIG, WEIGHTS, CARD], **hub))
    except (OSError, ValueError) as err:  # huggingface_hub's: not found, no access, offline (OSError), bad id
        raise SFMError(f"{repo_id} is neither a model folder here nor a Hub repo that could be fetched "
                       f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); give the folder "
                       "save_pretrained or `sfm registry export` wrote, or a repo id with Hub access") from None
    return read_folder(folder)
