"""Loads a config: a bare name from this folder or a YAML path, plus `a.b=c` overrides, validated."""

from __future__ import annotations

import json
import ipaddress
import math
import os
import socket
import tempfile
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.knobs import ranges
from configs.schema import INBOX_MIB, MAX_STEP_TRAJECTORIES, Config
from models.zoo import BUILTIN_MODELS, BUILTIN_NAMES, BUILTIN_PREFIX, builtin_dir
from tasks.dataset import check_held_out, eval_set, jsonl_sources, open_dataset
from tasks.jsonl import DataFormatError, load_jsonl
from transport.messages import trajectory_bytes

CONFIG_DIR = Path(__file__).resolve().parent
# the largest share of the endless arithmetic stream's draws the held-out problems may be: a cursor draws again
# (tasks/arithmetic.MAX_DRAWS times) until it finds a problem not held out, which at 90% all fail with p ~ 1e-46
MAX_HELD_OUT_SHARE = 0.9


class ConfigError(ValueError):
    """A config is wrong; the message names the key and where it came from."""


def find_config(name_or_path: str) -> Path:
    path = Path(name_or_path)
    candidates = [path] if path.suffix in (".yaml", ".yml") or path.parent != Path(".") else []
    candidates += [CONFIG_DIR / f"{name_or_path}.yaml", CONFIG_DIR / name_or_path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"no config {name_or_path!r}: not a file, and not one of the bundled configs ({names})")


def _explain(e: OmegaConfBaseException, key: str | None = None) -> str:
    message = str(getattr(e, "msg", None) or e).split("\n")[0]
    key = getattr(e, "full_key", None) or key
    return f"key '{key}': {message}" if key else message


def _unmergeable(cfg: DictConfig, given: DictConfig) -> str | None:
    """The first key of `given` whose value alone cannot be merged into `cfg` (where OmegaConf names none: a value of
    another kind than its section's or list's)."""
    for key, value in _leaves(OmegaConf.to_container(given)):
        for part in reversed(key.split(".")):
            value = {part: value}
        try:
            OmegaConf.merge(cfg, value)
        except (OmegaConfBaseException, TypeError):
            return key
    return None


