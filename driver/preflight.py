"""The checks of a run's config that need packages above configs/: the drafter plugins' options (drafters/) and the
checkpoints a run resumes from or would overwrite (learner/). The same refusals as the loader's, naming key and
file, before any process starts: `load_run_config` is what the launcher loads a run with."""

from __future__ import annotations

import inspect
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from configs.load import (ConfigError, check_model, draft_model, draft_model_key, find_config, load_config, same_file,
                          vocabulary)
from configs.schema import SpeculationConfig
from drafters.base import DrafterLoadError, drafter_class
from learner.checkpoint import DRAFT_MODEL, UnreadableRunFile, checkpoint_state, file_sha256, resume_config, run_of
from models.zoo import BUILTIN_PREFIX
from tasks.dataset import check_prompt_lengths
from tasks.jsonl import DataFormatError
from transport.messages import MAX_DRAFTERS, MAX_NAME


def load_run_config(name_or_path: str, overrides: list[str] = ()) -> DictConfig:
    """`configs.load.load_config`, then the drafters' and the checkpoints' checks."""
    cfg = load_config(name_or_path, overrides)
    path = find_config(name_or_path)
    check_drafters(path, cfg.speculation, cfg.model.path)
    check_checkpoints(path, cfg)
    return cfg


def check_prompts_fit(cfg: DictConfig, model_dir: Path) -> None:
    """Every prompt of the run's data leaves the model room to answer, counted by the model's tokenizer in
    `model_dir`: the check that needs the model, made by the run before anything starts or is written and by
    `--plan` (a model directory without a tokenizer, a shape's config.json alone, is not checked)."""
    from transformers import AutoTokenizer

    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    try:
        check_prompt_lengths(cfg.data, AutoTokenizer.from_pretrained(str(model_dir)), cfg.model.max_model_len)
    except DataFormatError as e:
        raise ConfigError(str(e)) from None


def check_keys_read(path: Path, speculation: DictConfig) -> None:
    """No key of `speculation` is set away from its default where nothing reads it (it would do nothing): the
    drafting keys without a drafter, the distiller's without distillation."""
    unset = SpeculationConfig()
    if not speculation.distill.every_versions:
        for key in (k for k in speculation.distill if speculation.distill[k] != getattr(unset.distill, k)):
            raise ConfigError(f"{path}: key 'speculation.distill.{key}' is read only where the draft LM is distilled "
                              "(speculation.distill.every_versions > 0)")
    if speculation.method == "none":
        for key in ("options", "decoupled", "num_speculative_tokens", "planner", "max_batch"):
            if speculation[key] != getattr(unset, key):
                raise ConfigError(f"{path}: key 'speculation.{key}' is read only where speculation.method names a "
                                  "drafter (it is none)")


