"""Text in, text out: the `streamspec generate` command's logic."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..data.build import prompt_ids
from .generate import generate


def generate_text(checkpoint: str | Path, prompt: str, stream: bool = False, out=None, cpu_kernels: bool = True,
                  device: str = "auto", dtype: str = "auto", **kwargs) -> str:
    """Decode `prompt` with the checkpoint; print the text (as it is accepted with `stream`) and a
    one-line summary. The model is loaded by `streamspec.loading.load_for_inference` on `device`
    in `dtype` (``auto``: bfloat16 on CUDA, float32 on a CPU); with `cpu_kernels`, an fp32 model on
    a CPU runs its linear layers through packed oneDNN kernels (`streamspec.kernels`). Other
    keyword arguments go to `streamspec.decoding.generate`. `out` defaults to the current sys.stdout."""
    from ..loading import load_for_inference

    out = out if out is not None else sys.stdout
    loaded = load_for_inference(checkpoint, device=device, dtype=dtype, cpu_kernels=cpu_kernels)
    if not loaded.streamed:
        raise ValueError(f"{checkpoint} is not a streamed checkpoint (no stream_config.json); "
                         "`streamspec serve` decodes plain models too")
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = prompt_ids(tokenizer, {"prompt": prompt}).to(loaded.device)
    shown: list[int] = []
    printed = ""

    def show(tokens: list[int]) -> None:
        nonlocal printed
        shown.extend(tokens)
        text = tokenizer.decode(shown, skip_special_tokens=True)
        out.write(text[len(printed):])
        out.flush()
        printed = text

    start = time.perf_counter()
    result = generate(model, ids, eos_token_id=tokenizer.eos_token_id, on_tokens=show if stream else None, **kwargs)
    seconds = time.perf_counter() - start
    text = tokenizer.decode(result.tokens[0], skip_special_tokens=True)
    if not stream:
        out.write(text)
    n = result.tokens.shape[1]
    out.write(
        f"\n[{n} tokens in {seconds:.2f} s: {n / seconds:.1f} tokens/s, {result.tokens_per_pass:.2f} tokens per pass, "
        f"{result.forward_passes} passes]\n"
    )
    return text
