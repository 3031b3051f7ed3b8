"""Online distillation of the draft LM (`speculation.distill`): fed by learner rank 0, in a Ray actor beside it.

Where: the soft targets are the policy's distributions at the rollout temperature, which the GRPO step has just
computed for every trained token on rank 0; they go to the distiller as their top-k ([tokens, k] per step, about
1 MB for grpo_tiny's step) rather than being recomputed by a second policy forward. Rank 0 distils on its share of
the step's trajectories (all of them with one rank).

What: per trained token, the forward KL from the policy's top-k distribution (renormalised) to the draft's at the
rollout temperature, weighted `1 + wrong_weight` where the draft would have proposed another token than the one
the verifier committed. Which token it would have proposed is known exactly: drafts use the coupled sampler's
noise (the trajectory's seed, the output position), a draft is accepted iff it equals the committed token, and a
draft after accepted ones is conditioned on the committed prefix, so one teacher-forced forward replays what the
drafter proposes at every position. Walking a response in verify steps of `num_speculative_tokens` drafts
(accepted run + 1 token each) gives its *replayed acceptance length*, the number the actors would measure.

It runs in a Ray actor of its own on rank 0's node (`RemoteDistiller`), reserving no CPU and scheduled as idle
(Linux SCHED_IDLE: it runs on a CPU nothing else wants), beside the learner's next steps; a process of its own, so
it shares no GIL with the learner's loop. A step that begins or ends while it is still busy is skipped
(`draft/skipped_steps`; one that begins so gets no forward or top-k for it either: on the e2e benchmark's runs it
was busy at 44% of steps, whose teacher forwards took half of the learner's step): distillation never holds the
learner back, and on a host with no CPU to spare it learns from fewer steps. It learns from the policy's
distributions the GRPO pass computes anyway; the rows that pass skips (zero advantage) are forwarded for it only with
`speculation.distill.zero_advantage_rows`, after the step's weights went out (`defer`, then `start`, from `publish`),
with those weights, so the actors never wait for that forward (on a host whose learner shares the actors' cores, it
slows the actors all the same). Its scalars come a step or more late. One that dies is
replaced, from the newest draft version it handed out (its optimizer's moments start afresh), up to `max_restarts`
times; then the run goes on without it. With
`num_gpus` > 0 (GPU clusters) it takes that share of rank 0's GPU (rank 0 asks for the rest of it) and distils
there; the CPU then only launches its kernels.

When it publishes: at most every `every_versions` policy versions the trained candidate and the drafter the actors
run are both replayed on the step's trajectories; the candidate goes out as the next draft version (model `draft` on
the weight channel, `transport/`) only if it does at least as well. The candidate's replay costs no forward of its
own: it is the pass that trains it, each micro-batch replayed before the candidate learns from it (a prequential
judgment: no micro-batch judges a candidate that has learnt from it), so a gate every version costs nothing more
than one every four. A replayed acceptance near 1 (the drafter agrees with nothing: weights zeroed, a wrong
tokenizer) raises `draft/alarm`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from configs.load import draft_model
from learner.base import longer_deadline
from learner.grpo import Packed
from models.zoo import resolve
from sampling.coupled import GREEDY_BELOW, NOISE_ELEMENTS, group_seed, gumbel, processed_logits
from transport.messages import Trajectory

log = logging.getLogger(__name__)
ALARM_BELOW = 1.05  # replayed acceptance length under which the published drafter is reported as broken


def acceptance_walk(match: list[bool], k: int) -> int:
    """Verify steps that decoding `len(match)` tokens takes when each step drafts `k` tokens from the current
    position and `match[j]` says whether the draft for position j equals the committed token."""
    run, runs = 0, [0] * len(match)
    for j in range(len(match) - 1, -1, -1):  # run[j]: consecutive matches from j on
        run = run + 1 if match[j] else 0
        runs[j] = run
    steps, position = 0, 0
    while position < len(match):
        position += min(runs[position], k) + 1
        steps += 1
    return steps


class Batch:
    """Trajectories of the policy's step as `Packed` tensors, with their policy top-k targets `classes` and `probs`
    [B, T, k] (renormalised; 0 past a response's end) and their sampling seeds."""

    def __init__(self, trajectories: list[Trajectory], classes: torch.Tensor, probs: torch.Tensor, run_seed: int):
        self.trajectories, self.classes, self.probs = trajectories, classes, probs
        self.seeds = torch.tensor([group_seed(run_seed, t.group_id, t.group_size) + t.sample_index
                                   for t in trajectories])
        self.lengths = [len(t.response_ids) for t in trajectories]

    @functools.cached_property
    def packed(self) -> Packed:  # made where the batch is learnt (the distiller's actor), not where it is observed
        return Packed(self.trajectories)

    def to(self, device: torch.device) -> Batch:
        """This batch with its tensors (and its `packed` ones) on `device`."""
        packed = self.packed
        for name, value in vars(packed).items():
            setattr(packed, name, value.to(device))
        self.classes, self.probs, self.seeds = self.classes.to(device), self.probs.to(device), self.seeds.to(device)
        return self


def regrouped(batches: list[Batch], rows: int, run_seed: int, order: int) -> list[Batch]:
    """The trajectories of `batches` re-cut into batches of `rows` (one may have fewer) of similar lengths, which pad
    little, in an order drawn from `order` (a new one each step)."""
    items = [(t, b.classes[i, :n], b.probs[i, :n]) for b in batches
             for i, (t, n) in enumerate(zip(b.trajectories, b.lengths))]
    items.sort(key=lambda item: len(item[0].prompt_ids) + len(item[0].response_ids))
    pad = torch.nn.utils.rnn.pad_sequence
    chunks = [items[i : i + rows] for i in range(0, len(items), rows)]
    # learnt in a random order, not shortest first: steps walking up the lengths drag the draft LM towards the last
    chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=torch.Generator().manual_seed(order))]
    return [Batch([t for t, _, _ in chunk], pad([c for _, c, _ in chunk], batch_first=True),
                  pad([p for _, _, p in chunk], batch_first=True), run_seed) for chunk in chunks]


