"""Contract of `models/`: where checkpoints come from.

`resolve(spec)` turns a config's model string into a Hugging Face checkpoint directory:
- `builtin:dense`, `builtin:moe`, `builtin:draft`: the project's own models (a Qwen3 policy, a Qwen3-MoE
  policy and a much smaller Qwen3 draft LM, one shared tokenizer), SFT-trained on the built-in arithmetic
  task and cached under `$SPECACTOR_CACHE` (default `~/.cache/specactor`) in a directory named by the
  recipe's key; built on first use (a few minutes on 2 cores), reused after.
- `builtin:wordy_dense`, `builtin:wordy_draft`: the same policy and draft LM SFT-trained on solutions that write
  half of their steps in words (`models.recipe.WORDY`, a tokenizer of their own), built on first use too.
- anything else: a local directory holding `config.json` and a tokenizer.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from models.recipe import WORDY, Recipe

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = {"dense": (Recipe(), "dense"), "moe": (Recipe(), "moe"), "draft": (Recipe(), "draft"),
                  "wordy_dense": (WORDY, "dense"), "wordy_draft": (WORDY, "draft")}  # name: (recipe, its model)
BUILTIN_NAMES = tuple(BUILTIN_MODELS)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    """Copies the tokenizer (and generation config) files of checkpoint `src` into checkpoint `dst`."""
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, Path(dst) / name)


def tensor_count(model_dir: str | Path) -> int:
    """How many tensors the Hugging Face checkpoint in `model_dir` holds (safetensors headers only)."""
    from safetensors import safe_open

    return sum(len(safe_open(str(f), "pt").keys()) for f in Path(model_dir).glob("*.safetensors"))


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("SPECACTOR_CACHE", Path.home() / ".cache" / "specactor")).expanduser()


def builtin_dir(recipe: Recipe | None = None) -> Path:
    return cache_root() / "models" / (recipe or Recipe()).key()


def is_built(recipe: Recipe | None = None) -> bool:
    return (builtin_dir(recipe) / "build.json").is_file()


def resolve(spec: str, build_if_missing: bool = True) -> Path:
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ModelNotFoundError(f"unknown built-in model {spec!r}; choose one of "
                                     + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES))
        recipe, model = BUILTIN_MODELS[name]
        if not is_built(recipe):
            if not build_if_missing:
                raise ModelNotFoundError("built-in models are not built yet; run `python -m models`")
            build(recipe)
        return builtin_dir(recipe) / model
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model path {spec!r} is not a Hugging Face checkpoint directory "
                                 f"(no {path / 'config.json'})")
    return path


def build(recipe: Recipe | None = None, log=print) -> Path:
    """Builds the built-in models for `recipe` unless already built; safe against concurrent builders."""
    recipe = recipe or Recipe()
    dest = builtin_dir(recipe)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(recipe):
            return dest
        from models.build import build_all  # heavy imports only when a build is needed

        tmp = dest.parent / f".{dest.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        start = time.time()
        report = build_all(recipe, tmp, log)
        report["build_seconds"] = round(time.time() - start, 1)
        (tmp / "build.json").write_text(json.dumps(report, indent=2))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        log(f"built-in models ready in {dest} ({report['build_seconds']} s)")
    return dest
