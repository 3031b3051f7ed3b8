"""Contract of `configs/`: the one structured schema every YAML in this folder is validated against.

Each YAML names only what differs from these defaults. `configs.load.load_config` merges file and
command-line overrides onto this schema, so an unknown key, a wrong type or an unset required value
(`???`) is an error naming the key and the file before any process starts. Each key is a `knob`: its default,
its meaning and, where its type alone does not bound it, its range (configs/knobs.py), checked at load; a section's
`check` holds the rules between two of its own keys. `python -m configs --describe` writes docs/configuration.md
from this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from configs.knobs import Rule, at_least, between, knob, more_than, named, one_of, zero_or_between
from sampling.coupled import MAX_RUN_SEED
from tasks.arithmetic import ArithmeticTask
from transport.messages import MAX_TOKENS

# the longest timeout (about 116 days): Ray and Python's locks take timeouts as bounded integers (1e17 s overflows)
MAX_TIMEOUT_S = 10_000_000
STALL_FLOOR_S = 10.0  # the least rollout.stall_timeout_s: five of an actor's heartbeats (actor/rollout.HEARTBEAT_S)
MAX_OPS = 10_000  # data.max_ops: beyond any context (a question of that many operations has 20,000+ characters)
MAX_TRAINING_SET = 1_000_000  # data.size: larger finite sets are as good as endless (0)
MAX_EVAL_SIZE = 10_000  # data.eval_size: an evaluation answers each problem (GSM8K's test split has 1,319)
MAX_STEP_TRAJECTORIES = 1 << 20  # rollout.prompts_per_step x group_size: a step's trajectories, held by rank 0
# the most transport.trajectory_queue x one trajectory's bytes: what one connection queues in the inbox
MAX_TOP_K = (1 << 31) - 1  # rollout.top_k: engines hold it as int32; any k past the vocabulary means off
MAX_CPUS = 1_000_000  # cluster.num_cpus: more than any machine offers (Ray fails to start a node at 2^40)
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # Ray's own, not custom resources a role can name
CUSTOM_RESOURCE = Rule(lambda v: bool(str(v).strip()) and v not in RAY_RESOURCES
                       and not str(v).startswith(("node:", "accelerator_type:")),
                       "a custom resource's name, not empty nor one of Ray's own (CPU, GPU, memory, "
                       "object_store_memory, node:..., accelerator_type:...)")
INBOX_MIB = 16384


class Dtype(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class LogLevel(Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class Device(Enum):
    cpu = "cpu"
    cuda = "cuda"


class TransportAuth(Enum):
    curve = "curve"
    none = "none"


class WeightTransport(Enum):
    zmq = "zmq"
    nccl = "nccl"


class StepOrder(Enum):
    cursor = "cursor"
    arrival = "arrival"


class LossAggregation(Enum):
    token_mean = "token_mean"
    seq_mean_token_mean = "seq_mean_token_mean"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"


@dataclass
class ModelConfig:
    """The policy the actors sample and the learner trains."""

    path: str = knob(MISSING, "a Hugging Face checkpoint directory (with its config.json), or a built-in model: "
                              "builtin:dense, builtin:moe, builtin:draft, builtin:wordy_dense, builtin:wordy_draft")
    dtype: Dtype = knob(Dtype.float32, "the rollout engines' weights and activations")
    max_model_len: int = knob(1024, "the longest prompt plus answer the rollout engines hold, in tokens; it bounds "
                              "the bytes of a trajectory message the learner accepts", between(16, MAX_TOKENS))


@dataclass
class DataConfig:
    """The training prompts and the held-out set."""

    source: str = knob("arithmetic", "the built-in task (arithmetic), or the path of a GSM8K-style JSONL file")
    max_ops: int = knob(ArithmeticTask.max_ops, "arithmetic task: the longest problems have this many operations",
                        between(1, MAX_OPS, "[]", "a question writes out every operation: the longest must fit "
                                "model.max_model_len, which the model's tokenizer checks before the run starts"))
    max_operand: int = knob(ArithmeticTask.max_operand, "arithmetic task: operands are drawn from 1..max_operand",
                            at_least(1))
    tail_exponent: float = knob(ArithmeticTask.tail_exponent, "arithmetic task: P(ops = k) ~ k^-tail_exponent "
                                "(0: uniform)", at_least(0, "0: every difficulty equally often"))
    size: int = knob(ArithmeticTask.size, "arithmetic task: > 0: that many problems, repeated in epochs; 0: endless",
                     between(0, MAX_TRAINING_SET, "[]", "0: a new problem per prompt, never a held-out one; the load "
                             "builds a set to keep it out of the held-out problems, about 15 s at the limit"))
    eval_source: str = knob("arithmetic", "held-out problems for trainer.eval_every: arithmetic (the training mix "
                            "under another seed, minus any training problem) or a GSM8K-style JSONL file (its first "
                            "eval_size records, none asking a JSONL data.source's question, none twice)")
    eval_size: int = knob(256, "how many held-out problems an evaluation answers (a JSONL eval_source holds at least "
                          "as many)",
                          between(1, MAX_EVAL_SIZE, "[]", "every evaluation generates an answer to each"))


@dataclass
class RolloutConfig:
    """The rollout actors: how many, and how each samples."""

    num_actors: int = knob(1, "rollout actors, each with its own engine", at_least(1))
    tensor_parallel_size: int = knob(1, "devices per rollout engine (cuda only: 1 on cpu); divides the model's "
                                     "attention heads (checked at load)", at_least(1))
    prompts_per_step: int = knob(4, "GRPO groups consumed per learner step", at_least(1))
    group_size: int = knob(8, "samples per prompt", at_least(2, "GRPO compares samples within a group"))
    max_tokens: int = knob(400, "the longest answer sampled, in tokens; below model.max_model_len (the prompt needs "
                           "room too)", at_least(1))
    temperature: float = knob(1.0, "sampling temperature (held-out evaluation answers greedily besides)",
                              between(0.01, 2, "[]", "vLLM's range: it refuses one above 2, and samples at 0.01 below "
                                      "0.01, where the learner would score the samples at another temperature"))
    top_p: float = knob(1.0, "nucleus sampling: the smallest set of tokens holding this much probability",
                        between(0, 1, "(]"))
    top_k: int = knob(0, "sample among the k most likely tokens (0, or more than the vocabulary: off)",
                      between(0, MAX_TOP_K))
    kv_cache_mib: int = knob(256, "KV cache per device: the CPU engine's, or each GPU's of a tensor-parallel engine; "
                             "holds at least one request of model.max_model_len, and on a CPU host that runs the "
                             "whole run every actor's fits in its memory (both checked at load)", at_least(1))
    max_restarts: int = knob(3, "a rollout actor that dies is replaced (its unfinished groups re-issued) this often "
                             "per run", at_least(0))
    stall_timeout_s: float = knob(
        300.0, "an actor the learner has heard nothing from (no trajectory, no heartbeat) this long while it waits "
        "for groups, or whose run loop (asked over Ray) has not turned this long, is taken for hung, stopped and "
        "replaced like a dead one (0: never); beyond the longest weight application and engine step",
        zero_or_between(STALL_FLOOR_S, MAX_TIMEOUT_S, "never", "an actor speaks every 2 s, and longer apart during a "
                        "long engine step; below that a healthy actor is taken for hung, killed and replaced until "
                        "rollout.max_restarts ends the run"))
    start_timeout_s: float = knob(
        1800.0, "a first rollout actor that has sent nothing this long after the learner began waiting for groups, "
        "or not answered the driver this long after it first asked (an engine that never finishes starting), is "
        "stopped and replaced like a dead one (0: never); beyond the longest engine start: loading the weights and, "
        "on GPUs, capturing graphs",
        zero_or_between(STALL_FLOOR_S, MAX_TIMEOUT_S, "never",
                        "below that a healthy engine is taken for hung while it starts"))
    update_wait_s: float = knob(
        30.0, "how long a new weight version waits for the training groups in flight to finish under the weights "
        "they started with before the actor applies it anyway, preempting them: their context is then recomputed "
        "under the new weights, so every later token is a sample of exactly the new version (0: apply at once, "
        "always preempting)", at_least(0, "0: apply new weights at once"))


@dataclass
class DistillConfig:
    """Online distillation of the draft LM the actors run (learner/distill.py), on learner rank 0."""

    every_versions: int = knob(0, "publish a new draft version at most every N policy versions (0: the draft LM is "
                               "frozen); > 0 needs a draft_lm drafter (speculation.method draft_lm, or fastest_of_n "
                               "with draft_lm among speculation.drafters)", at_least(0, "0: the draft LM stays frozen"))
    lr: float = knob(1.0e-4, "AdamW learning rate, a step per micro_batch_size trajectories (1e-3 undoes the draft "
                     "on grpo_tiny)", more_than(0))
    top_k: int = knob(16, "the policy's top-k tokens per position are the soft targets", at_least(1))
    micro_batch_size: int = knob(16, "trajectories per optimizer step (the policy's step re-cut by length)",
                                 at_least(1))
    wrong_weight: float = knob(1.0, "extra loss weight where the draft would have proposed another token than "
                               "committed", at_least(0))
    num_gpus: float = knob(0.0, "share of rank 0's GPU the distiller runs on (rank 0 keeps the rest; 0: CPU; > 0 "
                           "only when cluster.device is cuda)", between(0, 1, "[)", "a share of rank 0's GPU"))
    max_restarts: int = knob(3, "a distiller that dies, or hangs in a step (past the longer of trainer."
                             "step_timeout_s and rollout.start_timeout_s), is replaced (from the newest draft "
                             "version) this often per run", at_least(0))
    zero_advantage_rows: bool = knob(False, "also teach from the rows the GRPO step does not train (zero advantage): "
                                     "rank 0 forwards them for the distiller after publishing each step (under ZeRO-3 "
                                     "every rank, every step), a forward of its own; false: the distiller learns from "
                                     "the forwards the step makes anyway")


@dataclass
class SpeculationConfig:
    """Lossless speculative decoding in the rollout engines: which drafter proposes tokens, and how many."""

    method: str = knob("none", "none, or the drafter that proposes tokens for coupled verification: a built-in "
                       "(ngram, suffix, draft_lm, fastest_of_n), a dotted path to a drafters.base.Drafter subclass, "
                       "or the name of a specactor.drafters entry point")
    num_speculative_tokens: int = knob(4, "k: the most draft tokens proposed per request and engine step",
                                       between(1, 64, "[]", "the planner weighs each of them per request and step"))
    planner: bool = knob(True, "the cost-model planner (actor/draft_planner.py) chooses 0..num_speculative_tokens "
                         "drafts per request every step from measured step and drafting costs, each request's "
                         "acceptance and how likely it is to run on (where requests ended); false: always the full k")
    decoupled: bool = knob(False, "drafts for the next engine step are prepared while this step verifies (beside a "
                           "CPU engine by the drafter in a process of its own, actor/drafter_process.py; on a GPU on a "
                           "thread and CUDA stream of its own), for the outcome where every draft is accepted and, "
                           "from the draft LM, the "
                           "likeliest ones where a draft is rejected or its first guess is wrong "
                           "(actor/draft_ahead.py); a request whose outcome "
                           "it was takes them, one that missed drafts at once only where the cost model says it pays. "
                           "Every built-in drafter (fastest_of_n races its members' preparations)")
    max_batch: int = knob(0, "never draft while more than this many requests run (0: no bound)",
                          at_least(0, "0: no limit"))
    options: Dict[str, Any] = knob({}, "keyword arguments of the drafter's constructor, checked by the drafter at "
                                   "load")
    drafters: List[str] = knob([], "method fastest_of_n only: its members, two or more distinct (names as for "
                               "method); options then maps a member to its arguments")
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class LearnerConfig:
    """The DeepSpeed learner ranks and their optimizer."""

    num_ranks: int = knob(1, "learner ranks (processes; one GPU each on cuda)", at_least(1))
    zero_stage: int = knob(0, "DeepSpeed ZeRO stage", one_of(0, 1, 2, 3))
    dtype: Dtype = knob(Dtype.float32, "the learner's weights and activations (bfloat16: mixed precision)")
    lr: float = knob(1e-5, "AdamW learning rate", more_than(0))
    warmup_steps: int = knob(0, "linear learning-rate warmup over this many learner steps (lets Adam's moments "
                             "settle)", at_least(0))
    weight_decay: float = knob(0.0, "AdamW weight decay", at_least(0))
    grad_clip: float = knob(1.0, "gradient norm clipping (0: no clipping)", at_least(0, "0: no clipping"))
    micro_batch_size: int = knob(8, "trajectories per rank per forward and backward pass; times num_ranks it must "
                                 "divide a step's rollout.prompts_per_step x rollout.group_size", at_least(1))


@dataclass
class AlgorithmConfig:
    """The GRPO objective and which trajectories it trains on."""

    max_staleness: int = knob(1, "never train on a trajectory more than this many policy versions old (0 when "
                              "trainer.deterministic is true)", at_least(0))
    step_order: StepOrder = knob(
        StepOrder.cursor, "which whole groups a step takes (learner/intake.py). cursor: a step trains its data "
        "cursors, waiting for their stragglers, no group dropped for being slow. arrival: a step trains the first "
        "whole groups to arrive: faster; slow (long) groups overtaken by later ones can come too late for the "
        "staleness bound and are dropped, so training sees fewer long answers")
    clip_low: float = knob(0.2, "PPO clip below: the ratio is clipped at 1 - clip_low", between(0, 1, "()"))
    clip_high: float = knob(0.2, "PPO clip above: the ratio is clipped at 1 + clip_high (> clip_low: DAPO's "
                            "clip-higher)", more_than(0))
    dual_clip: float = knob(3.0, "dual-clip PPO: with a negative advantage a token's loss is at most dual_clip x "
                            "|advantage| (0: off), so no token whose ratio the clip above leaves whole (a stale or "
                            "forged behaviour logprob far below the policy's) outweighs the batch",
                            zero_or_between(1, 1e6, "off", "a ratio cap below 1 would cap tokens PPO already clips"))
    kl_coef: float = knob(0.0, "> 0: k3 KL penalty to a frozen reference policy (the run's starting weights); "
                          "logged as rl/kl", at_least(0))
    normalize_advantage_std: bool = knob(True, "divide group advantages by their standard deviation; false: "
                                         "Dr.GRPO's unscaled group advantages")
    loss_aggregation: LossAggregation = knob(
        LossAggregation.seq_mean_token_mean, "token_mean (DAPO): mean over all tokens of the batch. "
        "seq_mean_token_mean (GRPO): mean over tokens, then over sequences. seq_mean_token_sum_norm (Dr.GRPO): "
        "token sum / max_tokens, mean over sequences")
    length_penalty: float = knob(
        0.0, "a correct answer's reward is 1 - length_penalty x (its tokens / rollout.max_tokens): RL learns to "
        "answer shorter (tasks/reward.length_penalized); held-out evaluation scores correctness alone",
        between(0, 1))


@dataclass
class TrainerConfig:
    """The run: how long, checkpoints, held-out evaluation, restarts, reproducibility."""

    steps: int = knob(20, "learner steps", at_least(1))
    checkpoint_every: int = knob(0, "also checkpoint every N steps (always at the end), under "
                                 "logging.dir/checkpoints/", at_least(0))
    eval_every: int = knob(0, "every N steps (0: never) the rollout actors answer the held-out set (data.eval_*) "
                           "greedily and at the rollout temperature under their current weights, beside training; "
                           "logged as eval/* at the step it started", at_least(0, "0: no held-out evaluation"))
    resume_from: Optional[str] = knob(None, "a checkpoint (checkpoints/step_N) or a run directory (its newest whole "
                                      "one, newer damaged ones passed over with a warning); it must be behind "
                                      "trainer.steps. A resume keeps model.path, seed, the data keys its order "
                                      "depends on, learner.num_ranks, zero_stage and dtype, the draft LM where it is "
                                      "distilled (another value is refused at load), and data.source's bytes (its "
                                      "run.json keeps their sha256); learner.lr and weight_decay follow this config. "
                                      "null: a fresh run",
                                      named("a checkpoint or a run directory"))
    max_learner_restarts: int = knob(
        2, "a learner rank whose process dies (killed, out of memory, its node lost) or hangs "
        "(trainer.step_timeout_s) restarts every process of the run from its newest checkpoint (its start, if none "
        "was written yet: trainer.checkpoint_every), this often per run; 0: the run stops and says where to resume "
        "from. An error raised in training code always stops the run", at_least(0))
    step_timeout_s: float = knob(
        1800.0, "learner ranks that have not finished a step's training, publishing or checkpoint this long (a "
        "stopped process, a stuck collective: alive to Ray, so nothing else notices), or their start within the "
        "longer of this and rollout.start_timeout_s, are taken for lost, as a dead rank is, and the run restarts from "
        "its newest checkpoint; a draft LM distiller's step that long is taken for a dead distiller "
        "(speculation.distill.max_restarts) (0: never)",
        zero_or_between(STALL_FLOOR_S, MAX_TIMEOUT_S, "never", "beyond the longest step a healthy learner takes"))
    deterministic: bool = knob(
        False, "true: bit-reproducible runs (needs algorithm.max_staleness 0): groups trained in data-cursor order, "
        "each step's groups generated together with nothing else in the engine (held-out evaluation waits for a "
        "gap), a lost or dead actor's step regenerated whole, and the learner's own logprobs as the behaviour "
        "logprobs (on-policy by construction), so the same config and seed give byte-identical final weights, an "
        "actor killed or not, stopped and resumed or not")


@dataclass
class TransportConfig:
    """The channels between learner rank 0 and the rollout actors."""

    host: str = knob("127.0.0.1", "the address receivers bind; 0.0.0.0 binds all and advertises the outward "
                     "address. A loopback address serves one machine: a cluster with nodes at other addresses "
                     "refuses it when the run starts")
    auth: TransportAuth = knob(TransportAuth.curve, "curve: ZeroMQ CURVE, every socket authenticated and encrypted "
                               "with keys made per run, so only the run's own processes can send, receive or read "
                               "messages. none: plain TCP, allowed only on loopback without cluster.address: for a "
                               "host whose every local user is trusted (any of them could speak for an actor)")
    trajectory_queue: int = knob(64, "ZeroMQ high-water mark, in messages: back-pressure on rollout actors; times "
                                 "the largest trajectory's bytes (from model.max_model_len) at most "
                                 f"{INBOX_MIB} MiB", at_least(1))
    weight_bucket_mib: int = knob(32, "the size of the buckets a weight version is sent in", between(1, 4096))
    weights: WeightTransport = knob(
        WeightTransport.zmq, "how policy versions reach the engines. zmq: their buckets over the ZeroMQ weight "
        "channel. nccl: over a process group of learner rank 0 and each engine's workers (NCCL on cuda, gloo on cpu; "
        "rendezvous on transport.host under a per-run secret), pulled by each engine straight into its parameters; "
        "names, shapes and dtypes still go over ZeroMQ, and the draft LM's versions stay there")


@dataclass
class ClusterConfig:
    """Where the processes run."""

    address: Optional[str] = knob(None, "null: start an embedded local Ray; else join this Ray cluster",
                                  named("a Ray address (host:port, or auto)"))
    device: Device = knob(Device.cpu, "cuda: each rollout engine and learner rank gets dedicated GPUs")
    num_cpus: Optional[int] = knob(None, "embedded Ray only (cluster.address null); null: all cores; raised to one "
                                   "per learner rank and actor", between(1, MAX_CPUS))
    learner_resource: Optional[str] = knob(
        None, "the Ray custom resource the nodes meant for the learner ranks advertise (`ray start "
        "--resources='{\"learner\": 8}'`, one unit per GPU, or per process on CPU); the role is reserved whole as a "
        "placement group. null: any node", CUSTOM_RESOURCE)
    rollout_resource: Optional[str] = knob(None, "the same for the rollout actors. null: any node",
                                           CUSTOM_RESOURCE)
    share_gpu: bool = knob(False, "cuda, one learner rank and one rollout actor: both on one GPU, half each in Ray's "
                           "accounting (the engine takes rollout.kv_cache_mib of its memory besides its weights, the "
                           "learner the rest): the one-GPU run of configs/grpo_gpu1.yaml")


@dataclass
class LoggingConfig:
    """What a run writes, and where."""

    dir: str = knob("runs/default", "TensorBoard event files, config.yaml (resolved), checkpoints, summary.json, "
                    "run.log", named("a directory"))
    engine_level: LogLevel = knob(LogLevel.warning, "what the engines (vLLM, DeepSpeed, Ray workers) may print on "
                                  "the console; everything from info up (debug too when asked) goes to "
                                  "logging.dir/run.log")
    overwrite: bool = knob(False, "a fresh run refuses a dir holding another run's checkpoints; true: deletes them "
                           "and its event files first")
    rollouts: bool = knob(False, "true: every step's trained trajectories go to logging.dir/rollouts.jsonl, a JSON "
                          "line each (learner/rollout_log.py)")


@dataclass
class Config:
    """A run's config: the keys at the top level, and a section per part of the run."""

    seed: int = knob(0, "seeds the data order, the sampling and the learner",
                     between(0, MAX_RUN_SEED, "[)"))  # every request seed derived from it fits an int64
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
