"""Contract of `configs/`: the one structured schema every YAML in this folder is validated against.

Each YAML names only what differs from these defaults. `configs.load.load_config` merges file and
command-line overrides onto this schema, so an unknown key, a wrong type or an unset required value
(`???`) is an error naming the key and the file before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from tasks.arithmetic import ArithmeticTask


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
    curve = "curve"  # ZeroMQ CURVE: every socket authenticated and encrypted with keys made per run
    none = "none"  # plain TCP: allowed only when transport.host is a loopback address


class StepOrder(Enum):
    cursor = "cursor"  # a step trains its data cursors, waiting for their stragglers: no group dropped for being slow
    arrival = "arrival"  # a step trains the first whole groups to arrive: faster; slow (long) groups overtaken by
    # later ones can come too late for the staleness bound and are dropped, so training sees fewer long answers


class LossAggregation(Enum):
    token_mean = "token_mean"  # DAPO: mean over all tokens of the batch
    seq_mean_token_mean = "seq_mean_token_mean"  # GRPO: mean over tokens, then over sequences
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"  # Dr.GRPO: token sum / max_tokens, mean over sequences


@dataclass
class ModelConfig:
    path: str = MISSING  # a Hugging Face checkpoint directory, or builtin:dense / builtin:moe
    dtype: Dtype = Dtype.float32
    max_model_len: int = 1024


@dataclass
class DataConfig:
    source: str = "arithmetic"  # the built-in task, or the path of a GSM8K-style JSONL file
    max_ops: int = ArithmeticTask.max_ops  # arithmetic task: the longest problems have this many operations
    max_operand: int = ArithmeticTask.max_operand  # arithmetic task: operands are drawn from 1..max_operand
    tail_exponent: float = ArithmeticTask.tail_exponent  # arithmetic task: P(ops = k) ~ k^-tail_exponent (0: uniform)
    size: int = ArithmeticTask.size  # arithmetic task: > 0: that many problems, repeated in epochs; 0: endless
    # held-out problems for trainer.eval_every: "arithmetic" (the training mix under another seed, minus any training
    # problem) or a GSM8K-style JSONL file (its first eval_size records)
    eval_source: str = "arithmetic"
    eval_size: int = 256


@dataclass
class RolloutConfig:
    num_actors: int = 1
    tensor_parallel_size: int = 1  # devices per rollout engine (cuda only)
    prompts_per_step: int = 4  # GRPO groups consumed per learner step
    group_size: int = 8  # samples per prompt
    max_tokens: int = 400
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    kv_cache_mib: int = 256  # KV cache per device: the CPU engine's, or each GPU's of a tensor-parallel engine
    max_restarts: int = 3  # a rollout actor that dies is replaced (its unfinished groups re-issued) this often per run
    # an actor the learner has heard nothing from (no trajectory, no heartbeat) this long while it waits for groups is
    # taken for hung, stopped and replaced like a dead one (0: never; else at least configs/load.STALL_FLOOR_S, 10 s);
    # beyond the longest weight application
    stall_timeout_s: float = 300.0
    # how long a new weight version waits for the training groups in flight to finish under the weights they started
    # with before the actor applies it anyway, preempting them: their context is then recomputed under the new
    # weights, so every later token is a sample of exactly the new version (0: apply at once, always preempting)
    update_wait_s: float = 30.0


@dataclass
class DistillConfig:
    """Online distillation of the draft LM the actors run (learner/distill.py), on learner rank 0."""

    every_versions: int = 0  # publish a new draft version at most every N policy versions (0: the draft LM is frozen)
    lr: float = 1.0e-4  # AdamW, a step per micro_batch_size trajectories (1e-3 undoes the draft on grpo_tiny)
    top_k: int = 16  # the policy's top-k tokens per position are the soft targets
    micro_batch_size: int = 16  # trajectories per optimizer step (the policy's step re-cut by length)
    wrong_weight: float = 1.0  # extra loss weight where the draft would have proposed another token than committed
    num_gpus: float = 0.0  # share of rank 0's GPU the distiller runs on (rank 0 keeps the rest; 0: CPU; cuda only)
    max_restarts: int = 3  # a distiller that dies is replaced (from the newest draft version) this often per run


@dataclass
class SpeculationConfig:
    # "none", or the drafter that proposes tokens for coupled verification: a built-in (ngram, draft_lm), a
    # dotted path to a drafters.base.Drafter subclass, or the name of a `specactor.drafters` entry point
    method: str = "none"
    num_speculative_tokens: int = 4
    # the cost-model planner (actor/draft_planner.py) chooses 0..num_speculative_tokens drafts per request every
    # step from measured step and drafting costs and each request's acceptance; false: always the full k
    planner: bool = True
    max_batch: int = 0  # optional bound: never draft while more than this many requests run (0: no bound)
    options: Dict[str, Any] = field(default_factory=dict)  # keyword arguments of the drafter's constructor
    # method fastest_of_n only: its members (names as for `method`); `options` then maps a member to its arguments
    drafters: List[str] = field(default_factory=list)
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class LearnerConfig:
    num_ranks: int = 1
    zero_stage: int = 0
    dtype: Dtype = Dtype.float32
    lr: float = 1e-5
    warmup_steps: int = 0  # linear learning-rate warmup over this many learner steps (lets Adam's moments settle)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 8


@dataclass
class AlgorithmConfig:
    max_staleness: int = 1  # never train on a trajectory more than this many policy versions old
    step_order: StepOrder = StepOrder.cursor  # which whole groups a step takes (learner/intake.py)
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO's clip-higher
    kl_coef: float = 0.0  # > 0: k3 KL penalty to a frozen reference policy (the run's starting weights); rl/kl
    normalize_advantage_std: bool = True  # False: Dr.GRPO's unscaled group advantages
    loss_aggregation: LossAggregation = LossAggregation.seq_mean_token_mean
    # a correct answer's reward is 1 - length_penalty x (its tokens / rollout.max_tokens): RL learns to answer shorter
    # (tasks/reward.length_penalized); held-out evaluation scores correctness alone
    length_penalty: float = 0.0


@dataclass
class TrainerConfig:
    steps: int = 20  # learner steps
    checkpoint_every: int = 0  # also checkpoint every N steps (always at the end), under logging.dir/checkpoints/
    # every N steps (0: never) the rollout actors answer the held-out set (data.eval_*) greedily and at the rollout
    # temperature under their current weights, beside training; logged as eval/* at the step it started
    eval_every: int = 0
    resume_from: Optional[str] = None  # a checkpoint (checkpoints/step_N) or a run directory (its newest one)
    # a learner rank whose process dies (killed, out of memory, its node lost) restarts every process of the run from
    # its newest checkpoint (its start, if none was written yet: trainer.checkpoint_every), this often per run; 0:
    # the run stops and says where to resume from. An error raised in training code always stops the run
    max_learner_restarts: int = 2
    # true: bit-reproducible runs (needs algorithm.max_staleness 0): groups trained in data-cursor order, each step's
    # groups generated together with nothing else in the engine (held-out evaluation waits for a gap), a lost or dead
    # actor's step regenerated whole, and the learner's own logprobs as the behaviour logprobs (on-policy by
    # construction), so the same config and seed give byte-identical final weights, an actor killed or not, stopped
    # and resumed or not
    deterministic: bool = False


@dataclass
class TransportConfig:
    host: str = "127.0.0.1"  # the address receivers bind; 0.0.0.0 binds all and advertises the outward address
    auth: TransportAuth = TransportAuth.curve  # only the run's own processes can send, receive or read messages
    trajectory_queue: int = 64  # ZeroMQ high-water mark: back-pressure on rollout actors
    max_message_mib: int = 64
    weight_bucket_mib: int = 32


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # None: start an embedded local Ray; else join this Ray cluster
    device: Device = Device.cpu  # cuda: each rollout engine and learner rank gets dedicated GPUs
    num_cpus: Optional[int] = None  # embedded Ray only; None: all cores; at least one per learner rank and actor
    # the Ray custom resource the nodes meant for a role advertise (`ray start --resources='{"learner": 8}'`, one
    # unit per GPU, or per process on CPU); each role is reserved whole as a placement group. None: any node
    learner_resource: Optional[str] = None
    rollout_resource: Optional[str] = None


@dataclass
class LoggingConfig:
    dir: str = "runs/default"  # TensorBoard event files, config.yaml (resolved), checkpoints, summary.json, run.log
    # what the engines (vLLM, DeepSpeed, Ray workers) may print on the console; everything from info up (debug too
    # when asked) goes to logging.dir/run.log
    engine_level: LogLevel = LogLevel.warning
    # a fresh run refuses a dir holding another run's checkpoints; true: deletes them and its event files first
    overwrite: bool = False
    # true: every step's trained trajectories go to logging.dir/rollouts.jsonl, a JSON line each (learner/rollout_log.py)
    rollouts: bool = False


@dataclass
class Config:
    seed: int = 0
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
