"""Parameters each draft method adds to a model: speculative streams (without and with stream
adapters) and Medusa heads (one residual block each, the LM head shared), for the default model
and for Llama-3.1-8B's shape (built on the meta device: no weights are loaded or downloaded).

    python eval/draft_parameters.py [--num-drafts 3] [--stream-layers 4] [--adapter-rank 32]
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from streamspec.config import StreamConfig
from streamspec.patch.medusa import MedusaConfig, add_medusa_heads
from streamspec.patch.model import add_streams

SHAPES = {
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-drafts", type=int, default=3, help="γ: streams, or Medusa heads")
    parser.add_argument("--stream-layers", type=int, default=4)
    parser.add_argument("--adapter-rank", type=int, default=32)
    args = parser.parse_args()
    for name, shape in SHAPES.items():
        with torch.device("meta"):
            def model():
                return AutoModelForCausalLM.from_config(LlamaConfig(**shape))
            base = model()
            total = sum(p.numel() for p in base.parameters())
            plain = add_streams(model(), StreamConfig(num_streams=args.num_drafts, stream_layers=args.stream_layers,
                                                      mode="lossless")).num_stream_parameters()
            adapted = add_streams(model(), StreamConfig(num_streams=args.num_drafts, stream_layers=args.stream_layers,
                                                        mode="lossless", stream_adapter_rank=args.adapter_rank)
                                  ).num_stream_parameters()
            heads = add_medusa_heads(model(), MedusaConfig(num_heads=args.num_drafts)).num_draft_parameters()
        print(json.dumps({"model": name, "base_parameters": total, "streams": plain,
                          f"streams_with_rank_{args.adapter_rank}_adapters": adapted, "medusa_heads": heads,
                          "medusa_heads_with_own_lm_heads": heads + args.num_drafts * shape["hidden_size"] * shape["vocab_size"]}))
