"""Quality metrics: SQL exact match and validity (Spider), ROUGE (summaries)."""

from __future__ import annotations

import re
import sqlite3


def extract_sql(text: str) -> str:
    """The SQL in a model's answer: the first fenced block if there is one, else the text; cut at
    the first ';'."""
    fenced = re.search(r"```(?:sql)?\s*(.*?)(?:```|$)", text, flags=re.S | re.I)
    if fenced:
        text = fenced.group(1)
    return text.split(";")[0].strip()


def normalize_sql(sql: str) -> str:
    """Lowercase (literals too), one space between tokens, single quotes, no trailing ";"."""
    sql = sql.strip().rstrip(";").replace('"', "'")
    sql = re.sub(r"\s*([(),=<>])\s*", r" \1 ", sql)
    return re.sub(r"\s+", " ", sql).strip().lower()


def sql_exact_match(prediction: str, gold: str) -> bool:
    return normalize_sql(extract_sql(prediction)) == normalize_sql(gold)


def sql_is_valid(prediction: str, schema: str) -> bool:
    """Does the query run against the database's schema (empty tables, in memory)?"""
    connection = sqlite3.connect(":memory:")
    try:
        connection.executescript(schema)
        connection.execute(extract_sql(prediction))
        return True
    except sqlite3.Error:
        return False
    finally:
        connection.close()


def greedy_generator(kind: str, path: str | None = None, base: str | None = None, stats: list | None = None):
    """A function ``input_ids [1, T] -> new token ids [1, n]`` (greedy) and the tokenizer, for:

    - ``"base"``: the base model itself (`base`, default the built-in SmolLM2), transformers `generate`;
    - ``"next_token"``: a peft adapter folder `path` (a next-token fine-tune) on `base`, default
      the base the adapter records;
    - ``"streamed"``: a streamed checkpoint `path`, decoded one token per pass;
    - ``"speculative"``: a streamed checkpoint `path`, decoded with speculative streaming (greedy,
      tree_top_k 3); each call's `GenerateOutput` is appended to `stats` when given.

    Every kind decodes with its own model's tokenizer (a streamed checkpoint's, an adapter's base's).
    """
    import torch

    from pathlib import Path

    from ..assets import DEFAULT_MODEL_ID, load_base_model, load_tokenizer
    from ..patch.checkpoint import adapter_base

    if kind in ("streamed", "speculative"):
        from ..patch.checkpoint import checkpoint_tokenizer, load_streamed
        from ..decoding.generate import generate, generate_autoregressive

        tokenizer = checkpoint_tokenizer(path)  # the checkpoint's own (merged folder or its recorded base)
        model = load_streamed(path, merge_lora=True)
        if kind == "streamed":
            return (lambda ids, n: generate_autoregressive(model, ids, n, tokenizer.eos_token_id)), tokenizer

        def speculative(ids, n):
            out = generate(model, ids, n, eos_token_id=tokenizer.eos_token_id)
            if stats is not None:
                stats.append(out)
            return out.tokens

        return speculative, tokenizer
    # an adapter's own base (as it records it) unless told otherwise
    base_id = base or (adapter_base(Path(path)) if kind == "next_token" and path else None) or DEFAULT_MODEL_ID
    tokenizer = load_tokenizer(base_id)
    model = load_base_model(base_id)
    if kind == "next_token":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path).merge_and_unload().eval()
    elif kind != "base":
        raise ValueError(f"kind must be one of ['base', 'next_token', 'streamed', 'speculative'], got {kind!r}")

    def run(ids, n):
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )
        return out[:, ids.shape[1]:]

    return run, tokenizer


def evaluate_sql(generate, tokenizer, rows: list[dict], max_new_tokens: int = 128) -> dict:
    """Exact match and validity of greedy answers to Spider rows, with a progress bar."""
    from tqdm.auto import tqdm

    from ..data.build import prompt_ids

    predictions, exact, valid = [], 0, 0
    for row in tqdm(rows, desc="sql eval", unit="question"):
        ids = prompt_ids(tokenizer, row)
        text = tokenizer.decode(generate(ids, max_new_tokens)[0], skip_special_tokens=True)
        hit, ok = sql_exact_match(text, row["query"]), sql_is_valid(text, row["schema"])
        exact += hit
        valid += ok
        predictions.append({"db_id": row["db_id"], "question": row["question"], "gold": row["query"],
                            "prediction": text, "exact_match": hit, "valid": ok})
    n = max(len(rows), 1)
    return {"n": len(rows), "exact_match": round(100 * exact / n, 2), "valid": round(100 * valid / n, 2),
            "predictions": predictions}
