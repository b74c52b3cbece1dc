"""The distilled sets kept in the repository (`distilled/`, what the recipes train on): each a
set as `streamspec distill --engine vllm` writes it (its manifest counts every shard it holds, as
the shards count themselves), with no row from a test-only source."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from streamspec.data.distill_shards import read_manifest, read_shard, shard_files, shard_index, shard_stats
from streamspec.data.sources import SOURCES

ROOT = Path(__file__).resolve().parents[2]
KEPT = sorted(p for p in (ROOT / "distilled").glob("*") if (p / "manifest.json").is_file())


@pytest.mark.skipif(not KEPT, reason="no distilled set is kept")
@pytest.mark.parametrize("folder", KEPT, ids=lambda p: p.name)
def test_a_kept_set_is_whole_and_its_manifest_counts_its_shards(folder):
    manifest = read_manifest(folder)
    files = shard_files(folder)
    assert files and all(f.name.endswith(".jsonl.gz") for f in files)
    recorded = manifest["shards"]
    assert sorted(recorded) == [f"{shard_index(f):05d}" for f in files]  # every shard counted, none missing
    total = Counter()
    for path in files:
        rows = read_shard(path)
        assert shard_stats(rows) == recorded[f"{shard_index(path):05d}"]
        total.update(shard_stats(rows))
        # no test-only source, and every row a turn the trainer can read
        assert not {r["source"].partition("@")[0] for r in rows} & {n for n, s in SOURCES.items() if s.test_only}
        assert all(r["completion_ids"] and ("messages" in r or "prompt" in r) for r in rows)
    assert {k: manifest["counts"][k] for k in total} == dict(total)
    assert manifest["model"] == "streamspec:SmolLM2-135M-Instruct" and manifest["engine"] == "vllm"
