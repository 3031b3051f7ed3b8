"""When a rollout actor applies a new policy version (actor/rollout.py `poll_weights`): at once when no training group
is in flight; otherwise once the groups in flight have finished under the weights they started with, or after
`rollout.update_wait_s`, preempting them. vLLM and the weight channel are stand-ins here: what is tested is the
actor's choice of the moment, and that the newest version is the one applied."""

import time

from actor.rollout import INCARNATION_SHIFT, RolloutActor
from configs.load import load_config


class Channel:  # transport.zmq.WeightSubscriber's interface: `poll` hands each complete version over once
    def __init__(self):
        self.arrived, self.lead, self.histories, self.layouts = [], 0, [], {}

    def poll(self, timeout_ms):
        return self.arrived.pop(0) if self.arrived else None

    def take_draft(self):
        return None

    def take_history(self):
        histories, self.histories = self.histories, []
        return histories


class Engine:  # the vLLM calls `poll_weights` makes
    def __init__(self):
        self.applied, self.resets, self.drafter = [], 0, []
        self.pulls = []  # what each pull over the weight-sync group returns: a version, or None (headers missing)

    def collective_rpc(self, fn, args):
        to_drafter = fn.__name__ in ("remember_outputs", "new_policy_version", "swap_draft_weights")
        (self.drafter if to_drafter else self.applied).append((fn.__name__, args[0]))
        if fn.__name__ == "pull_weights":
            return [self.pulls.pop(0)]

    def reset_prefix_cache(self, reset_running_requests):
        self.resets += reset_running_requests
        return True


def actor(wait_s: float) -> RolloutActor:
    a = object.__new__(RolloutActor)
    a.cfg = load_config("grpo_tiny", [f"rollout.update_wait_s={wait_s}"])
    a.actor_id, a.incarnation, a.version, a.waiting, a.lead, a.speculating = 0, 0, 3, None, 0, False
    a.weights, a.llm, a.sent = Channel(), Engine(), []
    a.stats = {"weight_updates": 0, "preempting_updates": 0, "draft_version": 0, "remembered_outputs": 0}
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
    assert a.version == 5 and a.llm.applied == [("apply_weights", ["v5"])] and a.llm.resets == 1
    assert a.stats == {"weight_updates": 1, "preempting_updates": 0, "draft_version": 0, "remembered_outputs": 0}
    assert [m.version for m in a.sent] == [5]
    a.poll_weights(0, in_flight=False)  # applied once
    assert a.llm.applied == [("apply_weights", ["v5"])]


def test_past_the_wait_the_version_preempts_the_groups_in_flight():
    a = actor(wait_s=0.05)
    a.weights.arrived.append((4, ["v4"]))
    a.poll_weights(0, in_flight=True)
    assert a.version == 3
    time.sleep(0.06)
    a.weights.arrived.append((5, ["v5"]))  # the wait counts from the first version that waited
    a.poll_weights(0, in_flight=True)
    assert a.version == 5 and a.llm.applied == [("apply_weights", ["v5"])] and a.stats["preempting_updates"] == 1


def test_with_no_wait_a_version_is_applied_at_once_and_an_old_one_never():
    a = actor(wait_s=0)
    a.weights.arrived.append((4, ["v4"]))
    a.poll_weights(0, in_flight=True)
    assert a.version == 4 and a.stats["preempting_updates"] == 1
    a.weights.arrived.append((4, ["v4 again"]))  # a re-send for a replacement actor: already applied
    a.weights.arrived.append((2, ["v2"]))
    a.poll_weights(0, in_flight=False)
    a.poll_weights(0, in_flight=False)
    assert a.version == 4 and a.llm.applied == [("apply_weights", ["v4"])] and a.waiting is None


def test_other_actors_outputs_and_each_new_version_reach_a_speculating_actors_drafter():
    from transport.messages import SCHEMA_VERSION, History, Output

    a = actor(wait_s=0)
    a.speculating = True
    a.incarnation = 1  # a replacement: its dead predecessor's outputs are not in its drafter
    own, predecessor = 1 << INCARNATION_SHIFT, 7
    outputs = [Output(0, own, [1], [2, 3], 3), Output(1, 5, [5], [6], 3), Output(0, predecessor, [8], [9], 2)]
    a.weights.histories.append(History(SCHEMA_VERSION, 4, outputs))
    a.weights.arrived.append((4, ["v4"]))
    a.poll_weights(0)
    # its own outputs are in its drafter already: the others are handed over; then the new version
    assert a.llm.drafter == [("remember_outputs", [([5], [6], 3), ([8], [9], 2)]), ("new_policy_version", 4)]
    assert a.stats["remembered_outputs"] == 2
    plain = actor(wait_s=0)  # not speculating: no drafter to tell
    plain.weights.histories.append(History(SCHEMA_VERSION, 4, [Output(1, 5, [5], [6], 3)]))
    plain.weights.arrived.append((4, ["v4"]))
    plain.poll_weights(0)
    assert plain.llm.drafter == [] and plain.version == 4


def test_a_version_sent_as_headers_is_pulled_and_the_pulled_version_is_the_one_acknowledged():
    """`transport.weights: nccl`: the version's bytes come over the weight-sync group, and the learner sends its
    newest; when the engine lacks that one's headers nothing is applied and the version keeps waiting."""
    a = actor(wait_s=0)
    a.weights.arrived.append((4, None))
    a.llm.pulls = [None, 5]
    a.poll_weights(0)
    assert a.version == 3 and a.waiting is not None and a.sent == [] and a.llm.resets == 0
    a.poll_weights(0)  # the headers of v5 arrived meanwhile: the pull applies it
    assert a.version == 5 and a.waiting is None and [m.version for m in a.sent] == [5] and a.llm.resets == 1
    assert [name for name, _ in a.llm.applied] == ["pull_weights", "pull_weights"]
