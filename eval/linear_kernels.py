"""Time the default model's linear layers with torch's default CPU kernels and with packed oneDNN
kernels (`streamspec.kernels`), for the row counts decoding uses.

    python eval/linear_kernels.py

Prints, per number of rows, the milliseconds for one pass through all linear layers of the 30
decoder layers (each with its own weight, read from memory as in a real forward) and for the LM
head, both ways (median of repeats).
"""

import argparse
import json
import time

import torch
from torch import nn

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
    args = parser.parse_args()
    model = load_default_model().eval()
    pack_linear_layers(model)
    layers = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in name]
    head = model.get_output_embeddings()
    for rows in args.rows:
        inputs = {width: torch.randn(rows, width) for width in {layer.in_features for layer in layers}}

        def body():
            for layer in layers:
                layer(inputs[layer.in_features])

        x = torch.randn(rows, head.in_features)
        entry = {"rows": rows}
        with torch.no_grad():
            with default_linear_kernels(model):
                entry["layers_default_ms"] = round(_median_ms(body, args.repeats), 1)
                entry["head_default_ms"] = round(_median_ms(lambda: head(x), args.repeats), 1)
            entry["layers_packed_ms"] = round(_median_ms(body, args.repeats), 1)
            entry["head_packed_ms"] = round(_median_ms(lambda: head(x), args.repeats), 1)
        print(json.dumps(entry), flush=True)
    print(f"{len(layers)} linear layers + LM head, torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