def load_config(name_or_path: str, overrides: list[str] = ()) -> DictConfig:
    path = find_config(name_or_path)
    try:
        from_file = OmegaConf.load(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as e:  # ValueError: an int of 4,300+ digits
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(from_file, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    cfg = OmegaConf.structured(Config)
    try:
        cfg = OmegaConf.merge(cfg, from_file)
    except (OmegaConfBaseException, TypeError) as e:  # TypeError: a mapping where the schema has a list
        raise ConfigError(f"{path}: {_explain(e, _unmergeable(cfg, from_file))}") from None
    _refuse_numbers_for_switches(from_file, cfg, str(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command-line override {item!r} is not of the form key=value")
        where = f"command-line override {item!r} (on {path})"
        try:
            given = OmegaConf.from_dotlist([item])
            cfg = OmegaConf.merge(cfg, given)
        except (OmegaConfBaseException, TypeError) as e:
            raise ConfigError(f"{where}: {_explain(e)}") from None
        except (yaml.YAMLError, ValueError) as e:  # parsed as YAML: `[` unclosed, `*x` an unknown alias, 10**5000
            raise ConfigError(f"{where}: its value is not valid YAML ({str(e).splitlines()[0]})") from None
        _refuse_numbers_for_switches(given, cfg, where)
    try:  # interpolations (${...}) resolved here, so a bad one is a config error naming its key, not a traceback
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        if not getattr(e, "full_key", None):  # (a value of the wrong kind for its node: OmegaConf names no key)
            where = [key for key, value in _leaves(OmegaConf.to_container(cfg)) if "${" in str(value)]
            raise ConfigError(f"{path}: {_explain(e)} (interpolated keys: {', '.join(where)})") from None
        raise ConfigError(f"{path}: {_explain(e)}") from None
    if isinstance(cfg.logging.dir, str):  # expanded once, here: every later use (and config.yaml) names one place
        cfg.logging.dir = os.path.expanduser(cfg.logging.dir)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{path}: required key '{missing[0]}' is not set; set it in the file or pass "
                          f"{missing[0]}=... on the command line")
    _check_values(cfg, path)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file or directory (relative or absolute, or through `~`)."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _refuse_numbers_for_switches(given: DictConfig, cfg: DictConfig, where: str) -> None:
    """OmegaConf takes any number for a true/false key (`speculation.planner=-1` reads as true, `=0` as false): a
    number given for one is refused, naming the key."""
    for key, value in _leaves(OmegaConf.to_container(given, resolve=False)):  # as given: interpolations unresolved
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and isinstance(OmegaConf.select(cfg, key), bool):
            raise ConfigError(f"{where}: key '{key}' = {value!r}: this key is true or false, not a number")


def _check_values(cfg: DictConfig, path: Path) -> None:
    """Each key against its range (configs/schema.py), then the rules that span sections, then what the values
    name outside the config: the model, the places the run binds and writes, data. (What only other packages can
    judge, the drafters' options and the checkpoints, is driver/preflight.py's.)"""
    for key, value in _leaves(OmegaConf.to_container(cfg)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: key '{key}' = {value!r} must be a finite number")
    out_of_range = next(ranges(OmegaConf.to_object(cfg)), None)
    if out_of_range:
        key, value, why = out_of_range
        raise ConfigError(f"{path}: key '{key}' = {value!r} {why}")
    for key, ok, why in _across_sections(cfg):
        if not ok:
            raise ConfigError(f"{path}: key '{key}' = {OmegaConf.select(cfg, key)!r} {why}")
    check_model(path, "model.path", cfg.model.path)
    longest = max_positions(cfg.model.path)
    if longest is not None and cfg.model.max_model_len > longest:
        raise ConfigError(f"{path}: key 'model.max_model_len' = {cfg.model.max_model_len} is more than the "
                          f"{longest} positions {cfg.model.path!r} was built for (max_position_embeddings)")
    tp, (heads, kv_heads) = cfg.rollout.tensor_parallel_size, _heads(cfg.model.path)
    if cfg.cluster.device.value == "cuda" and heads and kv_heads and (heads % tp or (kv_heads % tp and tp % kv_heads)):
        raise ConfigError(f"{path}: key 'rollout.tensor_parallel_size' = {tp} must divide the {heads} attention heads "
                          f"of {cfg.model.path!r}, and divide or be a multiple of its {kv_heads} KV heads: vLLM "
                          "splits them among the engine's devices")
    _check_kv_cache(path, cfg)
    _check_places(path, cfg)
    parsed = {}
    for key, source in jsonl_sources(cfg.data).items():
        try:  # parsed now, naming file and line, not inside an actor after Ray and DeepSpeed started
            parsed[key] = load_jsonl(source)
        except DataFormatError as e:
            raise ConfigError(f"{path}: key '{key}' = {source!r}: {e}") from None
    if cfg.trainer.eval_every > 0:
        if len(jsonl_sources(cfg.data)) == 2 and same_file(cfg.data.source, cfg.data.eval_source):
            raise ConfigError(f"{path}: key 'data.eval_source' = {cfg.data.eval_source!r} is data.source's file: "
                              "the held-out problems would be the training problems")
        try:  # the held-out set exists (a finite training set can leave too few problems outside it)
            held_out = eval_set(cfg.data, cfg.seed)
            if cfg.data.eval_source != "arithmetic":
                check_held_out(cfg.data, held_out, parsed.get("data.source", []))
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
    if cfg.data.source == "arithmetic" and not cfg.data.size:  # an endless stream finds problems not held out
        try:
            share = open_dataset(cfg.data, cfg.seed).held_out_share()
        except ValueError as e:  # (too few problems for the held-out set, where nothing asked for it before)
            raise ConfigError(f"{path}: {e}") from None
        if share > MAX_HELD_OUT_SHARE:
            raise ConfigError(f"{path}: key 'data.eval_size' = {cfg.data.eval_size}: the held-out problems are "
                              f"{share:.0%} of what the endless training stream draws (at most "
                              f"{MAX_HELD_OUT_SHARE:.0%}, or a step may find no other problem): raise data.max_ops or "
                              "data.max_operand, or lower data.eval_size")


def draft_model_key(speculation: DictConfig) -> str:
    """The key that names the draft LM the actors run under config section `speculation` (`draft_model`)."""
    return f"speculation.options.{'draft_lm.' if speculation.method == 'fastest_of_n' else ''}model"


def draft_model(speculation: DictConfig) -> str:
    """The draft LM the actors run under config section `speculation`: what distillation trains."""
    key = draft_model_key(speculation).removeprefix("speculation.")
    return OmegaConf.select(speculation, key, default="builtin:draft")


def _across_sections(cfg: DictConfig) -> list[tuple[str, bool, str]]:
    """(key, whether it holds, why) for the rules between keys of two sections; each key is in its range."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    share = cfg.cluster.share_gpu
    return [
        ("rollout.max_tokens", cfg.rollout.max_tokens < cfg.model.max_model_len,
         f"must be < model.max_model_len ({cfg.model.max_model_len}): the prompt needs room too"),
        ("algorithm.max_staleness", cfg.algorithm.max_staleness == 0 or not cfg.trainer.deterministic,
         "must be 0 when trainer.deterministic is true (a synchronous schedule: every token sampled under the "
         "weights it is trained against)"),
        ("algorithm.max_staleness", cfg.algorithm.max_staleness <= cfg.trainer.steps,
         f"must be <= trainer.steps ({cfg.trainer.steps}): each version of staleness has every actor queue a step's "
         "groups ahead, and a bound past the run's last step bounds nothing"),
        ("speculation.distill.every_versions", cfg.speculation.distill.every_versions < cfg.trainer.steps,
         f"must be < trainer.steps ({cfg.trainer.steps}): the distiller trains on every step, and offers the actors a "
         "draft version at most this often"),
        ("speculation.distill.num_gpus", cfg.speculation.distill.num_gpus == 0 or cfg.cluster.device.value == "cuda",
         f"must be 0 unless cluster.device is cuda (it is {cfg.cluster.device.value!r})"),
        ("transport.auth", cfg.transport.auth.value != "none" or cfg.cluster.address is None,
         "is for a single-user host (every local user could speak for an actor); a cluster "
         f"(cluster.address {cfg.cluster.address!r}) needs transport.auth=curve"),
        ("cluster.share_gpu", not share or (cfg.cluster.device.value == "cuda" and cfg.learner.num_ranks == 1
                                            and cfg.rollout.num_actors == 1 and cfg.rollout.tensor_parallel_size == 1),
         "needs cluster.device cuda, one learner rank and one rollout actor of tensor_parallel_size 1"),
        ("transport.weights", not share or cfg.transport.weights.value == "zmq",
         "must be zmq with cluster.share_gpu: two processes on one GPU cannot form an NCCL group"),
        ("speculation.distill.num_gpus", not share or cfg.speculation.distill.num_gpus < 0.5,
         "must be < 0.5 with cluster.share_gpu: it is a share of the learner's half of the GPU"),
        ("transport.trajectory_queue", cfg.transport.trajectory_queue * trajectory_bytes(cfg.model.max_model_len)
         <= INBOX_MIB << 20, f"times one trajectory's bytes at model.max_model_len {cfg.model.max_model_len} "
         f"({trajectory_bytes(cfg.model.max_model_len) >> 10} KiB) must be <= {INBOX_MIB} MiB: what one peer can make "
         "the learner's inbox queue"),
        ("rollout.tensor_parallel_size", cfg.rollout.tensor_parallel_size == 1 or cfg.cluster.device.value == "cuda",
         f"must be 1 unless cluster.device is cuda (it is {cfg.cluster.device.value!r}): a CPU engine is one device"),
        ("cluster.num_cpus", cfg.cluster.num_cpus is None or cfg.cluster.address is None,
         f"is for an embedded Ray (cluster.address null, here {cfg.cluster.address!r}): a cluster's nodes offer the "
         "CPUs their `ray start --num-cpus` gave"),
        ("rollout.group_size", batch <= MAX_STEP_TRAJECTORIES, f"times rollout.prompts_per_step must be <= "
         f"{MAX_STEP_TRAJECTORIES} trajectories a step (rank 0 holds a step's trajectories; it is {batch})"),
        ("learner.micro_batch_size", batch % (cfg.learner.micro_batch_size * cfg.learner.num_ranks) == 0,
         f"times learner.num_ranks must divide the step's {batch} trajectories "
         "(rollout.prompts_per_step x rollout.group_size)"),
    ]


def _leaves(node: dict, prefix: str = ""):
    """(dotted key, value) for every value of a config as plain containers, sections walked."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_places(path: Path, cfg: DictConfig) -> None:
    """Where the run binds and writes: refused before any process starts, naming the key."""
    host = cfg.transport.host
    if not host.isascii():  # Python's resolver normalises such a name, ZeroMQ's does not: it could not bind it
        raise ConfigError(f"{path}: key 'transport.host' = {host!r} is not ASCII: write an address, or a host name "
                          "in its IDNA form")
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        raise ConfigError(f"{path}: key 'transport.host' = {host!r} is not an address of this machine") from None
    if address.is_unspecified and host != "0.0.0.0":  # '' and '0' resolve to it, and bind nothing or an odd name
        raise ConfigError(f"{path}: key 'transport.host' = {host!r} names every interface; write 0.0.0.0 (peers are "
                          "then given this machine's outward address)")
    loopback = address.is_loopback
    if cfg.transport.auth.value == "none" and not loopback:
        raise ConfigError(f"{path}: key 'transport.auth' = 'none' with transport.host = {host!r}: a socket bound "
                          "beyond loopback must be authenticated; set transport.auth=curve")
    if cfg.cluster.address is None:  # an embedded cluster: learner rank 0 binds on this machine
        with socket.socket() as probe:
            try:
                probe.bind((host, 0))
            except OSError as e:
                raise ConfigError(f"{path}: key 'transport.host' = {host!r} cannot be bound here: {e}") from None
    directory = Path(cfg.logging.dir).absolute()
    existing = next(p for p in [directory, *directory.parents] if p.exists())
    try:  # written to, not judged by its mode bits (root passes those everywhere)
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ConfigError(f"{path}: key 'logging.dir' = {cfg.logging.dir!r}: {existing} is not a writable "
                          f"directory ({e.strerror})") from None


def _hf_config(spec: str) -> dict:
    """The config.json of checkpoint directory `spec` (checked by `check_model`); {} where it is not a JSON object."""
    try:
        config = json.loads((Path(spec).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def max_positions(spec: str) -> int | None:
    """How many positions model `spec` (checked by `_check_model`) holds; None where its config does not say."""
    if spec.startswith(BUILTIN_PREFIX):
        return BUILTIN_MODELS[spec[len(BUILTIN_PREFIX):]][0].max_position
    try:
        return int(_hf_config(spec)["max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        return None


ENGINE_BLOCK_TOKENS = {"cpu": 128, "cuda": 16}  # vLLM's KV cache block where none is configured, per device


def _check_kv_cache(path: Path, cfg: DictConfig) -> None:
    """`rollout.kv_cache_mib` holds one request of `model.max_model_len` tokens (where the model's config says what a
    token takes), and on a CPU host that runs the whole run, every actor's cache fits in its memory: else the engine
    refuses to start in each actor and its replacements, and the run ends there."""
    mib, r = cfg.rollout.kv_cache_mib, cfg.rollout
    shards = r.tensor_parallel_size if cfg.cluster.device.value == "cuda" else 1
    per_token = kv_bytes_per_token(cfg.model.path, 4 if cfg.model.dtype.value == "float32" else 2, shards)
    if per_token is not None:
        # vLLM holds the cache in whole blocks, one of them its null block, never handed to a request
        block = ENGINE_BLOCK_TOKENS[cfg.cluster.device.value]
        need = per_token * block * (math.ceil(cfg.model.max_model_len / block) + 1)
        if mib << 20 < need:
            raise ConfigError(f"{path}: key 'rollout.kv_cache_mib' = {mib} cannot hold one request of "
                              f"model.max_model_len = {cfg.model.max_model_len} tokens: it needs at least "
                              f"{math.ceil(need / (1 << 20))} MiB ({per_token} bytes a token)")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if cfg.cluster.device.value == "cpu" and cfg.cluster.address is None and r.num_actors * mib << 20 > host:
        raise ConfigError(f"{path}: key 'rollout.kv_cache_mib' = {mib} times rollout.num_actors = {r.num_actors} is "
                          f"more than this machine's memory ({host / (1 << 30):.1f} GiB)")


def kv_bytes_per_token(spec: str, dtype_bytes: int, shards: int = 1) -> int | None:
    """What one token of context takes in the KV cache of model `spec` (keys and values, every layer) on each of the
    `shards` devices of a tensor-parallel engine (vLLM splits the KV heads among them, at least one each), where its
    config says so plainly (full attention over the KV heads it names); None for compressed or windowed attention, a
    config that does not name its KV heads (multi-query models mark it otherwise), or one in another shape."""
    if spec.startswith(BUILTIN_PREFIX):
        recipe, model = BUILTIN_MODELS[spec[len(BUILTIN_PREFIX):]]
        arch = getattr(recipe, model)
        return 2 * arch.layers * max(1, arch.kv_heads // shards) * arch.head_dim * dtype_bytes
    c = _hf_config(spec)
    try:
        windowed = c.get("use_sliding_window", c.get("sliding_window") is not None)
        if c.get("kv_lora_rank") or windowed or any(t != "full_attention" for t in c.get("layer_types") or []):
            return None
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
        return 2 * int(c["num_hidden_layers"]) * max(1, int(c["num_key_value_heads"]) // shards) * head_dim \
            * dtype_bytes
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _heads(spec: str) -> tuple[int | None, int | None]:
    """The attention and KV heads of model `spec`; None where its config does not say."""
    if spec.startswith(BUILTIN_PREFIX):
        recipe, model = BUILTIN_MODELS[spec[len(BUILTIN_PREFIX):]]
        return getattr(recipe, model).heads, getattr(recipe, model).kv_heads
    try:
        c = _hf_config(spec)
        return int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None, None


def vocabulary(spec: str) -> tuple[int | None, str | None]:
    """Model `spec`'s vocabulary size as its config says (`vocab_size`, or its `text_config`'s; a built-in model's
    once built; else None) and, for a built-in model, the key of the recipe whose tokenizer it was trained with (None
    for a checkpoint): built-in models of different recipes have tokenizers of their own, whatever their sizes."""
    recipe = BUILTIN_MODELS[spec[len(BUILTIN_PREFIX):]] if spec.startswith(BUILTIN_PREFIX) else None
    c = _hf_config(str(builtin_dir(recipe[0]) / recipe[1]) if recipe else spec)
    try:
        size = int(c.get("vocab_size") or c["text_config"]["vocab_size"])
    except (KeyError, TypeError, ValueError):
        size = None
    return size, recipe[0].key() if recipe else None


def check_model(path: Path, key: str, spec: str) -> None:
    """`spec` names a built-in model or a Hugging Face checkpoint directory; else a ConfigError naming `key`."""
    if spec.startswith(BUILTIN_PREFIX):
        if spec[len(BUILTIN_PREFIX):] not in BUILTIN_NAMES:
            raise ConfigError(f"{path}: key '{key}' = {spec!r} is not a built-in model; choose one of "
                              + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES))
    elif not (Path(spec).expanduser() / "config.json").is_file():
        raise ConfigError(f"{path}: key '{key}' = {spec!r} is not a Hugging Face checkpoint directory "
                          f"(no config.json there); set {key}=/path/to/checkpoint")
