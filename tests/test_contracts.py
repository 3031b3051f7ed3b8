"""The package contract files hold real rules; check them."""

import msgspec
import pytest

from learner.base import admissible, staleness
from transport.messages import SCHEMA_VERSION, Message, TensorSpec, Trajectory, WeightBucket


def test_staleness_uses_the_oldest_token_version():
    assert staleness([3, 4, 5], learner_version=5) == 2
    assert admissible([4, 5], 5, max_staleness=1)
    assert not admissible([3, 5], 5, max_staleness=1)
    assert admissible([5], 5, max_staleness=0)


def test_messages_round_trip_through_one_tagged_decoder():
    traj = Trajectory(SCHEMA_VERSION, actor_id=1, seq=7, group_id=3, group_size=8, sample_index=2,
                      prompt_ids=[1, 2], response_ids=[3, 4, 5], behaviour_logprobs=[-0.1, -0.2, -0.3],
                      policy_versions=[0, 0, 1], reward=1.0, finish_reason="stop", generate_seconds=0.5)
    bucket = WeightBucket(SCHEMA_VERSION, version=2, bucket=0, num_buckets=1,
                          tensors=[TensorSpec("w", "float32", [2, 3])])
    decoder = msgspec.msgpack.Decoder(Message)
    for msg in (traj, bucket):
        assert decoder.decode(msgspec.msgpack.encode(msg)) == msg
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"type": "trajectory", "schema": 1}))
