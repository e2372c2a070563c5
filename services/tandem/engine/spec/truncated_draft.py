"""A draft model cut from the target itself: its first ``N`` decoder layers, final norm, LM head.

No smaller checkpoint with the default model's vocabulary ships with tandem, so the
draft for it is the target truncated after ``N`` of its layers (the early-exit or
"self-speculative" draft): the embedding, layers ``0 .. N-1``, the final RMSNorm and
the (tied) LM head, written as an ordinary model folder that ``--speculative draft``
loads like any other. It shares the tokenizer by construction.

What it is and is not: the weights are the target's, untouched; the model was never
trained to predict from layer ``N``, so its guesses are those of a shallow network
reading a residual stream that expects 30 - N more layers. Its acceptance rate is
whatever the measurement says (``tandem bench spec --draft-layers``). Per drafted
token it costs about ``N / L`` of a target forward in the layers, plus the whole LM
head (for SmolLM2-135M: 28M of the 135M parameters), so a draft of 6 of 30 layers
reads about 36% of the target's bytes per token.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from tandem.common.cache_dir import cache_dir, publishing

FORMAT_VERSION = "v1"  # bump when the written folder changes on purpose
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "special_tokens_map.json", "chat_template.jinja")


def write_truncated_draft(target: str | Path, num_layers: int, out: str | Path) -> Path:
    """Write the draft of ``target``'s first ``num_layers`` layers into ``out`` and return it.

    ``target`` is a model folder (``config.json`` + ``*.safetensors``). Raises
    ``ValueError`` when ``num_layers`` is not in ``1 .. L - 1`` or ``out`` already
    holds a model.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(target), Path(out)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"a draft keeps 1 to {total - 1} of the target's {total} layers, "
                         f"got {num_layers}")
    if (out / "config.json").exists():
        raise ValueError(f"{out} already holds a model")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {src}")
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                m = _LAYER.match(key)
                if m is None or int(m.group(1)) < num_layers:
                    weights[key] = f.get_tensor(key)
    config["num_hidden_layers"] = num_layers
    config["tandem_draft"] = {"kind": "layer-truncated", "source": str(src.resolve()),
                              "source_layers": total, "layers": num_layers}
    with publishing(out, "draft model") as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name in _COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        save_file(weights, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source": src.name, "layers": str(num_layers)})
    return out


def truncated_draft_path(target: str | Path, num_layers: int) -> Path:
    """The cached draft of ``target``'s first ``num_layers`` layers, written on first use.

    Keyed by the target folder's path and its weight files' sizes and modification
    times, so a changed target gets a new draft.
    """
    src = Path(target).resolve()
    stats = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
             for f in sorted(src.glob("*.safetensors"))]
    key = hashlib.sha256("\n".join([str(src), *stats]).encode()).hexdigest()[:16]
    out = cache_dir() / "models" / "drafts" / f"{src.name}-{key}-layers{num_layers}-{FORMAT_VERSION}"
    if (out / "config.json").is_file():
        return out
    return write_truncated_draft(src, num_layers, out)  # a lost race keeps the other copy
