"""History drafting (after SuffixDecoding and DAS): GRPO samples every prompt G times per step and again every
epoch, so what the policy wrote for the same prompt (the group's live siblings, and the prompt's earlier outputs)
is the best draft source there is.

Per prompt, a table from every context (the last 1..max_n tokens of one sequence) to the counts of the token that
followed it, over the prompt, each live sibling's output and the last `max_sequences` finished outputs (this
engine's, and those other actors sampled, which the learner sends every step: `remember`); every sequence is counted
on its own, so two siblings never interleave into one. A proposal walks the table: at each step the longest known
context of the request's own tail and, of the tokens that followed it, the one the target is likeliest to sample,
while that likelihood is at least `min_share` (so drafts are as long as the history is sure). For a greedy request
that is the most frequent token (likelihood: its share of the counts). A sampling request draws with the coupled
sampler's own noise (sampling/coupled.py): the counts are samples of the policy's distribution, so the token with the
largest `log(count) + G(seed, position, token)` is the one the target draws wherever that distribution resembles the
history's, the likely token where the policy is sure and the right one of several where it is not (the most frequent
token is right only as often as it is drawn). Its likelihood is the chance that the lead over the runner-up outlasts
the counts' sampling error, times the chance that the target draws a token the history knows (`n / (n + 1)` of `n`
counts). Work per proposal is O(k * max_n) (sampling: and the noise of each matched context's candidates). Counting
waits for the next proposal from the prompt (a commit, a finished or a remembered output only stores its tokens):
each token costs O(max_n) once, and nothing while the planner drafts nothing from its prompt. Memory is bounded:
`max_sequences` finished outputs per prompt (with `max_versions` W, only those started within the last W policy
versions: the policy drifts, and so does what its old outputs say of it), and the least recently used prompts beyond
`max_prompts` are forgotten. State is a cache of what it was shown: a replacement actor starts empty and learns from
what comes next (its own requests and the learner's history of every actor's), and trajectories never depend on it
(the coupled sampler decides every token)."""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from drafters.base import Drafter, DraftRequest
from sampling.coupled import GREEDY_BELOW, gumbel_at


@dataclass
class _Prompt:
    # every counted sequence's contexts (`counted` tokens of each) and, once `prompt_counted`, the prompt's own
    counts: dict[tuple[int, ...], Counter] = field(default_factory=dict)
    past: deque = field(default_factory=deque)  # finished sequences (prompt + output), oldest first
    live: set[str] = field(default_factory=set)
    prompt_counted: bool = False


@dataclass
class _Sequence:
    request_id: str
    prompt: tuple[int, ...]
    tokens: list[int]  # prompt followed by the committed output
    version: int = 0  # the policy version it started under (as far as this drafter was told: `new_policy`)
    counted: int = field(init=False)  # tokens[:counted] are in its prompt's counts (its output: when drafted from)

    def __post_init__(self):
        self.counted = len(self.prompt)


