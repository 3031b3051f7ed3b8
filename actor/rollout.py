"""The rollout actor: a vLLM engine stepped by hand so weights can change between steps.

It admits GRPO groups (one request per sample, seeds `group_seed + i`) while the group's learner step (shifted by
the learner's cursor lead, tasks/schedule.py) is at most `algorithm.max_staleness` versions ahead of the weights it
holds, and streams each trajectory as soon as its group completes. A new weight version is applied between two
engine steps (reload, re-pack the tied CPU lm_head, reset the prefix cache) once the training groups in flight have
finished under the weights they started with, or after `rollout.update_wait_s`, preempting them then so that their
context is recomputed under the new weights. Waiting admits nothing new (the staleness bound holds the next groups
back until the weights they need are applied), and it saves the recomputation of every preempted request's context
(bench/results/e2e_full_update_wait_cpu2.json against e2e_full_update_preempt_cpu2.json). A new draft LM version
(distilled by the learner) is swapped in between steps at once (no trajectory depends on it). Every token records
the version it was sampled under and comes from the coupled sampler (sampling/coupled.py), speculating with the
configured drafter or not; per-sequence draft/accept counts ride along in each trajectory. Which prompts it takes
is `tasks.schedule.CursorPlan`'s rule.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig

from actor.engine import completion_text, make_engine, sampling_params
from actor.evaluation import EVAL_SEED_BASE, Evaluation
from actor.vllm_hooks import (RequestRecord, apply_weights, join_weight_group, new_policy_version, profile,
                               pull_weights, remember_outputs, stuck_drafter, swap_draft_weights, take_records)
from sampling.coupled import group_seed
from tasks.dataset import eval_set, open_dataset
from tasks.reward import length_penalized, score
from tasks.schedule import CursorPlan
from transport.auth import ClientKeys
from transport.collective import GroupTicket
from transport.messages import SCHEMA_VERSION, Heartbeat, Trajectory, WeightAck
from transport.zmq import Outbox, WeightSubscriber


@dataclass
class Sample:
    cursor: int
    index: int
    prompt_ids: list[int]
    start: float
    versions: list[int] = field(default_factory=list)


def request_id(cursor: int, index: int) -> str:
    """The engine request of sample `index` of the group for data cursor `cursor` (vLLM appends its own suffix:
    `actor.vllm_hooks.caller_id` takes it off)."""
    return f"{cursor}-{index}"


INCARNATION_SHIFT = 32  # a replacement actor numbers its messages from incarnation << 32 (learner/intake.py)
HEARTBEAT_S = 2.0  # an actor says how far it got this often (rank 0 also learns it is alive)


class RolloutActor:
    def __init__(self, cfg: DictConfig, actor_id: int, model_dir: str, trajectory_endpoint: str,
                 weight_endpoint: str, version: int, plan: CursorPlan, first_ordinal: int = 0, incarnation: int = 0,
                 keys: ClientKeys | None = None, weight_group: GroupTicket | None = None, drafter_off: str = ""):
        """`weight_group`: with `transport.weights: nccl`, the learner's weight-sync group for this engine.
        `drafter_off`: why this actor's drafter may not run (it hung an earlier engine of this actor): the engine
        decodes plainly, and every trajectory says why."""
        self.cfg, self.actor_id, self.plan = cfg, actor_id, plan
        self.llm = make_engine(cfg, model_dir, drafter_off)  # coupled sampler; drafting if speculation.method is set
        self.engine = self.llm.llm_engine
        if weight_group is not None:
            self.llm.collective_rpc(join_weight_group, args=(weight_group,))
        self.tokenizer = self.llm.get_tokenizer()
        self.dataset = open_dataset(cfg.data, cfg.seed)
        self.outbox = Outbox(trajectory_endpoint, hwm=cfg.transport.trajectory_queue, keys=keys)
        self.weights = WeightSubscriber(weight_endpoint, keys=keys)  # keys: CURVE, as the driver admitted them
        self.version = version  # of the weights in model_dir
        self.speculating = cfg.speculation.method != "none"
        self.waiting: tuple[tuple[int, list], float] | None = None  # a newer version and when it arrived, unapplied
        # the learner's cursor lead (tasks/schedule.py), sent with every version; until then a resumed run's offset
        self.lead = plan.lead_at(version, delivered=0)
        self.first_ordinal = first_ordinal  # its first group (a replacement resumes where the dead actor stopped)
        self.seq, self.incarnation = incarnation << INCARNATION_SHIFT, incarnation
        self.turns_taken = 0  # of the run loop (`turns`)
        self.stopping = threading.Event()
        self.evaluations: queue.Queue[Evaluation] = queue.Queue()  # asked by evaluate(), run by run()
        self.rewinds: queue.Queue[int] = queue.Queue()  # asked by rewind(), done by run()
        self.eval_problems: dict | None = None  # the run's held-out set, built at the first evaluation
        self.stats = {"groups": 0, "trajectories": 0, "tokens": 0, "weight_updates": 0, "generate_seconds": 0.0,
                      "engine_steps": 0,  # and of generate_seconds, the engine's (vllm_hooks.profile, at stop):
                      "sampler_seconds": 0.0, "bridge_seconds": 0.0, "drafter_seconds": 0.0,
                      "idle_seconds": 0.0,  # nothing admissible to run: waiting for the learner's next weights
                      "preempting_updates": 0,  # weight versions applied with training groups still in flight
                      "sent_while_generating": 0,  # streamed while other requests were still in the engine
                      "draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0, "invalid_drafts": 0, "rewinds": 0,
                      "draft_version": 0, "draft_swaps": 0,  # of the draft LM (distilled online, if asked)
                      "remembered_outputs": 0,  # other actors' outputs handed to the drafter's history
                      "drafter_failure": ""}  # why the drafter was switched off (actor/draft_bridge.py), if it was

    def run(self) -> dict:
        """Generates until `stop()`; returns counters. Each turn: poll weights -> admit groups (and evaluations) ->
        step the engine -> route its outputs (finished groups streamed to the learner)."""
        from vllm.inputs.engine import tokens_input

        self.stats["start_version"] = self.version  # a replacement actor first catches up with the learner
        if self.speculating:  # (here, not in __init__: a drafter stuck in it can be asked about, see stuck_drafter)
            self.llm.collective_rpc(new_policy_version, args=(self.version,))
        samples: dict[str, Sample] = {}  # training request id -> its sample, while in the engine
        finished: dict[int, list] = {}  # cursor -> its group's finished samples, until the group is whole
        evaluating: dict[str, Evaluation] = {}  # request id -> its evaluation
        ordinal, beat = self.first_ordinal, time.time()
        while not self.stopping.is_set():
            self.turns_taken += 1
            self.poll_weights(0, in_flight=bool(samples))
            ordinal = self._admit(ordinal, samples, finished, evaluating, tokens_input)
            if time.time() - beat > HEARTBEAT_S:  # how far it got (a lost last trajectory shows), and that it lives
                beat = time.time()
                self._send(Heartbeat(SCHEMA_VERSION, self.actor_id, self.seq))
            if not self.engine.has_unfinished_requests():
                idle = time.time()
                self.poll_weights(100)  # ahead of the learner (max_staleness): nothing to run until new weights
                self.stats["idle_seconds"] += time.time() - idle
                continue
            start = time.time()
            outputs = self.engine.step()
            self.stats["generate_seconds"] += time.time() - start
            self.stats["engine_steps"] += 1
            self._route(outputs, samples, finished, evaluating)
        self.engine.abort_request(list(samples) + list(evaluating))  # unfinished groups are abandoned, never half-sent
        spent = self.llm.collective_rpc(profile)[0]  # the coupled sampler's, the drafter bridge's, the drafter's
        self.stats.update({f"{part}_seconds": spent[f"{part}_s"] for part in ("sampler", "bridge", "drafter")})
        for evaluation in set(evaluating.values()) | set(self.evaluations.queue):
            evaluation.done.set()  # an evaluation cut short by stop() reports what it has
        return {**self.stats, "abandoned_requests": len(samples), "version": self.version,
                "dropped_weight_buckets": self.weights.dropped}

    def _admit(self, ordinal: int, samples: dict, finished: dict, evaluating: dict, tokens_input) -> int:
        """Rewinds asked for, evaluations asked for, then every group the staleness bound admits, as requests;
        returns the ordinal of this actor's next group."""
        while not self.rewinds.empty():  # trajectories of this actor were lost: again from the group the learner lacks
            ordinal = self.rewinds.get()
            self.abandon(samples, finished)
        # deterministic runs: a step's groups have the engine (and an empty prefix cache) to themselves, so a
        # regenerated step (a dead or rewound actor, a resumed run) runs exactly the batches it ran the first time
        deterministic = self.cfg.trainer.deterministic
        while not self.evaluations.empty() and not (deterministic and samples):
            evaluating.update(self.start_evaluation(self.evaluations.get(), tokens_input))
        n = self.cfg.rollout.group_size
        cursor = self.plan.cursor(self.actor_id, ordinal)
        admitted = self.plan.admits(cursor, self.version, self.cfg.algorithm.max_staleness, self.lead)  # bounded
        if deterministic and admitted and (samples or evaluating):
            admitted = False  # the engine is not empty yet
        elif deterministic and admitted and not self.llm.reset_prefix_cache():
            raise RuntimeError(f"actor {self.actor_id}: vLLM could not reset its prefix cache with nothing running")
        while admitted:
            prompt_ids = self.tokenizer(self.dataset[cursor].prompt, add_special_tokens=False).input_ids
            for i in range(n):
                params = sampling_params(self.cfg, seed=group_seed(self.cfg.seed, cursor, n) + i)
                self.engine.add_request(request_id(cursor, i), tokens_input(prompt_ids), params)
                samples[request_id(cursor, i)] = Sample(cursor, i, prompt_ids, time.time())
            finished[cursor] = []
            ordinal += 1
            cursor = self.plan.cursor(self.actor_id, ordinal)
            admitted = self.plan.admits(cursor, self.version, self.cfg.algorithm.max_staleness, self.lead)
        return ordinal

    def _route(self, outputs: list, samples: dict, finished: dict, evaluating: dict) -> None:
        """An engine step's outputs: evaluations recorded, each token's policy version noted, and a group sent to
        the learner once its last sample finishes."""
        for out in outputs:
            if out.request_id in evaluating:
                if out.finished:
                    completion, evaluation = out.outputs[0], evaluating.pop(out.request_id)
                    evaluation.record(out.request_id, completion_text(self.tokenizer, completion.token_ids),
                                      len(completion.token_ids), self.version)
                    if evaluation.done.is_set():  # its records are not a trajectory's: drop them
                        ids = [rid for rid, _, _ in evaluation.request_ids()]
                        self.llm.collective_rpc(take_records, args=(ids,))
                continue
            sample, completion = samples[out.request_id], out.outputs[0]
            sample.versions += [self.version] * (len(completion.token_ids) - len(sample.versions))
            if out.finished:
                del samples[out.request_id]
                finished[sample.cursor].append((sample, completion))
                if len(finished[sample.cursor]) == self.cfg.rollout.group_size:
                    self.send_group(finished.pop(sample.cursor))

    def turns(self) -> int:
        """How many turns its run loop (or its wait on a full outbox) has taken, and weight messages it has received
        (a large version streams in for a while): asked by the driver, from a thread of its own, to tell a hung
        engine from one that a peer holding this actor's key speaks for (driver/rollouts.py)."""
        return self.turns_taken + self.weights.received

    def sent(self) -> int:
        """The sequence number of its next message: every one below it was handed to its outbox (asked by the
        driver, on a thread of its questions, to check a heartbeat's claim of lost trajectories: learner/intake.py)."""
        return self.seq

    def rewind(self, first_ordinal: int) -> None:
        """Trajectories of this actor were lost (the learner saw a gap in its sequence numbers): it abandons the
        groups in flight and generates again from its group `first_ordinal`, the first the learner lacks."""
        self.rewinds.put(first_ordinal)

    def abandon(self, samples: dict[str, Sample], finished: dict[int, list]) -> None:
        """Drops every training request in flight and every unsent finished sample, with their sampler records
        (their request ids come back when the groups are generated again)."""
        ids = list(samples) + [request_id(s.cursor, s.index) for group in finished.values() for s, _ in group]
        self.engine.abort_request(list(samples))
        self.llm.collective_rpc(take_records, args=(ids,))
        self.stats["rewinds"] += 1
        samples.clear()
        finished.clear()

    def evaluate(self, tag: int) -> dict:
        """Answers this actor's share of the held-out set (its every R-th problem) while `run` goes on training;
        returns when done. Called from Ray's second thread: the engine itself is only touched by `run`."""
        if self.eval_problems is None:
            self.eval_problems = dict(enumerate(eval_set(self.cfg.data, self.cfg.seed)))
        share = {j: p for j, p in self.eval_problems.items() if j % self.cfg.rollout.num_actors == self.actor_id}
        evaluation = Evaluation(tag, share)
        self.evaluations.put(evaluation)
        evaluation.done.wait()
        return evaluation.result()

    def start_evaluation(self, evaluation: Evaluation, tokens_input) -> dict[str, Evaluation]:
        from vllm import SamplingParams

        started = {}
        for rid, j, greedy in evaluation.request_ids():
            prompt_ids = self.tokenizer(evaluation.problems[j].prompt, add_special_tokens=False).input_ids
            params = (SamplingParams(temperature=0.0, max_tokens=self.cfg.rollout.max_tokens, detokenize=False)
                      if greedy else sampling_params(self.cfg, seed=EVAL_SEED_BASE + j))
            self.engine.add_request(rid, tokens_input(prompt_ids), params)
            evaluation.pending.add(rid)
            started[rid] = evaluation
        if not started:
            evaluation.done.set()
        return started

    def send_group(self, group: list) -> None:
        problem = self.dataset[group[0][0].cursor]
        group = sorted(group, key=lambda sc: sc[0].index)
        ids = [request_id(s.cursor, s.index) for s, _ in group]
        records: dict[str, RequestRecord] = self.llm.collective_rpc(take_records, args=(ids,))[0]
        for sample, completion in group:
            rid = request_id(sample.cursor, sample.index)
            record, ids = records[rid], list(completion.token_ids)
            if len(record.logprobs) < len(ids):
                raise RuntimeError(f"actor {self.actor_id}: request {rid} has {len(ids)} tokens but the coupled "
                                   f"sampler recorded {len(record.logprobs)} logprobs")
            reward = length_penalized(score(completion_text(self.tokenizer, ids), problem.answer).reward, len(ids),
                                      self.cfg.rollout.max_tokens, self.cfg.algorithm.length_penalty)
            sent = self._send(Trajectory(
                schema=SCHEMA_VERSION, actor_id=self.actor_id, seq=self.seq, group_id=sample.cursor,
                group_size=len(group), sample_index=sample.index, prompt_ids=sample.prompt_ids, response_ids=ids,
                behaviour_logprobs=record.logprobs[: len(ids)], policy_versions=sample.versions, reward=reward,
                finish_reason=completion.finish_reason or "length", generate_seconds=time.time() - sample.start,
                spec=record.stats))
            if not sent:
                return
            for key in ("verify_steps", "draft_tokens", "accepted_tokens", "invalid_drafts"):
                self.stats[key] += getattr(record.stats, key)
            self.stats["drafter_failure"] = record.stats.drafter_failure or self.stats["drafter_failure"]
            self.seq += 1
            self.stats["trajectories"] += 1
            self.stats["tokens"] += len(ids)
        self.stats["groups"] += 1
        if self.engine.has_unfinished_requests():
            self.stats["sent_while_generating"] += len(group)

    def poll_weights(self, timeout_ms: int, in_flight: bool = False) -> None:
        """Takes what the learner published: a draft LM version is swapped in at once; a policy version is applied
        now if no training group is `in_flight`, else once they finish or `rollout.update_wait_s` has passed."""
        update = self.weights.poll(timeout_ms)
        draft = self.weights.take_draft()  # a distilled draft LM (learner/distill.py): no trajectory changes
        if draft is not None and draft[0] > self.stats["draft_version"]:
            start = time.time()
            if not any(self.llm.collective_rpc(swap_draft_weights, args=(draft[1],))):
                raise RuntimeError(f"actor {self.actor_id}: draft LM weights v{draft[0]} arrived, but the drafter "
                                   f"{self.cfg.speculation.method!r} has no draft LM to take them")
            self.stats["draft_version"], self.stats["draft_swaps"] = draft[0], self.stats["draft_swaps"] + 1
            self._send(WeightAck(SCHEMA_VERSION, self.actor_id, draft[0], time.time() - start, "draft"))
        for history in self.weights.take_history():  # what the others sampled (a dead predecessor too), for drafting
            mine = (self.actor_id, self.incarnation)
            outputs = [(o.prompt_ids, o.response_ids, o.version) for o in history.outputs
                       if (o.actor_id, o.seq >> INCARNATION_SHIFT) != mine]
            if outputs and self.speculating:
                self.llm.collective_rpc(remember_outputs, args=(outputs,))
                self.stats["remembered_outputs"] += len(outputs)
        if update is not None and update[0] > self.version:  # (older: a re-send for a replacement actor)
            self.waiting = (update, time.time() if self.waiting is None else self.waiting[1])
        if self.waiting is None or (in_flight and time.time() - self.waiting[1] < self.cfg.rollout.update_wait_s):
            return
        (version, tensors), _ = self.waiting
        start = time.time()
        if tensors is not None:
            self.llm.collective_rpc(apply_weights, args=(tensors,))
        else:  # over the weight-sync group: the learner's newest, whose headers this engine may not hold yet
            pulled = self.llm.collective_rpc(pull_weights, args=(self.weights.layouts,))[0]
            if pulled is None:
                return
            if pulled < version:
                raise RuntimeError(f"actor {self.actor_id}: pulled weights v{pulled}, older than v{version}")
            version = pulled
        self.waiting = None
        self.stats["preempting_updates"] += in_flight
        # Cached KV was computed by the old weights: drop it, and preempt running requests so their context is
        # recomputed, making every later token a sample of exactly the new policy (what the learner's ratio assumes).
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(f"actor {self.actor_id}: vLLM could not reset its prefix cache after weights v{version}")
        self.version, self.lead = version, self.weights.lead
        if self.speculating:
            self.llm.collective_rpc(new_policy_version, args=(version,))
        self.stats["weight_updates"] += 1
        self._send(WeightAck(SCHEMA_VERSION, self.actor_id, version, time.time() - start))

    def _send(self, message) -> bool:
        """Sends to the learner, waiting while its queue is full (back-pressure) but never past `stop()`: False
        when the actor was stopped first (the run is ending; a learner that stopped reading must not hang it)."""
        while not self.outbox.send(message, timeout_ms=500):
            self.turns_taken += 1  # waiting on the learner is no hang
            if self.stopping.is_set():
                return False
        return True

    def stop(self) -> None:
        self.stopping.set()

    def stuck_drafter(self, after_s: float) -> str:
        """Asked by the driver, on a thread of its questions, of an actor gone silent: the drafter call its engine
        has been in for more than `after_s` seconds, as a reason (\"\": none)."""
        return self.llm.collective_rpc(stuck_drafter, args=(after_s,))[0] if self.speculating else ""

    def wait_for_version(self, version: int, timeout_s: float) -> int:
        """Applies weight updates until `version` is reached or `timeout_s` passes; call only while `run` is not
        running."""
        deadline = time.time() + timeout_s
        while self.version < version and time.time() < deadline:
            self.poll_weights(100)
        return self.version
