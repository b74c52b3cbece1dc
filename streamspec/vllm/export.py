"""`streamspec export --format vllm`: a streamed checkpoint as the drafter folder vLLM loads.

The folder holds a ``config.json`` (the base's own config, with the drafter's architecture, its
Ns layers, the aux layer id N−Ns vLLM feeds it, the mask token, and a ``streamspec`` section with
γ, Ns, the adapter rank and the base's facts) and ``model.safetensors``: the base's top Ns layers,
its final norm, the stream vectors and the stream adapters. No embeddings or LM head: vLLM shares
the served model's with the drafter. Runs without vLLM.

A pruned draft vocabulary (`draft_vocabulary`, ``--draft-vocab N``): the drafts are chosen among
the N ids the model itself writes most often (counted in distilled sets), so the drafter's LM head
is N rows of the target's instead of all of them. The folder then also holds ``draft_vocab`` (the
ids, ascending) and ``streamspec.draft_vocab_size``. Outputs are the same (the target verifies
every draft); a draft that would have been outside the N ids is another one, usually rejected.

Streams that read the next token (``StreamConfig.next_token_input``) also write their map W
(``next_token_map.weight``, ``streamspec.next_token_input``); they export in the DFlash layout only,
where vLLM hands the drafter that token (the bonus token's row, `streamspec.vllm.dflash`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import ARCHITECTURES, architecture
from .format import (CHECKED, DEFAULT_LAYOUT, DFLASH, DRAFTER_FORMAT, DRAFTER_FORMAT_VERSION, PEAGLE, check_layout,
                     draft_range, layout_aux_layers, recommended_drafts, streams_speculative_config)
from .lookup import parse_lookup

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def drafter_tensors(model) -> dict[str, torch.Tensor]:
    """The drafter's weights from a `StreamedModel`, named as `StreamsDrafter.load_weights` reads them."""
    from ..patch.stream_modules import stream_modules_taken_out

    config = model.stream_config
    tensors: dict[str, torch.Tensor] = {}
    first = model.num_lower_layers
    with stream_modules_taken_out(model.hf_model):
        for i, layer in enumerate(model.layers[first:]):
            for name, value in layer.state_dict().items():
                tensors[f"layers.{i}.{name}"] = value
    tensors["norm.weight"] = getattr(model.decoder, model.arch.norm).weight
    tensors["stream_vectors"] = model.streams.stream_embeddings
    if config.stream_adapter_rank is not None:
        for i, layer in enumerate(model.streams.adapters.layers):
            for key, pair in layer.items():
                tensors[f"adapters.{i}.{key}.down"] = pair.down.weight
                tensors[f"adapters.{i}.{key}.up"] = pair.up.weight
    if config.next_token_input:
        tensors["next_token_map.weight"] = model.streams.next_token_map.weight
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def drafter_config(model, base_name: str | None, layout: str = DEFAULT_LAYOUT) -> dict:
    """config.json of the drafter folder for a `StreamedModel` (see the module docstring), for
    `layout` ("peagle": vLLM's eagle3 method with parallel drafting; "dflash": its dflash method,
    which also reads the target's states entering every copied layer)."""
    from ..patch.saving import base_fingerprint

    hf = model.hf_model.config
    cfg = model.stream_config
    arch = architecture(hf.model_type, check_layout(layout))
    first = model.num_lower_layers
    out = hf.to_dict()
    out.pop("quantization_config", None)
    out["architectures"] = [arch]
    out["num_hidden_layers"] = cfg.stream_layers
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][first:]
    out["eagle_aux_hidden_state_layer_ids"] = layout_aux_layers(layout, first, cfg.stream_layers)
    mask = hf.pad_token_id if isinstance(hf.pad_token_id, int) else 0
    out["mask_token_id"] = mask
    if layout == DFLASH:  # causal attention among the query rows, as the streams were trained
        out["dflash_config"] = {"mask_token_id": mask, "causal": True}
    facts = {name: getattr(hf, name, None) for name in CHECKED}
    out["streamspec"] = {
        "format": DRAFTER_FORMAT,
        "format_version": DRAFTER_FORMAT_VERSION,
        "num_streams": cfg.num_streams,
        "stream_layers": cfg.stream_layers,
        "first_layer": first,
        "stream_adapter_rank": cfg.stream_adapter_rank,
        "mask_token_id": mask,
        "layout": layout,
        "next_token_input": bool(cfg.next_token_input),
        "num_speculative_tokens": recommended_drafts(cfg.num_streams, layout),
        "base_name": base_name,
        "base_fingerprint": base_fingerprint(model.hf_model),
        **facts,
    }
    return out


