"""One way to load a model for inference: a streamed checkpoint or any Hugging Face causal LM, on
a device, in a dtype.

`load_for_inference` is what every command that decodes goes through (`streamspec generate`,
`eval`, `demo`, `serve`), so ``--device`` and ``--dtype`` mean the same everywhere:

- ``device``: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``, ``cuda:1``, ``mps``;
- ``dtype``: ``auto`` (bfloat16 on CUDA, float32 elsewhere), ``float32``, ``bfloat16``,
  ``float16`` (aliases ``fp32``, ``bf16``, ``fp16``).

Greedy speculative decoding in a reduced precision is exact in the sense the README's "Reduced
precision" paragraph explains: the tokens are those of one-token-per-pass decoding *in that dtype*
up to bf16 rounding of near-ties, not those of float32 decoding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .devices import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

_STREAM_CONFIG = "stream_config.json"


@dataclass
class LoadedModel:
    """A model ready to decode, and what it is.

    Attributes:
        model: a `StreamedModel` or a `streamspec.patch.medusa.MedusaModel` (``streamed``: it
            decodes through the tree verifier) or a transformers causal LM, in eval mode.
        tokenizer: its tokenizer (with the chat template when the model has one).
        streamed: whether `model` carries speculative streams (decode it with
            `streamspec.decoding.generate`).
        source: what was loaded (the folder, hub id or ``folder/file.gguf``).
        device / dtype: where and in what precision its weights are.
    """

    model: nn.Module
    tokenizer: Any
    streamed: bool
    source: str
    device: torch.device
    dtype: torch.dtype

    @property
    def eos_ids(self) -> list[int]:
        """Every token id that ends a text (`eos_ids`)."""
        return eos_ids(self.model, self.tokenizer)

    @property
    def max_length(self) -> int | None:
        """The model's context in positions (``max_position_embeddings``), when it has one."""
        from .arch import context_positions

        return context_positions(self.model.config)


def is_streamed_checkpoint(source: str | Path) -> bool:
    """Whether `source` is a folder holding a streamed checkpoint (``stream_config.json``)."""
    return (Path(source) / _STREAM_CONFIG).is_file()


