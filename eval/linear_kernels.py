"""Time the default model's linear layers with torch's default CPU kernels, with packed oneDNN
kernels (`streamspec.kernels`) and, on CPUs with AVX-512 BF16, with streamspec's own kernel
(`streamspec.native`, bfloat16 and float32), for the row counts decoding uses.

    OMP_NUM_THREADS=1 python eval/linear_kernels.py
    OMP_NUM_THREADS=1 python eval/linear_kernels.py --dtype bfloat16 --rows 1 2 3 4 8 16

Prints, per number of rows, the milliseconds for one pass through all linear layers of the 30
decoder layers (each with its own weight, read from memory as in a real forward) and for the LM
head, each way (median of repeats), and the GB/s the weights were read at.
"""

import argparse
import contextlib
import json
import time

import torch
from torch import nn

from streamspec import native
from streamspec.assets import load_default_model
from streamspec.kernels import default_linear_kernels, pack_linear_layers


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 40, 160])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = load_default_model().eval().to(dtype)
    layers = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in name]
    head = model.get_output_embeddings()
    weight_bytes = {"layers": sum(m.weight.numel() * m.weight.element_size() for m in layers),
                    "head": head.weight.numel() * head.weight.element_size()}
    # the ways to time: torch's defaults, oneDNN packed, and streamspec's own kernel (bf16 or float32) where it runs
    ways = ["default", "packed"] + (["native"] if native.bf16_linear() else [])
    for rows in args.rows:
        inputs = {width: torch.randn(rows, width, dtype=dtype) for width in {layer.in_features for layer in layers}}

        def body():
            for layer in layers:
                layer(inputs[layer.in_features])

        x = torch.randn(rows, head.in_features, dtype=dtype)
        entry = {"rows": rows}
        with torch.no_grad():
            for way in ways:
                pack_linear_layers(model, own_kernel=way == "native")
                context = default_linear_kernels(model) if way == "default" else contextlib.nullcontext()
                with context:
                    for part, fn in (("layers", body), ("head", lambda: head(x))):
                        ms = _median_ms(fn, args.repeats)
                        entry[f"{part}_{way}_ms"] = round(ms, 1)
                        entry[f"{part}_{way}_gb_s"] = round(weight_bytes[part] / ms / 1e6, 1)
        print(json.dumps(entry), flush=True)
    print(f"{len(layers)} linear layers + LM head, {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; ways: {', '.join(ways)} (native: rows <= {native.MAX_ROWS} in a model)")


if __name__ == "__main__":
    main()
