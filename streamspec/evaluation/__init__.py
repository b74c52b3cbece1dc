"""Measuring decoding: `metrics` (SQL exact match and validity, greedy generators for each kind
of model), `benchmark` (`streamspec eval`: every method side by side on held-out prompts)."""
