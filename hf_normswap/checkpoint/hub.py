"""Push a saved checkpoint to the Hugging Face Hub with ``huggingface_hub``: create the repo, upload the folder.

The token comes from the usual places (``token=``, ``HF_TOKEN``, ``hf auth login``); the endpoint from
``HF_ENDPOINT`` (read when pushing, so a test can point it at a local server). A missing token, an invalid repo
name and an unreachable endpoint each become one :class:`PushError` line, checked before any upload.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HFValidationError, HfHubHTTPError
from huggingface_hub.utils import validate_repo_id

from ..validation import ValidationError, first_line
from . import directory, model_card
from .config_checks import check_block
from .record import ConversionRecord, converted_config

try:  # the HTTP client huggingface_hub uses; its transport errors mean "could not talk to the endpoint"
    from httpx2 import TransportError as _TransportError
except ImportError:  # pragma: no cover - older huggingface_hub on httpx
    try:
        from httpx import TransportError as _TransportError
    except ImportError:
        _TransportError = OSError

UNREACHABLE = (_TransportError, ConnectionError, TimeoutError)
CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")  # a URL's user[:password]@


class PushError(Exception):
    """A user-facing problem pushing to the Hub; the message is one line saying what to change."""


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def without_credentials(text: str) -> str:
    """``text`` with the user and password of every URL in it (``http://user:token@host``, as HF_ENDPOINT may
    hold them) replaced by ``***``: an error line is printed and logged."""
    return CREDENTIALS.sub(r"\1***@", text)


def check_repo_id(repo_id: str) -> None:
    """Raise PushError unless ``repo_id`` is ``name`` or ``owner/name`` as the Hub accepts it."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"invalid repository name {repo_id!r}: {first_line(error)}") from None


def resolve_token(token: str | None = None) -> str:
    token = token or get_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a write token is needed to push)")
    return token


def preflight(repo_id: str, token: str | None = None) -> str:
    """Check the repo name and find a token before any conversion or upload work; returns the token."""
    check_repo_id(repo_id)
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES:
        raise PushError("HF_HUB_OFFLINE is set, so nothing can be pushed: unset it, or save with --output and "
                        "push later with `normswap push`")
    return resolve_token(token)


def _link_out_of(folder: Path, files: list[str]) -> str | None:
    """The first of ``files`` that is a link out of ``folder`` (an upload would publish what it points at), or None.
    A Hub cache snapshot (``.../snapshots/REV/``) links into its own repository's ``blobs/``: that layout is allowed."""
    root = folder.resolve()
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    for name in files:
        target = (folder / name).resolve()
        if (folder / name).is_symlink() and root not in target.parents and target.parent != blobs:
            return name
    return None


def push(folder: str | os.PathLike, repo_id: str, *, private: bool = False, token: str | None = None,
         commit_message: str | None = None) -> str:
    """Create ``repo_id`` (if needed) and upload the checkpoint in ``folder`` to it; returns the repo URL. Only the
    checkpoint's own files go (:func:`directory.checkpoint_files`): a checkpoint saved into a Trainer's output_dir
    has optimizer states and other things beside it that were never meant for a public repo."""
    folder = Path(folder)
    if converted_config(folder) is None:
        raise PushError(f"{folder} is not a checkpoint saved by hf_normswap: save it with `normswap convert --output`")
    try:
        record = check_block(ConversionRecord.read(folder))
    except ValidationError as error:
        raise PushError(f"{folder}: {error}") from None
    mid_hand_over = model_card.hand_over_warning(record.hand_over)
    if mid_hand_over:  # it would be published as the converted model, which it is not
        raise PushError(f"{folder} was {mid_hand_over}; nothing was pushed")
    files = directory.checkpoint_files(folder)
    linked = _link_out_of(folder, files)
    if linked:
        raise PushError(f"{folder / linked} is a link to {(folder / linked).resolve()}, outside the checkpoint; "
                        "nothing was pushed: copy the file in, or remove the link")
    if not any(directory.WEIGHT_FILES.fullmatch(name) for name in files):
        raise PushError(f"{folder} holds no weights to push (model.safetensors or its shards)")
    token = preflight(repo_id, token)
    url = endpoint()
    try:
        repo = _upload(HfApi(endpoint=url, token=token), folder, repo_id, files, private,
                       commit_message or f"{record.method.upper()} checkpoint converted with hf-normswap")
    except PushError as error:
        raise PushError(without_credentials(str(error))) from None
    return str(repo)


def _upload(api: HfApi, folder: Path, repo_id: str, files: list[str], private: bool, message: str):
    """Create the repo and upload ``files``; the Hub's refusals and an unreachable endpoint as PushError lines."""
    url = api.endpoint
    try:
        repo = api.create_repo(repo_id, private=private or None, exist_ok=True, repo_type="model")  # None: Hub default
        api.upload_folder(folder_path=folder, repo_id=repo.repo_id, repo_type="model",
                          allow_patterns=files,  # names of [\w.-] only: no glob
                          commit_message=message)
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            raise PushError(f"the Hub at {url} rejected the token (401): set a valid HF_TOKEN or run `hf auth login`") from None
        if status == 403:
            raise PushError(f"the token cannot write to {repo_id} at {url} (403): use a write token or another owner") from None
        raise PushError(f"the Hub at {url} refused the push to {repo_id}: {first_line(error)}") from None
    except UNREACHABLE as error:
        raise PushError(f"cannot reach the Hub at {url} ({type(error).__name__}): check your network or HF_ENDPOINT") from None
    return repo
