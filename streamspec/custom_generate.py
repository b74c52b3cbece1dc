"""Speculative streaming through transformers' own mechanism for shipping a decoding method with a
model (``custom_generate``, transformers 5.x).

A merged export (``streamspec export --merge``) is a folder `AutoModelForCausalLM.from_pretrained`
loads as the plain model; it also carries ``custom_generate/generate.py`` (which calls `generate`
below) and ``custom_generate/requirements.txt`` (naming streamspec). Then::

    model = AutoModelForCausalLM.from_pretrained(folder)
    out = model.generate(input_ids, custom_generate=folder, trust_remote_code=True, max_new_tokens=64)

decodes with speculative streaming (the streams in the folder put on the model, once), while
``model.generate(input_ids, ...)`` without it stays transformers' own. Greedy unless
``do_sample=True`` (then ``temperature``, ``top_p``, ``top_k`` and ``seed`` are read); the returned
tensor is the prompt followed by the new tokens, as transformers returns it.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

_STREAMED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its StreamedModel


def _streamed(model):
    """The model with the streams of the folder it was loaded from (made once per model)."""
    if model in _STREAMED:
        return _STREAMED[model]
    from .patch.checkpoint import load_streamed
    from .patch.saving import CONFIG_FILE

    folder = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"custom_generate needs the model loaded from a merged streamspec export (a folder with "
                         f"{CONFIG_FILE}); this one was loaded from {str(folder) or 'nowhere'!r}")
    streamed = load_streamed(folder, base_model=model).eval()
    _STREAMED[model] = streamed
    return streamed


def generate(model, inputs: torch.Tensor | None = None, generation_config=None, streamer=None, **kwargs):
    """transformers' ``custom_generate`` entry: see the module docstring."""
    from .decoding.generate import generate as streamspec_generate

    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("custom_generate needs input_ids")
    config = generation_config if generation_config is not None else model.generation_config
    max_new_tokens = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None) or 20
    sample = bool(kwargs.get("do_sample", getattr(config, "do_sample", False)))
    sampling = {}
    if sample:
        sampling = {"temperature": kwargs.get("temperature", getattr(config, "temperature", 1.0) or 1.0),
                    "top_p": kwargs.get("top_p", getattr(config, "top_p", 1.0) or 1.0),
                    "top_k": kwargs.get("top_k", getattr(config, "top_k", None)), "seed": kwargs.get("seed")}
    streamed = _streamed(model)
    eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    mask = kwargs.get("attention_mask")
    out = streamspec_generate(streamed, input_ids, int(max_new_tokens), eos_token_id=eos, attention_mask=mask,
                              **sampling)
    if input_ids.shape[0] == 1:
        new = out.tokens.to(input_ids.device)
        if mask is not None and not mask.bool().all():
            input_ids = input_ids[:, mask[0].bool()]
        result = torch.cat([input_ids, new], dim=1)
    else:  # a batch: rows padded after their end with the pad (or EOS) token
        pad = getattr(config, "pad_token_id", None)
        pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
        lengths = getattr(out, "lengths", None) or [out.tokens.shape[1]] * input_ids.shape[0]
        width = max(lengths)
        new = torch.full((input_ids.shape[0], width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
        for row, n in enumerate(lengths):
            new[row, :n] = out.tokens[row, :n]
        result = torch.cat([input_ids, new], dim=1)
    if streamer is not None:
        streamer.put(result.cpu())
        streamer.end()
    return result