def draft_vocabulary(sources: list[str | Path], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` ids the model writes most often in the distilled sets `sources` (files or shard
    folders whose rows carry ``completion_ids``), ascending (ties: the lower id first)."""
    from ..data.distill import read_distilled

    if not 1 <= size < vocab_size:
        raise ValueError(f"a draft vocabulary is 1..{vocab_size - 1} ids (the model's vocabulary is {vocab_size}), "
                         f"got {size}")
    if not sources:
        raise ValueError("a draft vocabulary is counted in the model's own text: name distilled sets "
                         "(--draft-vocab-from FOLDER ...)")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    rows = 0
    for source in sources:
        completions = [row.get("completion_ids") for row in read_distilled(source)]
        if any(ids is None for ids in completions):
            raise ValueError(f"{source}: a row without completion_ids (a draft vocabulary is counted in the "
                             "model's own ids: distil the set with `streamspec distill`)")
        ids = torch.tensor([i for one in completions for i in one], dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"{source}: completion ids outside the model's vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)  # one count a set, not a row
        rows += len(completions)
    if not rows:
        raise ValueError(f"no rows in {[str(s) for s in sources]}")
    order = torch.sort(counts, descending=True, stable=True).indices[:size]  # ties: the lower id first
    return order.sort().values


def check_exportable(stream_config, model_type: str, layout: str = DEFAULT_LAYOUT) -> None:
    """Refuse what vLLM's drafter cannot run in `layout`, saying why."""
    from ..patch.saving import CheckpointError

    if stream_config.mode != "lossless":
        raise CheckpointError(
            "vLLM verifies with the base model alone and drafts in a separate pass over copies of its top layers; "
            "a shared-mode checkpoint's main stream attends to its streams (and carries LoRA), so what it "
            "decodes is not the base's: only lossless checkpoints export to vLLM")
    if stream_config.stream_init != "identity":
        raise CheckpointError(f"the vLLM drafter makes streams as main + rms·P_j (stream_init='identity'); this "
                              f"checkpoint has stream_init={stream_config.stream_init!r}")
    if stream_config.next_token_input and layout != DFLASH:
        raise CheckpointError("these streams read the token after each position (next_token_input), which vLLM "
                              f"hands the drafter in the {DFLASH!r} layout only (its bonus token row): export them "
                              f"with --layout {DFLASH}")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"the vLLM drafter supports {sorted(ARCHITECTURES)} bases; this checkpoint's base is "
                              f"{model_type!r}")


def export_for_vllm(checkpoint: str | Path, out: str | Path, dtype: str | torch.dtype | None = None,
                    layout: str = DEFAULT_LAYOUT, draft_vocab: int | None = None,
                    draft_vocab_from: list[str | Path] | None = None, lookup: str | list | None = None,
                    drafts: int | None = None) -> Path:
    """Write the vLLM drafter folder for a lossless streamed checkpoint into `out`, for `layout`
    (`streamspec.vllm.format.LAYOUTS`); returns it. `draft_vocab` N: drafts among the N ids the
    model writes most often in the distilled sets `draft_vocab_from` (`draft_vocabulary`).
    `lookup` ``"MIN:MAX"``: each step the request's own text is looked up for its last MAX..MIN
    tokens and what followed them replaces the streams' first drafts; ``"suffix[:CACHED]"``: suffix
    decoding's trees draft them (`streamspec.vllm.lookup`).
    `drafts` K: the drafts a step the folder asks vLLM for (default: every stream's,
    `recommended_drafts`); in the DFlash layout with `lookup`, up to 2γ (`draft_range`).

    Serve it with the line `serve_command` prints (docs/serving.md), after ``pip install
    streamspec`` in vLLM's environment."""
    check_layout(layout)
    lookup = parse_lookup(lookup)
    if draft_vocab_from and not draft_vocab:
        raise ValueError("--draft-vocab-from names the text a draft vocabulary is counted in: give its size, --draft-vocab N")
    from ..config import StreamConfig
    from ..devices import dtype_or_base
    from ..patch.checkpoint import checkpoint_folder, load_streamed, read_checkpoint_meta, recorded_base

    folder = checkpoint_folder(checkpoint)
    meta = read_checkpoint_meta(folder)
    stream_config = StreamConfig.from_dict(meta["stream_config"])
    check_exportable(stream_config, meta.get("base_model", {}).get("model_type"), layout)
    base_name = recorded_base(folder, meta)
    model = load_streamed(folder, dtype=dtype_or_base(dtype, base_name))
    tensors = drafter_tensors(model)
    config = drafter_config(model, meta.get("base_model", {}).get("name_or_path") or base_name, layout)
    if draft_vocab:
        tensors["draft_vocab"] = draft_vocabulary(list(draft_vocab_from or []), int(draft_vocab),
                                                  int(model.hf_model.config.vocab_size))
        config["streamspec"]["draft_vocab_size"] = int(draft_vocab)
    if lookup:
        config["streamspec"]["lookup"] = lookup
    if drafts is not None:
        check_drafts(int(drafts), stream_config.num_streams, layout, bool(lookup))
        config["streamspec"]["num_speculative_tokens"] = int(drafts)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    check_drafter_folder(target)
    return target


def check_drafts(drafts, num_streams: int, layout: str, lookup: bool) -> None:
    """Raise naming the range when `drafts` is not a number of drafts a step the streams drafter
    can give in `layout` (`draft_range`)."""
    least, most = draft_range(num_streams, layout, lookup)
    if not isinstance(drafts, int) or isinstance(drafts, bool) or not least <= drafts <= most:
        more = "" if lookup or layout == PEAGLE else " (up to 2γ with lookup drafts, --lookup)"
        raise ValueError(f"drafts a step must be {least}..{most} for streams with γ = {num_streams} in the {layout} "
                         f"layout{more}, got {drafts!r}")


def streams_parameters(folder: str | Path) -> int:
    """The streams' own parameters in a drafter folder: its tensors less the base's copied top
    layers and final norm and the draft vocabulary's ids: the stream vectors, adapters and
    next-token map that training changed (the early-exit head, which only trains, is not exported)."""
    from ..patch.checkpoint import file_parameters

    return file_parameters(Path(folder) / WEIGHTS_FILE,
                           skip=lambda name: name.startswith("layers.") or name in ("norm.weight", "draft_vocab"))


def check_drafter_folder(folder: str | Path) -> dict:
    """Refuse a drafter folder whose tensors are not those its config asks for; returns the config."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    facts = config.get("streamspec") or {}
    if facts.get("format") != DRAFTER_FORMAT:
        raise ValueError(f"{folder} is not a streamspec vLLM drafter folder")
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:  # names, and one tensor read
        names = set(weights.keys())
        vocab = weights.get_tensor("draft_vocab") if "draft_vocab" in names else None
    layers = {n.split(".")[1] for n in names if n.startswith("layers.")}
    expected_layers = {str(i) for i in range(facts["stream_layers"])}
    adapters = {n for n in names if n.startswith("adapters.")}
    problems = []
    if layers != expected_layers:
        problems.append(f"layers {sorted(layers)} (expected {sorted(expected_layers)})")
    if "stream_vectors" not in names or "norm.weight" not in names:
        problems.append("no stream_vectors or norm.weight")
    if ("next_token_map.weight" in names) != bool(facts.get("next_token_input")):
        problems.append(f"next_token_input={bool(facts.get('next_token_input'))} but the next_token_map tensor is "
                        f"{'present' if 'next_token_map.weight' in names else 'missing'}")
    if facts.get("next_token_input") and facts.get("layout", PEAGLE) != DFLASH:
        problems.append(f"next_token_input streams run in the {DFLASH!r} layout only, not {facts.get('layout', PEAGLE)!r}")
    if bool(adapters) != bool(facts.get("stream_adapter_rank")):
        problems.append(f"{len(adapters)} adapter tensors for stream_adapter_rank={facts.get('stream_adapter_rank')}")
    size = facts.get("draft_vocab_size")
    if size or "draft_vocab" in names:
        if (vocab is None or not size or vocab.shape != (size,) or not bool((vocab[1:] > vocab[:-1]).all())
                or int(vocab[0]) < 0 or int(vocab[-1]) >= int(facts["vocab_size"])):
            problems.append(f"draft_vocab_size={size} but the draft_vocab tensor is "
                            f"{'missing' if vocab is None else tuple(vocab.shape)} (ascending ids of the vocabulary expected)")
    try:
        lookup = parse_lookup(facts.get("lookup"))
        check_drafts(facts.get("num_speculative_tokens"), facts["num_streams"], facts.get("layout", PEAGLE),
                     bool(lookup))
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError(f"{folder}: " + "; ".join(problems))
    return config


def serve_command(folder: str | Path) -> str:
    """The ``vllm serve`` command line for a drafter folder (its base and recommended K)."""
    config = json.loads((Path(folder) / CONFIG_FILE).read_text(encoding="utf-8"))
    facts = config["streamspec"]
    layout = facts.get("layout", PEAGLE)
    spec = streams_speculative_config(layout, folder, facts["num_speculative_tokens"],
                                      parallel_drafting=layout == PEAGLE)
    base = facts.get("base_name") or "BASE"
    if base.startswith("streamspec:"):  # a built-in model: vLLM loads its converted folder
        from ..assets import builtin_model_path

        base = builtin_model_path(base)
    return f"vllm serve {base} --speculative-config '{json.dumps(spec)}'"