def load_for_inference(
    source: str | Path,
    *,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    device_map: str | dict | None = None,
    gguf_file: str | None = None,
    merge_lora: bool = True,
    cpu_kernels: bool = True,
    bf16_draft_head: bool = True,
    bf16_stream_rows: bool = True,
) -> LoadedModel:
    """Load `source` for decoding.

    Args:
        source: a streamed checkpoint folder (``stream_config.json``) or shipped stream weights
            (``streamspec:smollm2-135m-sql-streams``), a Medusa checkpoint folder
            (``medusa_config.json``, `streamspec.patch.medusa`), or any causal LM: a local
            folder, a hub id, `streamspec.assets.DEFAULT_MODEL_ID`, a folder with ``gguf_file``,
            or the path of a ``.gguf`` file.
        device / dtype: see `resolve_device` / `resolve_dtype` (both ``auto`` by default).
        device_map: passed to transformers (e.g. ``"auto"`` to spread a large model over GPUs);
            the model is then left where transformers put it instead of moved to `device`.
        gguf_file: the GGUF file's name inside the `source` folder (transformers dequantises it).
        merge_lora: fold a streamed checkpoint's LoRA adapter into the base (faster inference).
        cpu_kernels: on a CPU, run the linear layers through packed oneDNN kernels (float32, and
            bfloat16 where the CPU has native bf16) and a decoding pass's attention through
            `streamspec.kernels.decode_attention_forward` (`streamspec.kernels`); ignored elsewhere.
        bf16_draft_head: with `cpu_kernels`, a float32 streamed or Medusa model drafts through a
            bfloat16 copy of its LM head (`DecoderParts.use_bf16_draft_head`: the decoded tokens
            are the same, half the bytes a draft's head reads); ignored where that does not apply.
        bf16_stream_rows: with `cpu_kernels`, a float32 streamed model runs its stream rows
            through bfloat16 copies of the MSA layers' linear layers
            (`StreamedModel.use_bf16_stream_rows`: the decoded tokens are the same, the drafts'
            products read bf16 weights); ignored where that does not apply.
    """
    from .assets import BUILTIN_PREFIX

    from .assets import shipped_or_path

    target = resolve_device(device)
    precision = resolve_dtype(dtype, target)
    text = shipped_or_path(str(source))
    path = Path(text).expanduser()
    if text.endswith(".gguf") and gguf_file is None and path.is_file():
        path, gguf_file = path.parent, path.name
    local = path.exists()
    if not local and not text.startswith(BUILTIN_PREFIX) and _looks_like_path(text):
        raise FileNotFoundError(f"{text} does not exist (neither a model folder nor a file here)")
    if local and not path.is_dir():
        raise ValueError(f"{text} is a file, not a model folder (for a GGUF file pass the folder and gguf_file=)")
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {path}")

    if local and (path / "medusa_config.json").is_file():
        from .assets import load_tokenizer
        from .patch.medusa import load_medusa, medusa_base

        base = _causal_lm(medusa_base(path), precision, device_map, None) if device_map is not None else None
        model = load_medusa(path, base_model=base, dtype=precision)
        tokenizer = load_tokenizer(medusa_base(path))
        streamed = True
        name = str(path)
    elif local and is_streamed_checkpoint(path):
        from .patch.checkpoint import checkpoint_tokenizer, load_streamed, read_checkpoint_meta, recorded_base

        base = None
        if device_map is not None:
            meta = read_checkpoint_meta(path)
            name = recorded_base(path, meta)
            base = _causal_lm(name, precision, device_map, None)
        model = load_streamed(path, base_model=base, dtype=precision, merge_lora=merge_lora)
        tokenizer = checkpoint_tokenizer(path)
        streamed = True
        name = str(path)
    else:
        if local and gguf_file is None and not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} holds neither a streamed checkpoint ({_STREAM_CONFIG}) nor a "
                                    "transformers model (config.json); for a GGUF file pass gguf_file=")
        name = str(path) if local else text
        model = _causal_lm(name, precision, device_map, gguf_file)
        tokenizer = _tokenizer(name, gguf_file)
        streamed = False
        if gguf_file is not None:
            name = str(path / gguf_file)
    if device_map is None:
        # Only moved: the weights were loaded in `precision`; a blanket .to(dtype) would also
        # round buffers transformers keeps in float32 (the rotary inv_freq).
        model = model.to(target)
    else:
        target = next(model.parameters()).device
    model.eval()
    if cpu_kernels and target.type == "cpu":
        from .kernels import pack_if_available, use_decode_attention

        pack_if_available(model)
        use_decode_attention(model)
        if bf16_draft_head and hasattr(model, "use_bf16_draft_head"):
            model.use_bf16_draft_head()
        if bf16_stream_rows and hasattr(model, "use_bf16_stream_rows"):
            model.use_bf16_stream_rows()
    return LoadedModel(model=model, tokenizer=tokenizer, streamed=streamed, source=name, device=target, dtype=precision)


def _looks_like_path(text: str) -> bool:
    """A hub id is ``name`` or ``owner/name``; anything else (absolute, relative with ./, ~, more
    than one slash, a backslash) can only be meant as a local path."""
    return (text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text)


def _causal_lm(name: str, dtype: torch.dtype, device_map, gguf_file: str | None) -> nn.Module:
    """A transformers causal LM with sdpa attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    from .assets import BUILTIN_PREFIX, builtin_model_path, load_base_model

    if name.startswith(BUILTIN_PREFIX) and gguf_file is None:
        # the built-in models (streamspec:SmolLM2-135M-Instruct, the opt-in Qwen ones) live in the cache
        if device_map is None:
            return load_base_model(name, dtype=dtype)
        name = builtin_model_path(name)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except OSError as err:
        raise OSError(f"could not load the model {name!r}: it is not a local folder and could not be fetched as a "
                      f"hub id ({str(err).splitlines()[0]})") from err
    return model.eval()


def _tokenizer(name: str, gguf_file: str | None):
    from .assets import load_tokenizer

    if gguf_file is None:
        return load_tokenizer(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, gguf_file=gguf_file)




def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a text for `model`: the tokenizer's EOS and those of the model's
    generation config (chat models often end a turn with another token)."""
    ids = {int(tokenizer.eos_token_id)} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    config = getattr(getattr(model, "hf_model", model), "generation_config", None)
    extra = getattr(config, "eos_token_id", None) if config is not None else None
    ids.update([extra] if isinstance(extra, int) else extra or [])
    return sorted(ids)