def check_drafters(path: Path, speculation: DictConfig, policy: str) -> None:
    """The drafters `speculation` names exist and take its options (each drafter's own `check_options`, without
    building it), fastest-of-N's members are distinct, distillation has a draft LM to train, and the draft LM shares
    the `policy` model's tokenizer where that is known (built-in models) and, to be distilled, its vocabulary size
    (a draft of a larger family may pad its vocabulary to another size: drafting needs only the same token ids)."""
    if speculation.drafters and speculation.method != "fastest_of_n":
        raise ConfigError(f"{path}: key 'speculation.drafters' is read by method fastest_of_n only "
                          f"(method is {speculation.method!r})")
    members = {} if speculation.method == "none" else {speculation.method: speculation.options}
    if speculation.method == "fastest_of_n":
        members = {name: speculation.options.get(name, {}) for name in speculation.drafters}
    if speculation.distill.every_versions > 0 and "draft_lm" not in members:
        raise ConfigError(f"{path}: key 'speculation.distill.every_versions' = {speculation.distill.every_versions}: "
                          "distillation trains the draft LM, but no drafter of speculation.method "
                          f"{speculation.method!r} is draft_lm (method draft_lm, or fastest_of_n with draft_lm among "
                          "drafters)")
    check_keys_read(path, speculation)
    if speculation.method == "none":
        return
    if speculation.method == "fastest_of_n":
        if len(speculation.drafters) > MAX_DRAFTERS or any(len(d) > MAX_NAME for d in speculation.drafters):
            raise ConfigError(f"{path}: key 'speculation.drafters': at most {MAX_DRAFTERS} drafters, each named in at "
                              f"most {MAX_NAME} characters (what a trajectory's speculation stats may carry)")
        if len(speculation.drafters) < 2 or len(set(speculation.drafters)) != len(speculation.drafters):
            raise ConfigError(f"{path}: key 'speculation.drafters' = {list(speculation.drafters)}: fastest_of_n needs "
                              "two or more distinct drafters")
        unknown = set(speculation.options) - set(speculation.drafters)
        if unknown:
            raise ConfigError(f"{path}: key 'speculation.options': {sorted(unknown)} not among speculation.drafters")
    for name, options in members.items():
        key = "speculation.method" if name == speculation.method else "speculation.drafters"
        try:
            cls = drafter_class(name)
        except DrafterLoadError as e:
            raise ConfigError(f"{path}: key '{key}': {e}") from None
        where = "speculation.options" if name == speculation.method else f"speculation.options.{name}"
        if not isinstance(options, (dict, DictConfig)):
            raise ConfigError(f"{path}: key '{where}' = {options!r}: not a mapping of option names to values")
        # plain lists and dicts, as the engine builds the drafter with
        options = OmegaConf.to_container(options) if isinstance(options, DictConfig) else dict(options)
        try:  # the drafter's own judgement, without building it (constructing one may load a model)
            cls.check_options(options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: key '{where}' = {options}: {cls.__name__}{inspect.signature(cls)} "
                              f"refuses them: {e}") from None
        if name == "draft_lm":
            draft = options.get("model", "builtin:draft")
            check_model(path, f"{where}.model", draft)
            (size, tokenizer), (policy_size, policy_tokenizer) = vocabulary(draft), vocabulary(policy)
            if tokenizer and policy_tokenizer and tokenizer != policy_tokenizer:
                raise ConfigError(f"{path}: key '{where}.model' = {draft!r} and model.path = {policy!r} are built-in "
                                  "models with tokenizers of their own: a draft LM must use the policy's tokenizer")
            if speculation.distill.every_versions > 0 and size and policy_size and size != policy_size:
                raise ConfigError(f"{path}: key '{where}.model' = {draft!r} has {size} token ids against the "
                                  f"{policy_size} of model.path = {policy!r}: distilling it from the policy "
                                  "(speculation.distill.every_versions > 0) needs the policy's vocabulary")


def same_setting(key: str, now, then) -> bool:
    """Whether a resume's `now` keeps its checkpoint's `then`: equal, or for a path one file or directory named two
    ways (relative and absolute, or through `~`)."""
    paths = key in ("model.path", "data.source", DRAFT_MODEL) and isinstance(now, str) and isinstance(then, str)
    return now == then or (paths and same_file(now, then))


def data_digest(cfg: DictConfig) -> str | None:
    """The sha256 of the run's data.source file (None: the arithmetic task), which its run.json keeps."""
    source = OmegaConf.select(cfg, "data.source", default="arithmetic")
    return None if source == "arithmetic" else file_sha256(Path(source).expanduser())


