"""The package contract files hold real rules; check them."""

import typing

import msgspec
import pytest

import factories
from learner.base import admissible, staleness
from transport.messages import (SCHEMA_VERSION, Heartbeat, History, Message, Output, SpecStats, TensorSpec,
                                WeightAck, WeightBucket)


def test_staleness_uses_the_oldest_token_version():
    assert staleness([3, 4, 5], learner_version=5) == 2
    assert admissible([4, 5], 5, max_staleness=1)
    assert not admissible([3, 5], 5, max_staleness=1)
    assert admissible([5], 5, max_staleness=0)


def test_every_message_type_round_trips_through_one_tagged_decoder():
    """Every member of `Message`, and `History` (the weight channel's), decoded back equal from its bytes, with its
    defaulted fields set; a message whose tag names no type is refused."""
    samples = [
        factories.trajectory(actor_id=1, seq=7, group_id=3, group_size=8, sample_index=2,
                             behaviour_logprobs=[-0.1, -0.2, -0.3], policy_versions=[0, 0, 1], generate_seconds=0.5,
                             spec=SpecStats(verify_steps=2, draft_tokens=6, accepted_tokens=4, cost_error=0.25,
                                            drafter_choices={"suffix": 2}, drafter_labels={"suffix": [4, 1]},
                                            drafter_failure="drafter X switched off")),
        WeightBucket(SCHEMA_VERSION, version=2, bucket=0, num_buckets=1, tensors=[TensorSpec("w", "float32", [2, 3])],
                     model="draft", lead=3),
        WeightAck(SCHEMA_VERSION, actor_id=1, version=2, apply_seconds=0.01, model="draft"),
        Heartbeat(SCHEMA_VERSION, actor_id=1, seq=9),
    ]
    assert {type(m) for m in samples} == set(typing.get_args(Message))  # a new message type needs a sample here
    decoder = msgspec.msgpack.Decoder(Message)
    for msg in samples:
        assert decoder.decode(msgspec.msgpack.encode(msg)) == msg
    history = History(SCHEMA_VERSION, version=4, outputs=[Output(actor_id=0, seq=1, prompt_ids=[1], response_ids=[2],
                                                                version=3)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(history), type=History) == history
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"type": "trajectory", "schema": 1}))
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"type": "no_such_message", "schema": 1}))