class SuffixDrafter(Drafter):
    def __init__(self, max_n: int = 8, min_n: int = 2, min_share: float = 0.3, max_sequences: int = 32,
                 max_prompts: int = 512, max_versions: int = 0):
        """`max_versions` W > 0: a finished output stays history only while it started within the last W policy
        versions (0: whatever its version)."""
        self.check_options(dict(max_n=max_n, min_n=min_n, min_share=min_share, max_sequences=max_sequences,
                                max_prompts=max_prompts, max_versions=max_versions))
        self.max_n, self.min_n, self.min_share = max_n, min_n, min_share
        self.max_sequences, self.max_prompts, self.max_versions = max_sequences, max_prompts, max_versions
        self.version = 0  # the policy's, as the actor last said (`new_policy`)
        self.prompts: OrderedDict[tuple[int, ...], _Prompt] = OrderedDict()
        self.sequences: dict[str, _Sequence] = {}
        self.last_confidences: list[list[float]] = []  # the last proposal's confidences

    @classmethod
    def check_options(cls, options: dict) -> dict:
        o = super().check_options(options)
        if not 1 <= o["min_n"] <= o["max_n"]:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={o['min_n']}, max_n={o['max_n']}")
        if not 0 < o["min_share"] <= 1:
            raise ValueError(f"need 0 < min_share <= 1, got min_share={o['min_share']}")
        if o["max_sequences"] < 0 or o["max_prompts"] < 1 or o["max_versions"] < 0:
            raise ValueError(f"need max_sequences >= 0, max_prompts >= 1 and max_versions >= 0, got max_sequences="
                             f"{o['max_sequences']}, max_prompts={o['max_prompts']}, max_versions={o['max_versions']}")
        return o

    def propose(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        sequences = [self._sync(r) for r in requests]  # every request first, so none sees a sibling half-synced
        for prompt in {s.prompt for s in sequences}:
            self._catch_up(prompt)
        walks = [self._walk(s, r, r.budget(k)) for s, r in zip(sequences, requests)]
        self.last_confidences = [confidences for _, confidences in walks]
        return [drafts for drafts, _ in walks]

    def propose_ahead(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        """A walk from each request's unverified tail over its prompt's tables, counting nothing (a request not
        seen yet gets no drafts)."""
        walks, caught_up = [], set()
        for r in requests:
            sequence = self.sequences.get(r.request_id)
            if sequence is None or sequence.prompt not in self.prompts:
                walks.append(([], []))
                continue
            if sequence.prompt not in caught_up:
                caught_up.add(self._catch_up(sequence.prompt))
            tail = _Sequence(r.request_id, sequence.prompt, [int(t) for t in r.token_ids[-self.max_n:]])
            walks.append(self._walk(tail, r, r.budget(k)))
        self.last_confidences = [confidences for _, confidences in walks]
        return [drafts for drafts, _ in walks]

    def confidences(self) -> list[list[float]]:
        """Per draft token, the likelihood that the target samples it (above; one of one sibling: 0.5; eight of eight:
        0.89)."""
        return self.last_confidences

    def commit(self, request_id: str, committed: list[int]) -> None:
        sequence = self.sequences.get(request_id)
        if sequence is not None:  # counted at the next proposal from its prompt
            sequence.tokens.extend(int(t) for t in committed)

    def remove(self, request_id: str) -> None:
        """A finished request's output stays as history of its prompt (the newest `max_sequences`)."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is None:
            return
        entry = self.prompts.get(sequence.prompt)
        if entry is None:
            return
        entry.live.discard(request_id)
        self._keep(entry, sequence)

    def remember(self, prompt_ids: list[int], response_ids: list[int], version: int) -> None:
        """Another actor's finished output of a prompt: history like this engine's own."""
        prompt = tuple(int(t) for t in prompt_ids)
        sequence = _Sequence("", prompt, [*prompt, *(int(t) for t in response_ids)], version)  # no request has id ""
        if not self._recent(sequence):
            return
        entry = self._prompt(prompt)
        self.prompts.move_to_end(prompt)
        self._keep(entry, sequence)

    def new_policy(self, version: int) -> None:
        """Outputs that started more than `max_versions` versions before `version` stop being history."""
        self.version = version
        for entry in self.prompts.values() if self.max_versions else ():
            old = [s for s in entry.past if not self._recent(s)]
            for sequence in old:
                self._uncount(sequence)
            if old:
                entry.past = deque(s for s in entry.past if self._recent(s))

    def _recent(self, sequence: _Sequence) -> bool:
        return not self.max_versions or sequence.version > self.version - self.max_versions

    def _keep(self, entry: _Prompt, sequence: _Sequence) -> None:
        """`sequence` joins its prompt's finished outputs if it is recent enough (else what was counted of it goes);
        the oldest beyond `max_sequences` leave."""
        if not self._recent(sequence):
            self._uncount(sequence)
            return
        entry.past.append(sequence)
        while len(entry.past) > self.max_sequences:
            self._uncount(entry.past.popleft())

    def _sync(self, request: DraftRequest) -> _Sequence:
        history, rid = request.token_ids, request.request_id
        prompt_len = len(history) - request.position
        sequence = self.sequences.get(rid)
        if (sequence is None or len(sequence.tokens) != len(history) or len(sequence.prompt) != prompt_len
                or (len(history) and sequence.tokens[-1] != int(history[-1]))):
            if sequence is not None:  # not the history we counted: take its counts back and start over
                self._uncount(sequence)
                self.prompts[sequence.prompt].live.discard(rid)
            tokens = [int(t) for t in history]
            sequence = self.sequences[rid] = _Sequence(rid, tuple(tokens[:prompt_len]), tokens, self.version)
            entry = self._prompt(sequence.prompt)
            for old in [s for s in entry.past if s.request_id == rid]:  # back after a preemption: not a new sample
                entry.past.remove(old)
                self._uncount(old)
            entry.live.add(rid)
        self.prompts.move_to_end(sequence.prompt)
        return sequence

    def _prompt(self, prompt: tuple[int, ...]) -> _Prompt:
        entry = self.prompts.get(prompt)
        if entry is None:
            entry = self.prompts[prompt] = _Prompt()
            for old in [p for p, e in self.prompts.items() if not e.live and p != prompt]:
                if len(self.prompts) <= self.max_prompts:
                    break
                del self.prompts[old]  # least recently used first
        return entry

    def _catch_up(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        """Counts what the prompt's table does not hold yet: the prompt's own n-grams (once for all its samples) and
        every live and finished sequence's tokens past what was counted of it; returns `prompt`."""
        entry = self.prompts[prompt]
        if not entry.prompt_counted:
            self._add(entry, list(prompt), 1, len(prompt), +1)
            entry.prompt_counted = True
        for sequence in [*(self.sequences[rid] for rid in entry.live), *entry.past]:
            if sequence.counted < len(sequence.tokens):
                self._add(entry, sequence.tokens, max(sequence.counted, 1), len(sequence.tokens), +1)
                sequence.counted = len(sequence.tokens)
        return prompt

    def _uncount(self, sequence: _Sequence) -> None:
        """Takes what was counted of `sequence`'s output back from its prompt's table (it is history no more)."""
        entry = self.prompts.get(sequence.prompt)
        if entry is not None:
            self._add(entry, sequence.tokens, max(len(sequence.prompt), 1), sequence.counted, -1)

    def _add(self, entry: _Prompt, tokens: list[int], first: int, end: int, sign: int) -> None:
        for i in range(first, end):
            for n in range(self.min_n, min(self.max_n, i) + 1):  # shorter contexts are never looked up
                context = tuple(tokens[i - n : i])
                counts = entry.counts.get(context)
                if counts is None:
                    counts = entry.counts[context] = Counter()
                counts[tokens[i]] += sign
                if counts[tokens[i]] <= 0:
                    del counts[tokens[i]]
                    if not counts:
                        del entry.counts[context]

    def _walk(self, sequence: _Sequence, request: DraftRequest, k: int) -> tuple[list[int], list[float]]:
        entry, tail, drafts, confidences = self.prompts[sequence.prompt], sequence.tokens[-self.max_n :], [], []
        sampling = request.temperature >= GREEDY_BELOW
        while len(drafts) < k:
            for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
                counts = entry.counts.get(tuple(tail[-n:]))
                if counts:
                    break
            else:
                break
            if sampling:
                token, confidence = coupled_choice(counts, request.seed, request.position + len(drafts))
                if confidence < self.min_share:
                    break
            else:
                token, count = max(counts.items(), key=lambda tc: (tc[1], -tc[0]))  # ties: the smaller id, stably
                total = sum(counts.values())
                if count < self.min_share * total:
                    break
                confidence = count / (total + 1)
            drafts.append(token)
            confidences.append(confidence)
            tail = tail[1:] + [token] if len(tail) >= self.max_n else tail + [token]
        return drafts, confidences


def coupled_choice(counts: Counter, seed: int, position: int) -> tuple[int, float]:
    """Of the tokens in `counts` (samples of the target's distribution after one context), the one with the largest
    `log(count) + G(seed, position, token)`, and the chance that the target draws it: that its lead over the
    runner-up exceeds the error of the two log-counts (standard error about `sqrt(1/a + 1/b)`), times `n / (n + 1)`
    for a draw outside the `n` counted samples."""
    tokens = list(counts)
    scores = [math.log(counts[t]) + g for t, g in zip(tokens, gumbel_at(seed, position, tokens))]
    order = sorted(range(len(tokens)), key=scores.__getitem__, reverse=True)
    best, total = order[0], sum(counts.values())
    known = total / (total + 1)
    if len(order) == 1:
        return tokens[best], known
    second = order[1]
    spread = math.sqrt(1 / counts[tokens[best]] + 1 / counts[tokens[second]])
    lead = scores[best] - scores[second]
    return tokens[best], known * 0.5 * (1 + math.erf(lead / (spread * math.sqrt(2))))
