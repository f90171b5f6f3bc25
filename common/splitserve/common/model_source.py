"""Where a model's files are: a local directory (or config.json) as given, or a Hugging Face id
resolved through huggingface_hub's cache, as vLLM's `--model` does.

    "path/to/dir", "cfg.json"  -> used as is (it exists on disk)
    "org/name" (+ revision)    -> $HF_HUB_CACHE/models--org--name/snapshots/<sha>/ (downloaded
                                  first unless HF_HUB_OFFLINE is set; the cache is HF_HUB_CACHE,
                                  else HF_HOME/hub, else huggingface_hub's default)

Resolution runs once per process at start (`splitserve` resolves its configs before running a
subcommand; `LLM` resolves its own), so the engine and the gateway only ever see a directory.
A model loaded by id is served under that id (the engine's model_id), as vLLM serves it.
Torch-free: the gateway resolves its tokenizer's directory the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from splitserve.common.config_fields import ConfigError

log = logging.getLogger("splitserve.model")

# what an engine or a gateway reads from a snapshot; a download fetches only these
HUB_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model")
_TRUE = frozenset({"1", "on", "yes", "true"})


@dataclass(frozen=True)
class ModelSource:
    """A model's files on disk and where they came from (hub_id None: a local path)."""

    path: str
    hub_id: str | None = None
    revision: str | None = None


def hub_cache_dir() -> str:
    """The hub cache as huggingface_hub finds it, read from the environment now (not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE) set to a true value."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _is_repo_id(model: str) -> bool:
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_model(model: str, revision: str | None = None, *, cache_dir: str | None = None) -> ModelSource:
    """`model` as a local path when it exists, else as a Hugging Face id in the hub cache.

    `revision` (branch, tag or commit) applies to ids only; a local path ignores it, as vLLM does.
    Raises ConfigError naming the model, the revision and the cache directory when the id cannot be
    resolved (offline and not cached, unknown repository or revision, no network)."""
    if os.path.exists(os.path.expanduser(model)):
        return ModelSource(os.path.expanduser(model))
    if not _is_repo_id(model):
        raise ConfigError(
            f"--model {model!r} is neither an existing directory or file nor a Hugging Face model id (org/name)"
        )
    cache = cache_dir or hub_cache_dir()
    offline = hub_offline()
    path = _snapshot(model, revision, cache, offline)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"--model {model!r} revision {revision or 'main'!r}: the snapshot {path} in the Hugging Face cache "
            "has no config.json; it is not a model this engine can load (or its download is incomplete)"
        )
    log.info("model %s (revision %s) resolved to %s", model, revision or "main", path)
    return ModelSource(path, hub_id=model, revision=revision)


def _snapshot(repo_id: str, revision: str | None, cache: str, offline: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    where = f"--model {repo_id!r} revision {revision or 'main'!r}"
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=list(HUB_FILE_PATTERNS),
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set, so nothing is downloaded" if offline else "and it could not be downloaded"
        raise ConfigError(
            f"{where} is not in the Hugging Face cache {cache} ({why}); download it where the network reaches "
            f"(`hf download {repo_id}" + (f" --revision {revision}" if revision else "") + "`), or point "
            "HF_HUB_CACHE / HF_HOME at a cache that holds it"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"{where} could not be fetched into the Hugging Face cache {cache}: {exc}") from None


def resolve_model_config(config: Any, name_by_hub_id: bool) -> Any:
    """A config with `model` and `revision` fields, its model resolved to a directory: `model` becomes the
    snapshot's path and, with `name_by_hub_id` (engine configs), an empty `model_id` the hub id (vLLM
    serves a model under the name it was given; the gateway takes its id from the engines' Describe).
    Local paths and an empty model (the default) leave the config as it is."""
    model = getattr(config, "model", "")
    if not model:
        return config
    source = resolve_model(model, getattr(config, "revision", "") or None)
    if source.hub_id is None:
        return config
    changes: dict[str, Any] = {"model": source.path}
    if name_by_hub_id and not config.model_id:
        changes["model_id"] = source.hub_id
    return dataclasses.replace(config, **changes)
