"""What a user may name as a model, resolved to a local Hugging Face folder.

``None`` (the embedded default, SmolLM2-135M-Instruct), a local folder with
``config.json``, a ``.gguf`` file (converted once into the cache), or a Hugging Face repo
id (``org/name``, fetched through ``huggingface_hub`` into its own cache).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What the engine reads from a hub repo (no other weight formats, no GGUF copies).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model folder the engine can load, and the name the API serves it under."""

    path: Path
    name: str


def resolve_model(spec: str | Path | None) -> ResolvedModel:
    """Resolve ``spec`` (see the module docstring); the folder exists when this returns.

    Raises ``FileNotFoundError`` / ``ValueError`` with a message meant for the user.
    """
    from tandem.engine.default_model import DEFAULT_MODEL_NAME, default_model_path
    from tandem.engine.model.gguf_loader import converted_path, is_gguf

    if spec is None:
        return ResolvedModel(default_model_path(), DEFAULT_MODEL_NAME)
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ResolvedModel(converted_path(ggufs[0]), ggufs[0].stem)
            raise FileNotFoundError(f"no config.json in model folder {path}")
        return ResolvedModel(path, path.resolve().name)
    if path.is_file():
        if not is_gguf(path):
            raise ValueError(f"{path} is neither a model folder nor a GGUF file")
        return ResolvedModel(converted_path(path), path.stem)
    if text.endswith(".gguf") or text.startswith((".", "/", "~")) or not _REPO_ID.match(text):
        raise FileNotFoundError(f"model not found: {text} (expected a folder with config.json, a .gguf "
                                "file or a Hugging Face repo id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    return ResolvedModel(_download(text), text)


def _download(repo_id: str) -> Path:
    """The repo's snapshot folder: from the hub cache, else downloaded."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ValueError(f"{repo_id!r} looks like a Hugging Face repo id, but huggingface_hub is "
                         "not installed (pip install huggingface_hub), or pass a local folder") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, tqdm_class=hub_progress_class()))
    except LocalEntryNotFoundError:
        raise ValueError(f"cannot fetch {repo_id!r}: the Hugging Face hub is unreachable (offline?) "
                         "and the model is not in the local hub cache; download it where there "
                         "is a network, or pass a local folder or .gguf file") from None
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        raise ValueError(f"cannot fetch {repo_id!r} from the Hugging Face hub"
                         + (f" (HTTP {status})" if status else "")
                         + ": check the repo id, and HF_TOKEN for gated or private repos") from None


def hub_progress_class() -> type:
    """huggingface_hub's progress bar class, drawn only where ``tandem.engine.progress``
    draws bars (stderr a terminal); its own switches (``HF_HUB_DISABLE_PROGRESS_BARS``)
    still apply. Its per-file bars pick the terminal on their own (tqdm's ``disable=None``)."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    from tandem.engine.progress import enabled

    class TerminalOnly(hub_tqdm):
        def __init__(self, *args, **kwargs):
            if not enabled():
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return TerminalOnly