def check_data_unchanged(path: Path, cfg: DictConfig, run_dir: Path) -> None:
    """A resume's data.source holds the bytes it held when the checkpoint's run began (its run.json's digest): the
    data cursor counts prompts in that file's order, and an edited file would resume on other prompts silently."""
    try:  # (None: a run directory without the digest; an unreadable run.json has none either)
        then = run_of(run_dir, "data_sha256")
    except UnreadableRunFile:
        then = None
    now = data_digest(cfg)
    if then is not None and now is not None and now != then:
        raise ConfigError(f"{path}: key 'data.source' = {cfg.data.source!r}: the file changed since the run that wrote "
                          f"trainer.resume_from's checkpoint began (sha256 {then[:12]}..., now {now[:12]}...); a "
                          "resumed run's data cursor counts prompts in that file's order: restore it, or start a "
                          "fresh run")


def check_checkpoints(path: Path, cfg: DictConfig) -> None:
    """trainer.resume_from names a checkpoint behind trainer.steps; logging.dir holds no other run's checkpoints, and
    with logging.overwrite, which deletes them, none of the models the run starts from."""
    resumed_run = checkpoint = None
    if cfg.trainer.resume_from:
        try:
            checkpoint, state = checkpoint_state(cfg.trainer.resume_from)
            step, resumed_run = state["version"], state.get("run_id")
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise ConfigError(f"{path}: key 'trainer.resume_from': {e}") from None
        if step >= cfg.trainer.steps:
            raise ConfigError(f"{path}: key 'trainer.resume_from' is at step {step} but trainer.steps = "
                              f"{cfg.trainer.steps}; raise trainer.steps to train further (its weights, a Hugging "
                              f"Face checkpoint, are in {checkpoint / 'hf'})")
        kept = resume_config(cfg)
        for key, value in state.get("config", {}).items():  # (a key added since that checkpoint was written: unchecked)
            if key in kept and not same_setting(key, kept[key], value):
                named = draft_model_key(cfg.speculation) if key == DRAFT_MODEL else key
                raise ConfigError(f"{path}: key '{named}' = {kept[key]!r}, but the checkpoint "
                                  f"trainer.resume_from names was written with {value!r}: a resumed run keeps it (its "
                                  "weights, data order or optimizer state depend on it)")
        check_data_unchanged(path, cfg, checkpoint.parent.parent)
    try:  # a directory that holds another run's checkpoints is that run's, unless this run continues it
        held, state = checkpoint_state(cfg.logging.dir)
    except UnreadableRunFile as e:  # whose checkpoints are there is not known: another run's, as far as one can tell
        if not cfg.logging.overwrite and not cfg.trainer.resume_from:
            raise ConfigError(f"{path}: key 'logging.dir' = {cfg.logging.dir!r}: {e}; or logging.overwrite=true to "
                              "delete what is there first") from None
        held = None
    except (FileNotFoundError, KeyError, ValueError):
        held = None
    if held is not None and state.get("run_id") != resumed_run and not cfg.logging.overwrite:
        raise ConfigError(f"{path}: key 'logging.dir' = {cfg.logging.dir!r} holds another run's checkpoints (newest "
                          f"{held.name}); pass trainer.resume_from={cfg.logging.dir} to continue that run, another "
                          "logging.dir, or logging.overwrite=true to delete its checkpoints and event files first")
    checkpoints = (Path(cfg.logging.dir) / "checkpoints").resolve()
    # what logging.overwrite deletes (driver/run.py: nothing where the run resumes from one of those checkpoints) must
    # not be what this run starts from
    if cfg.logging.overwrite and (checkpoint is None or checkpoints not in checkpoint.resolve().parents):
        drafting = cfg.speculation.method == "draft_lm" or "draft_lm" in (cfg.speculation.drafters or ())
        for key, spec in (("model.path", cfg.model.path),
                          *[(draft_model_key(cfg.speculation), draft_model(cfg.speculation))] * drafting):
            where = Path(spec).expanduser().resolve()
            if not spec.startswith(BUILTIN_PREFIX) and checkpoints in (where, *where.parents):
                raise ConfigError(f"{path}: key '{key}' = {spec!r} is inside {checkpoints}, which logging.overwrite "
                                  "deletes before the run starts; copy it elsewhere, or choose another logging.dir")
