"""Contract of `transport/`: the versioned msgspec messages that cross process boundaries.

Every message carries `schema`; a receiver decodes with a typed decoder and drops (and counts) anything
malformed, truncated, oversized or of another schema version. Tensor bytes never travel inside a Struct:
a `WeightBucket` header is followed by one zero-copy frame per tensor, in `tensors` order.

`schema` changes when a field changes meaning or a required field is added; a new field with a default (a counter
of `SpecStats`) keeps it, since msgspec decoders skip unknown fields and fill defaults.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated

import msgspec

SCHEMA_VERSION = 2

# Length limits a decoder checks before it builds anything (a longer list is refused as it starts): what one message
# can make its receiver allocate beyond its own bytes (`trajectory_bytes`) stays bounded
MAX_TOKENS = 1 << 20  # the most tokens a trajectory carries: model.max_model_len's ceiling
MAX_DRAFTERS = 64  # the most drafters a composite drafter combines
MAX_NAME = 256  # the longest drafter name (a dotted class path) and finish reason
MAX_FAILURE = 4096  # the longest reason a drafter was switched off (the bridge cuts longer ones)
Tokens = Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS)]
Floats = Annotated[list[float], msgspec.Meta(max_length=MAX_TOKENS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]


def trajectory_bytes(max_model_len: int) -> int:
    """The most bytes an honest `Trajectory` of a run with `max_model_len` takes as msgpack, what the learner's inbox
    accepts: at most 9 bytes (msgpack's widest int or float) for each token's id, and each answer token's logprob and
    version, plus 64 KiB for the other fields. (Decoded, a message takes about 8 to 12 times its bytes.)"""
    return (64 << 10) + 32 * max_model_len


class SpecStats(msgspec.Struct, omit_defaults=True):
    """What speculative decoding did for one sequence: counted by the actor's coupled sampler and drafter bridge,
    carried in its `Trajectory`, and summed (`+`, `total`) into a step's metrics and the benchmarks' figures."""

    verify_steps: int = 0  # verify steps that carried drafts for it
    draft_tokens: int = 0  # draft tokens proposed for it
    accepted_tokens: int = 0  # of which the verifier accepted
    invalid_drafts: int = 0  # proposals dropped as invalid (token ids outside the vocabulary)
    draft_seconds: float = 0.0  # its share of the time the drafter spent proposing (the engine waited for)
    planned_steps: int = 0  # decode steps under the draft planner (a plan or its rest; drafting or not)
    planned_tokens: int = 0  # draft tokens the planner allowed it over those steps
    prepared_steps: int = 0  # of its drafting steps, those whose drafts were prepared a step ahead (decoupled)
    cost_error: float = 0.0  # sum over those steps of the planner's relative error on the step before's seconds
    # draft steps per member of a composite drafter (fastest_of_n)
    drafter_choices: Annotated[dict[Name, int], msgspec.Meta(max_length=MAX_DRAFTERS)] = {}
    # per member of a composite drafter: [tokens of its proposals the verifier would have accepted, rejected]
    # (every proposal it made, chosen or not, labelled on the committed tokens: Drafter.member_labels)
    drafter_labels: Annotated[dict[Name, Annotated[list[int], msgspec.Meta(max_length=2)]],
                              msgspec.Meta(max_length=MAX_DRAFTERS)] = {}
    # why the drafter was switched off ("": it was not)
    drafter_failure: Annotated[str, msgspec.Meta(max_length=MAX_FAILURE)] = ""

    def __add__(self, other: SpecStats) -> SpecStats:
        labels: dict[str, list[int]] = {}
        for each in (self, other):
            add_labels(labels, each.drafter_labels)
        return SpecStats(**{name: getattr(self, name) + getattr(other, name) for name in SPEC_NUMBERS},
                         drafter_choices=dict(Counter(self.drafter_choices) + Counter(other.drafter_choices)),
                         drafter_labels=labels, drafter_failure=self.drafter_failure or other.drafter_failure)

    def acceptance_length(self) -> float:
        """Tokens emitted per verify step that carried drafts (1: nothing accepted, or no drafts at all)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 1.0


# its counters, seconds and errors: the fields whose default is a number (the rest are per-drafter maps and text)
SPEC_NUMBERS = tuple(name for name, default in zip(SpecStats.__struct_fields__, SpecStats.__struct_defaults__)
                     if type(default) in (int, float))


def total(stats: Iterable[SpecStats]) -> SpecStats:
    return sum(stats, SpecStats())


def add_labels(into: dict[str, list[int]], labels: Mapping[str, Sequence[int]]) -> None:
    """Adds per-member [accepted, rejected] draft-token labels (as `SpecStats.drafter_labels` holds) into `into`."""
    for name, (accepted, rejected) in labels.items():
        pair = into.setdefault(name, [0, 0])
        pair[0] += accepted
        pair[1] += rejected


class Trajectory(msgspec.Struct, tag="trajectory", frozen=True, kw_only=True):
    """One sampled response of a GRPO group, streamed by a rollout actor as soon as its group completes."""

    schema: int
    actor_id: int
    seq: int  # per-actor sequence number: gaps show loss, repeats show duplicates
    group_id: int  # the data cursor of the prompt: a group is every trajectory with this id
    group_size: int
    sample_index: int
    prompt_ids: Tokens
    response_ids: Tokens
    behaviour_logprobs: Floats  # per response token, under the distribution actually sampled
    policy_versions: Tokens  # per response token: weights version it was sampled under
    reward: float
    finish_reason: Name  # "stop" or "length"
    generate_seconds: float
    spec: SpecStats = msgspec.field(default_factory=SpecStats)


class TensorSpec(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: list[int]


class WeightBucket(msgspec.Struct, tag="weights", frozen=True):
    """Header of one size-bounded bucket of a weight update; its tensors follow as separate frames, or travel over
    the weight-sync process group (`inline` false: transport/collective.py)."""

    schema: int
    version: int  # the version of `model` these weights are
    bucket: int
    num_buckets: int
    tensors: list[TensorSpec]
    model: str = "policy"  # or "draft": a version of the draft LM (learner/distill.py), numbered on its own
    lead: int = 0  # policy versions: the learner's cursor lead, by which actors admit groups (tasks/schedule.py)
    inline: bool = True  # false: no tensor frames; the engine pulls the bytes over the collective


class WeightAck(msgspec.Struct, tag="weight_ack", frozen=True):
    schema: int
    actor_id: int
    version: int
    apply_seconds: float
    model: str = "policy"  # which weights were applied ("policy" or "draft")


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """A rollout actor says how far it got, every 2 s: `seq` is the sequence number its next trajectory will carry,
    so the learner learns of a lost last trajectory, which no later one would reveal; and that it is alive (an actor
    silent past `rollout.stall_timeout_s` is taken for hung: driver/rollouts.py)."""

    schema: int
    actor_id: int
    seq: int


class Output(msgspec.Struct, frozen=True):
    actor_id: int  # the actor that sampled it
    seq: int  # its trajectory's sequence number (the high bits: the actor's incarnation, a replacement's own)
    prompt_ids: list[int]
    response_ids: list[int]
    version: int  # the policy version its first token was sampled under


class History(msgspec.Struct, tag="history", frozen=True):
    """What the learner trained at a step, sent on the weight channel to every actor after the step's weights: each
    actor's history drafter learns the outputs other actors sampled (drafters/suffix.py: a prompt's next epoch may
    land on any actor). Drafting only: no trajectory depends on it."""

    schema: int
    version: int  # the policy version the learner published with it
    outputs: list[Output]


Message = Trajectory | WeightBucket | WeightAck | Heartbeat