class DraftDistiller:
    def __init__(self, cfg: DictConfig):
        from transformers import AutoModelForCausalLM

        self.cfg, d = cfg, cfg.speculation.distill
        self.device = torch.device("cuda" if d.num_gpus > 0 else "cpu")  # Ray shows the actor the GPU it reserved
        self.model = AutoModelForCausalLM.from_pretrained(str(resolve(draft_model(cfg.speculation))),
                                                          dtype=torch.float32).to(self.device)
        self.running = copy.deepcopy(self.model).eval().requires_grad_(False)  # what the actors draft with
        self.initial = copy.deepcopy(self.running)  # the draft LM the run started with: what distillation gained
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=d.lr)
        self.version = 0  # of the running drafter (0: the one the actors started with)
        self.outgoing: list[tuple[str, torch.Tensor]] | None = None  # a draft version to publish
        self.rejected = 0
        self.nonfinite = 0  # batches skipped: their loss or gradient not finite
        self.gated_at = 0  # the policy version of the last gate
        self.learned = False  # the candidate has trained since it was made

    def _rows(self, model, batch: Batch) -> torch.Tensor:
        p = batch.packed
        logits = model(input_ids=p.ids, attention_mask=p.attention).logits
        return logits.gather(1, p.index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, T, vocab]

    def _drafts(self, batch: Batch, *rows: torch.Tensor) -> list[torch.Tensor]:
        """Per drafter's `rows` [B, T, vocab]: [B, T] the token it proposes at each response position (teacher-forced),
        by the coupled sampler's rule (`sampling/coupled.py`): the argmax of its processed logits plus the Gumbel
        noise of (seed, position). The noise depends on neither drafter, so it is made once for all of them, a
        chunk of positions at a time."""
        r, device = self.cfg.rollout, self.device
        b, t, v = rows[0].shape
        n = b * t
        flat = [processed_logits(x.detach().reshape(-1, v), torch.full((n,), float(r.temperature), device=device),
                                 torch.full((n,), r.top_k, device=device) if r.top_k > 0 else None,
                                 torch.full((n,), float(r.top_p), device=device) if r.top_p < 1 else None)
                for x in rows]
        tokens = [x.argmax(-1) for x in flat]  # greedy rollouts: no noise
        if r.temperature >= GREEDY_BELOW:
            seeds, positions = batch.seeds.repeat_interleave(t), torch.arange(t, device=device).repeat(b)
            chunk = max(1, NOISE_ELEMENTS // v)
            for start in range(0, n, chunk):
                noise = gumbel(seeds[start : start + chunk], positions[start : start + chunk], v)
                for x, out in zip(flat, tokens):
                    out[start : start + chunk] = (x[start : start + chunk].double() + noise).argmax(-1)
        return [x.view(b, t) for x in tokens]

    def step(self, policy_version: int, batches: list[Batch]) -> dict[str, float]:
        """One optimizer step per batch of the policy step's `batches` (re-cut), each batch replayed first by the
        running drafter, the run's starting one and the candidate (its training pass, before it learns the batch);
        then, when due, the gate. Metrics."""
        d, temperature = self.cfg.speculation.distill, max(float(self.cfg.rollout.temperature), 1e-3)
        k = self.cfg.speculation.num_speculative_tokens
        start = time.time()
        batches = regrouped(batches, d.micro_batch_size, self.cfg.seed, order=policy_version)
        batches = [batch.to(self.device) for batch in batches]
        judges = {"replayed": self.running, "initial_replayed": self.initial}
        gate = policy_version - self.gated_at >= d.every_versions and self.learned  # (untrained: the running one)
        walked = {name: [0, 0] for name in (*judges, "candidate")}  # tokens, verify steps
        self.model.train()
        losses = []
        for batch in batches:
            with torch.no_grad():
                judged = [self._rows(model, batch) for model in judges.values()]
            rows = self._rows(self.model, batch)
            *replayed, own = self._drafts(batch, *judged, rows)
            for name, drafts in zip(walked, (*replayed, own)):
                for row, length in zip((drafts == batch.packed.targets).tolist(), batch.lengths):
                    walked[name][0] += length
                    walked[name][1] += acceptance_walk(row[:length], k)
            wrong = (own != batch.packed.targets).float()
            logq = (rows / temperature).log_softmax(-1).gather(-1, batch.classes)
            kl = (batch.probs * (batch.probs.clamp(min=1e-12).log() - logq)).sum(-1)  # [B, T]
            weight = batch.packed.mask * (1 + d.wrong_weight * wrong)
            loss = (kl * weight).sum() / weight.sum().clamp(min=1)
            self.optimizer.zero_grad()
            loss.backward()
            # a batch whose loss or gradient is not finite (the policy's forward of a step it skipped, say) is
            # skipped: one such step scales every gradient by NaN, and the candidate would be NaN for good
            if not torch.isfinite(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)):
                self.nonfinite += 1
                continue
            self.optimizer.step()
            losses.append(loss.item())
        self.learned = self.learned or bool(losses)
        acceptance = {name: tokens / max(steps, 1) for name, (tokens, steps) in walked.items()}
        running = acceptance["replayed"]
        if not gate:
            del acceptance["candidate"]
        else:
            self.gated_at = policy_version
            if acceptance["candidate"] >= running:
                self.running.load_state_dict(self.model.state_dict())
                self.version += 1
                self.outgoing = [(n, t.detach().to("cpu", copy=True)) for n, t in self.running.state_dict().items()]
            else:
                self.rejected += 1
        if running < ALARM_BELOW:
            log.warning("the draft LM the actors run (draft version %d) replays at acceptance %.2f: it agrees with "
                        "almost none of the policy's tokens (broken weights?)", self.version, running)
        return {**{f"draft/{name}_acceptance": value for name, value in acceptance.items()},
                "draft/loss": sum(losses) / max(len(losses), 1), "draft/version": float(self.version),
                "draft/rejected_swaps": float(self.rejected), "draft/alarm": float(running < ALARM_BELOW),
                "draft/nonfinite_batches": float(self.nonfinite),
                "draft/train_seconds": time.time() - start}

    def load(self, directory: Path) -> None:
        """A resumed run continues from a checkpoint's draft LM, which the actors get with the first publish."""
        from safetensors.torch import load_file

        state = load_file(str(directory / "model.safetensors"))
        self.adopt(json.loads((directory / "version.json").read_text())["version"], list(state.items()))
        self.outgoing = list(state.items()) if self.version > 0 else None

    def adopt(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, float], None]:
        """Starts from draft version `version` (its weights, checkpoint names) as the drafter the actors run and as
        the candidate: a resumed run's, or a replacement distiller's (its AdamW moments start afresh). Returns what
        `run_step` returns when nothing was learnt, so `RemoteDistiller` waits on either call alike."""
        state = dict(weights)
        self.running.load_state_dict(state)
        self.model.load_state_dict(state)
        self.version = version
        return {}, None

    def take_outgoing(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The newest draft version and its weights (checkpoint names) when one is due to be published, once."""
        outgoing, self.outgoing = self.outgoing, None
        return None if outgoing is None else (self.version, outgoing)

    def run_step(self, policy_version: int, batches: list[Batch]) -> tuple[dict[str, float], tuple | None]:
        """`RemoteDistiller`'s call: `step` on one thread scheduled as idle, then `take_outgoing`."""
        torch.set_num_threads(1)
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread (the one Ray runs the calls in)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # runs only on a CPU nothing else wants
        return self.step(policy_version, batches), self.take_outgoing()

    def tensors(self) -> int:
        """How many tensors a published draft version has."""
        return len(self.running.state_dict())


class RemoteDistiller:
    """Rank 0's handle on a `DraftDistiller` in a Ray actor of its own on this node, reserving no CPU (one torch
    thread, scheduled as idle). `observe` and `start` as the learner calls them; `take_outgoing`, `save` and `load` for
    its publish and checkpoints."""

    def __init__(self, cfg: DictConfig, restarts: int = 0, off: bool = False):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()  # rank 0's bundle (0) holds its GPU share: placed, never pending
        here = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0) if group is not None else \
            NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.cfg = cfg
        self.spawn = lambda: ray.remote(num_cpus=0, num_gpus=cfg.speculation.distill.num_gpus,
                                        scheduling_strategy=here)(DraftDistiller).remote(cfg)
        self.worker = self.spawn()
        self.tensors = ray.get(self.worker.tensors.remote())
        self.batches: list[Batch] = []
        self.deferred: list[list[Trajectory]] = []  # rows for `start` to have forwarded (`defer`)
        self.running = None  # the ObjectRef of the distillation (or a replacement's `adopt`) under way
        self.running_since = 0.0  # when it was handed out (time.monotonic)
        self.outgoing: tuple | None = None
        self.newest: tuple | None = None  # the newest draft version handed out: where a replacement starts
        self.skipped = 0  # steps whose trajectories came while the actor was busy
        self.restarts = restarts  # the run's (with those before a learner restart): max_restarts counts per run
        self.failed = off  # died or raised more than max_restarts times: distillation is off for the rest of the run

    def ready(self) -> bool:
        """Whether a step starting now gets distilled: the actor is free (or done with the last step's); the learner
        forwards and observes a step's rows only then."""
        import ray

        return not self.failed and (self.running is None or bool(ray.wait([self.running], timeout=0)[0]))

    def observe(self, trajectories: list[Trajectory], teacher: torch.Tensor) -> None:
        self.batches.append(teacher_batch(self.cfg, trajectories, teacher))

    def defer(self, trajectories: list[Trajectory]) -> None:
        """Rows the step's GRPO pass did not forward (zero advantage): `start` has them forwarded first."""
        if trajectories:
            self.deferred.append(trajectories)

    def start(self, policy_version: int, teacher=None) -> dict[str, float]:
        """After the policy's step: hands its micro-batches to the actor, or skips them if it is still busy with an
        earlier step's; the deferred rows are forwarded by `teacher` (rows -> the policy's distributions [B, T,
        vocab]) just before. Returns the metrics of a distillation finished since the last call ({} if none)."""
        import ray

        metrics: dict[str, float] = {}
        deferred, self.deferred = self.deferred, []
        if self.failed:
            self.batches = []
            return {}
        if self.running is not None:
            if not ray.wait([self.running], timeout=0)[0]:
                limit, ran = longer_deadline(self.cfg), time.monotonic() - self.running_since
                if limit is not None and ran > limit:  # hung: alive to Ray, so only time tells
                    return self.replace(TimeoutError(f"its step has run {ran:.0f} s, past its deadline {limit:g} s"))
                self.batches, self.skipped = [], self.skipped + 1
                return {"draft/skipped_steps": float(self.skipped)}
            try:
                metrics, outgoing = ray.get(self.running)
            except ray.exceptions.RayError as e:
                return self.replace(e)
            self.running = None
            self.outgoing = outgoing or self.outgoing
            self.newest = outgoing or self.newest
        for rows in deferred:
            with torch.no_grad():
                self.observe(rows, teacher(rows))
        batches, self.batches = self.batches, []
        if batches:
            self.running, self.running_since = self.worker.run_step.remote(policy_version, batches), time.monotonic()
        else:  # it was busy when the step began (`ready`), so nothing was observed: skipped
            self.skipped += 1
        if batches and not metrics:
            return {}
        return {**metrics, "draft/skipped_steps": float(self.skipped), "draft/restarts": float(self.restarts)}

    def take_outgoing(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        outgoing, self.outgoing = self.outgoing, None
        return outgoing

    def replace(self, error: Exception) -> dict[str, float]:
        """The actor died, raised, or hung in a step (`learner.base.longer_deadline`): a new one starts from the newest
        draft version handed out (what the actors run), while `speculation.distill.max_restarts` allows; the step it
        was learning from is lost to it. After that the run goes on without distillation. Either way no trajectory
        depends on it (the coupled sampler): nothing is lost but the drafter's updates."""
        import ray

        self.running, self.batches = None, []
        reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"  # Ray's own text runs to a dozen lines
        with contextlib.suppress(Exception):  # it may be gone already
            ray.kill(self.worker)
        if self.restarts >= self.cfg.speculation.distill.max_restarts:
            log.error("draft LM distillation failed after %d restarts (speculation.distill.max_restarts) and is off "
                      "for the rest of this run; the actors keep the draft version they run: %s", self.restarts, reason)
            self.failed = True
            return {"draft/alarm": 1.0, "draft/off": 1.0, "draft/restarts": float(self.restarts)}
        self.restarts += 1
        self.worker = self.spawn()
        if self.newest is not None:  # its first call: the next `start` waits for it like for a distillation
            self.running, self.running_since = self.worker.adopt.remote(*self.newest), time.monotonic()
        log.warning("draft LM distiller failed (%s); replacement %d of %d starts from draft version %d", reason,
                    self.restarts, self.cfg.speculation.distill.max_restarts, self.newest[0] if self.newest else 0)
        return {"draft/restarts": float(self.restarts)}

    def summary(self) -> dict:
        """For the run's summary."""
        return {"distiller_restarts": self.restarts, "distillation_off": self.failed}

    def save(self, directory: Path) -> None:
        """The newest draft version handed out (what the actors run, or are about to) into a checkpoint, from rank
        0's own copy: a distiller busy in a step, or hung, never holds a checkpoint up; with distillation off, the
        version the actors keep. With none handed out yet the checkpoint has no draft LM, and a run resumed from it
        starts from the base one."""
        if self.newest is not None:
            save_draft(directory, *self.newest)

    def load(self, directory: Path) -> None:
        import ray

        ray.get(self.worker.load.remote(directory))
        self.outgoing = self.newest = ray.get(self.worker.take_outgoing.remote())


def save_draft(directory: Path, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
    """A draft LM version and its weights (checkpoint names), as `DraftDistiller.load` reads them."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().to("cpu", copy=True).contiguous() for n, t in weights},
              str(directory / "model.safetensors"))
    (directory / "version.json").write_text(json.dumps({"version": version}))


def teacher_batch(cfg: DictConfig, trajectories: list[Trajectory], teacher: torch.Tensor) -> Batch:
    """One micro-batch of the policy's step as a `Batch`: `teacher` [B, T, vocab] the policy's processed logprobs,
    kept as their top-k, renormalised (-inf outside the policy's top-k/p: 0)."""
    values, classes = teacher.detach().topk(min(cfg.speculation.distill.top_k, teacher.shape[-1]), dim=-1)
    return Batch(trajectories, classes.cpu(), values.float().softmax(-1).cpu(), cfg.seed)
