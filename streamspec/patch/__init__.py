"""The patch: speculative streams in the top layers of a transformers causal LM.

`model` (`StreamedModel`, `add_streams`: the stream parameters, the multi-stream attention layers'
forward pieces, the training forward), `stream_modules` (stream-only adapters and value rotation
as modules injected once), `layout` (who attends to whom, as pure functions), `loss` (the fused
next-token and n-gram objective), `saving` and `checkpoint` (the checkpoint format: writing,
reading back strictly), `zero` (DeepSpeed ZeRO: partitioned weights, trainable-only checkpoints).
"""
