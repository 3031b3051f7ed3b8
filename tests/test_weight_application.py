"""When a rollout actor applies a new policy version (actor/rollout.py `poll_weights`): at once when no training group
is in flight; otherwise once the groups in flight have finished under the weights they started with, or after
`rollout.update_wait_s`, preempting them. vLLM and the weight channel are stand-ins here: what is tested is the
actor's choice of the moment, and that the newest version is the one applied."""

import time

from actor.rollout import RolloutActor
from configs.load import load_config


class Channel:  # transport.zmq.WeightSubscriber's interface: `poll` hands each complete version over once
    def __init__(self):
        self.arrived, self.lead = [], 0

    def poll(self, timeout_ms):
        return self.arrived.pop(0) if self.arrived else None

    def take_draft(self):
        return None


class Engine:  # the vLLM calls `poll_weights` makes
    def __init__(self):
        self.applied, self.resets = [], 0

    def collective_rpc(self, fn, args):
        self.applied.append(args[0])

    def reset_prefix_cache(self, reset_running_requests):
        self.resets += reset_running_requests
        return True


def actor(wait_s: float) -> RolloutActor:
    a = object.__new__(RolloutActor)
    a.cfg = load_config("grpo_tiny", [f"rollout.update_wait_s={wait_s}"])
    a.actor_id, a.version, a.waiting, a.lead = 0, 3, None, 0
    a.weights, a.llm, a.sent = Channel(), Engine(), []
    a.stats = {"weight_updates": 0, "preempting_updates": 0, "draft_version": 0}
    a._send = a.sent.append
    return a


def test_a_version_waits_for_the_groups_in_flight_then_the_newest_is_applied():
    a = actor(wait_s=30)
    a.weights.arrived.append((4, ["v4"]))
    a.poll_weights(0, in_flight=True)
    assert a.version == 3 and a.llm.applied == [] and a.sent == []  # the groups in flight keep their weights
    a.weights.arrived.append((5, ["v5"]))  # a newer one arrives meanwhile: it replaces the waiting one
    a.poll_weights(0, in_flight=True)
    assert a.version == 3 and a.llm.applied == []
    a.poll_weights(0, in_flight=False)  # the last group in flight finished
    assert a.version == 5 and a.llm.applied == [["v5"]] and a.llm.resets == 1
    assert a.stats == {"weight_updates": 1, "preempting_updates": 0, "draft_version": 0}
    assert [m.version for m in a.sent] == [5]
    a.poll_weights(0, in_flight=False)  # applied once
    assert a.llm.applied == [["v5"]]


def test_past_the_wait_the_version_preempts_the_groups_in_flight():
    a = actor(wait_s=0.05)
    a.weights.arrived.append((4, ["v4"]))
    a.poll_weights(0, in_flight=True)
    assert a.version == 3
    time.sleep(0.06)
    a.weights.arrived.append((5, ["v5"]))  # the wait counts from the first version that waited
    a.poll_weights(0, in_flight=True)
    assert a.version == 5 and a.llm.applied == [["v5"]] and a.stats["preempting_updates"] == 1


def test_with_no_wait_a_version_is_applied_at_once_and_an_old_one_never():
    a = actor(wait_s=0)
    a.weights.arrived.append((4, ["v4"]))
    a.poll_weights(0, in_flight=True)
    assert a.version == 4 and a.stats["preempting_updates"] == 1
    a.weights.arrived.append((4, ["v4 again"]))  # a re-send for a replacement actor: already applied
    a.weights.arrived.append((2, ["v2"]))
    a.poll_weights(0, in_flight=False)
    a.poll_weights(0, in_flight=False)
    assert a.version == 4 and a.llm.applied == [["v4"]] and a.waiting is None
