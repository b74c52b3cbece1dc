"""streamspec's own C++ CPU kernels, built on first use, for decoding passes of a few rows on CPUs
with AVX-512 BF16 (`streamspec/csrc/bf16_linear.cpp`): a linear layer in bfloat16 and in float32,
and the attention (bf16 or float32) of a few query rows against the cache.

oneDNN's bf16 inner product, the best torch offers for one row on a CPU, read this project's
model at ~9 GB/s on one core of a machine whose core reads ~27 GB/s: a decoding pass costs what
its weights' reading costs, so that gap is the step's. The kernel lays each weight out once as
one sequential stream and reads it at ~19-25 GB/s for one to six rows, seven in float32 (`python eval/linear_kernels.py`
compares them on a machine); float32 weights, laid out the same way, read at ~20 GB/s where
oneDNN's float32 read ~9. `streamspec.kernels.pack_linear_layers` uses it beside oneDNN's pack
for bf16 and float32 layers: passes of up to `MAX_ROWS` rows take it, longer ones oneDNN. The attention
(`streamspec.kernels.decode_attention_forward`, bf16 and float32 passes of up to `ATTENTION_MAX_ROWS` rows) reads
each key-value head's cached keys and values in place, with the scores, softmax and sums in float32, where the
torch path copied the whole bf16 cache to float32 in every layer of every pass (and, in float32, took 2-3x the
time in its matrix products and softmax).

It is compiled with the C++ compiler torch's extensions use (``torch.utils.cpp_extension``, ninja)
into torch's extension cache the first time a process needs it (~30 s, a line on stderr says so)
and loaded from there afterwards (rebuilt when the source changes). Where the CPU has no AVX-512
BF16, the build fails, or ``STREAMSPEC_NATIVE_KERNELS=0`` is set, `bf16_linear` is None and the
layers keep oneDNN (a warning says why when the build failed).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "bf16_linear.cpp"
#: Passes of at most this many rows take the kernel (one token with its streams, draft trees with
#: their stream rows and lookup branches); longer ones (prompts) oneDNN's blocked GEMM. It keeps up
#: to six rows' sums of a 64-output tile in registers and passes over the tile again, from cache,
#: for each further six rows. SmolLM2-135M's 210 layers + LM head (`eval/linear_kernels.py --dtype
#: bfloat16`, one thread, the dev machine's AMD EPYC, a noisy hour, median of 9, oneDNN packed in
#: brackets): 1 row 23.8 ms (34.2), 4: 27.4 (40.6), 7: 32.3 (49.2), 16: 33.1 (54.5),
#: 28: 51.4 (61.0), 64: 90.4 (125.6).
MAX_ROWS = 64
#: Passes of at most this many query rows take the attention kernel. It reads each key once per
#: query row for the scores (float32 softmax, a vectorised exp), and each value once for up to four
#: rows of a key-value head (its query heads x the pass's rows) at once. One layer, 768 keys,
#: SmolLM2's 9 query and 3 key-value heads, one thread, against torch's operators (sdpa on the
#: repeated heads): 1 row 44 us (1206), 7: 259 (664), 28: 758 (899), 64: 1672 (1906). Float32, against
#: `decode_attention_forward`'s grouped operators (sdpa above 32 rows), on another EPYC: 1 row 29 us (99),
#: 7: 133 (264), 28: 505 (840), 60: 1061 (1968).
ATTENTION_MAX_ROWS = 64
_UNSET = object()
_MODULE = _UNSET


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU reports AVX-512 BF16 (read from /proc/cpuinfo; False where that is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags


def ready() -> bool:
    """Whether the kernel is built and loaded in this process (without trying to build it)."""
    return _MODULE is not None and _MODULE is not _UNSET


def bf16_linear():
    """The built kernel module (``pack(weight)`` for a bfloat16 or float32 weight,
    ``linear(x, packed, out_features, bias)`` in the weight's dtype, ``decode_attention`` in
    bfloat16 or float32), or None where it cannot run here (see the module's docstring). Built at most once a
    process."""
    global _MODULE
    if _MODULE is not _UNSET:
        return _MODULE
    _MODULE = None
    if os.environ.get("STREAMSPEC_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if not cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils import cpp_extension

        try:  # say so when this machine has not built it yet (torch's extension cache)
            build_dir = Path(cpp_extension._get_build_directory("streamspec_bf16_linear", verbose=False))
            built = any(build_dir.glob("streamspec_bf16_linear*.so"))
        except Exception:
            built = False
        if not built:
            print("streamspec: building its bf16 CPU kernels (once per machine, ~30 s) ...", file=sys.stderr, flush=True)
        module = cpp_extension.load(name="streamspec_bf16_linear", sources=[str(_SOURCE)],
                                    extra_cflags=["-O3"], verbose=False)
        if not module.cpu_supported():
            return None
    except Exception as error:  # no compiler, no ninja, no headers: oneDNN stays
        warnings.warn(f"streamspec's bf16 CPU kernel could not be built ({type(error).__name__}: {error}); "
                      "bf16 layers use oneDNN. Set STREAMSPEC_NATIVE_KERNELS=0 to skip the attempt.",
                      RuntimeWarning, stacklevel=2)
        return None
    _register_shapes()
    _MODULE = module
    return module


_SHAPES_REGISTERED = False


def linear_shape(x, weight, bias):
    """The output of ``x @ weight.T`` without computing it (the shape functions of the packed
    linear operators: ``streamspec_native::linear_of``, ``streamspec::packed_linear``)."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def attention_shape(query, key, value, mask, scale):
    """The decoding attention's output, [B, T, H, D] for a [B, H, T, D] query, without computing
    it (the shape function of ``streamspec_native::decode_attention`` and
    ``streamspec::decode_attention``)."""
    batch, heads, rows, dim = query.shape
    return query.new_empty((batch, rows, heads, dim))


def _register_shapes() -> None:
    """Shape functions of the module's dispatcher operators (``torch.ops.streamspec_native``,
    registered by loading it), so that compiled graphs can call them; once a process."""
    global _SHAPES_REGISTERED
    if _SHAPES_REGISTERED:
        return
    _SHAPES_REGISTERED = True
    import torch

    torch.library.register_fake("streamspec_native::linear_of")(linear_shape)
    torch.library.register_fake("streamspec_native::decode_attention")(attention_shape)
