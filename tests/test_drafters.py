"""The built-in drafters' mechanics beyond the plugin contract: the draft LM's batched slot-cache forward gives the
Hugging Face model's own logits, whatever the batch, chunking and rollbacks; the incremental n-gram index proposes
exactly what a scan of the whole history would."""

import random
from collections import Counter

from dataclasses import replace

import numpy as np
import pytest
import torch

from drafters.base import DraftRequest
from drafters.draft_lm import DraftLM, SlotCache, _State
from drafters.ngram import NgramDrafter
from drafters.suffix import SuffixDrafter
from sampling.coupled import coupled_sample, gumbel, gumbel_at


@pytest.fixture(scope="module")
def draft_lm():
    return DraftLM()


def reference_logits(drafter: DraftLM, history: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return drafter.model(input_ids=torch.tensor([history])).logits[0, -1].float()


def test_batched_forward_matches_the_model_over_chunks_and_rollbacks(draft_lm):
    assert draft_lm.cache.kv[0].shape[1] == 256  # positions are reserved as histories grow, not up front
    rng = random.Random(1)
    vocab = draft_lm.model.config.vocab_size
    histories = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 400))] for _ in range(6)]  # cache grows
    states = [_State(draft_lm.cache.take()) for _ in histories]
    with torch.inference_mode():
        cut = [rng.randrange(1, len(h)) for h in histories]  # ragged chunks in one batch
        draft_lm._forward(states, [h[:c] for h, c in zip(histories, cut)])
        logits = draft_lm._forward(states, [h[c:] for h, c in zip(histories, cut)])
    assert draft_lm.cache.kv[0].shape[1] >= max(len(h) for h in histories)
    for row, history in zip(logits, histories):
        torch.testing.assert_close(row, reference_logits(draft_lm, history), atol=2e-5, rtol=1e-4)
    for state in states:
        draft_lm.cache.give_back(state.slot)


def test_a_longer_slot_cache_copies_the_slots_in_use_not_the_free_ones_past_them():
    """The draft LM's cache keeps the slot count of its largest proposal ahead (a scratch slot per outcome); when it
    grows in length, the free slots past the last one in use are left behind (copying 1,024 slots to double their
    length took 128 ms), and what the slots in use hold is kept."""
    cache = SlotCache(layers=2, kv_heads=1, head_dim=4, max_len=4096, dtype=torch.float32, device=torch.device("cpu"))
    slots = [cache.take() for _ in range(1024)]
    kept = [slots[3], slots[200]]
    for slot in slots:
        if slot not in kept:
            cache.give_back(slot)
    for layer in cache.kv:
        layer[kept] = torch.randn(2, *layer.shape[1:])
    before = [layer[kept].clone() for layer in cache.kv]
    cache.reserve(300)
    assert all(layer.shape[:2] == (201, 512) for layer in cache.kv)
    assert all(torch.equal(layer[kept, :256], old) for layer, old in zip(cache.kv, before))
    taken = {cache.take() for _ in range(300)}  # every free slot below the last in use first, then new ones
    assert not taken & set(kept) and len(taken) == 300 and cache.kv[0].shape == (402, 512, 2, 4)


def test_outcomes_ahead_read_their_shared_prefix_from_the_requests_slot_and_guess_past_a_rejection(draft_lm):
    """`propose_ahead` with every outcome of a verify step in one call (the request's own slot for all drafts
    accepted, scratch slots reading the prefix they share with it for the others): each outcome's proposal is the
    one a drafter with no shared slots makes for that history alone, a rejected draft is never guessed again, and the
    request's slot is left as the committed history left it."""
    rng = random.Random(4)
    history = [rng.randrange(3, 60) for _ in range(30)]

    def ask(tokens, position, **kw):
        return DraftRequest("a", seed=5, position=position, token_ids=np.array(tokens), temperature=1.0, **kw)

    drafts = draft_lm.propose([ask(history, 20)], 4)[0]
    assert len(drafts) == 4
    outcomes = [ask(history + drafts, 24, unverified=4, max_tokens=5)]  # every draft accepted
    outcomes += [ask(history + drafts[:j], 20 + j, unverified=j, rejected=drafts[j], max_tokens=5) for j in range(4)]
    outcomes += [ask(history + drafts, 24, unverified=4, max_tokens=5, guess=1),  # second guesses
                 ask(history + drafts[:1], 21, unverified=1, rejected=drafts[1], max_tokens=5, guess=1)]
    in_use = draft_lm.cache.kv[0].shape[0] - len(draft_lm.cache.free)
    ahead = draft_lm.propose_ahead(outcomes, 5)
    assert draft_lm.cache.kv[0].shape[0] - len(draft_lm.cache.free) == in_use  # the scratch slots were given back
    alone = DraftLM()
    assert ahead == [alone.propose([outcome], 5)[0] for outcome in outcomes]
    assert all(proposal[0] != drafts[j] for j, proposal in enumerate(ahead[1:5]))  # past a rejection: another token
    # a second guess is the winner once the first is set aside, as if the first were the rejected draft
    assert ahead[5] == alone.propose([replace(outcomes[5], guess=0, rejected=ahead[0][0])], 5)[0]
    assert ahead[6][0] not in (ahead[2][0], drafts[1])
    assert draft_lm.propose([ask(history, 20)], 4)[0] == drafts  # the committed history's proposal is unchanged


def test_a_long_history_fed_one_token_beside_a_new_prompt():
    """The ragged batch whose padding runs past every real position (and once past the rotary table: IndexError in
    a long-tail rollout): a request 251 tokens in, fed its next token, beside a new request's 10-token prompt."""
    drafter = DraftLM()  # a fresh one: its rotary table is exactly as long as the first pass needed (256)
    rng = random.Random(4)
    vocab = drafter.model.config.vocab_size
    long, prompt = [rng.randrange(vocab) for _ in range(252)], [rng.randrange(vocab) for _ in range(10)]
    states = [_State(drafter.cache.take()), _State(drafter.cache.take())]
    with torch.inference_mode():
        drafter._forward(states[:1], [long[:251]])
        logits = drafter._forward(states, [long[251:], prompt])
    torch.testing.assert_close(logits[0], reference_logits(drafter, long), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits[1], reference_logits(drafter, prompt), atol=2e-5, rtol=1e-4)


def test_the_padded_one_token_passes_a_gpu_graphs_draft_what_the_eager_passes_do():
    """What `drafters/draft_lm_graphs.py` captures as CUDA graphs on a GPU, run eagerly here: one-token passes padded
    to a bucket of rows (a padding slot) and of span (masked positions), reading outcomes' shared prefixes from
    their requests' slots, made for proposals ahead at the next commit. Over proposals and proposals ahead, at three sampling settings, with histories crossing a
    span bucket (the slot cache grows and the passes are made anew) and a request leaving, every draft is the eager
    passes' draft; and the logits of one padded pass are the eager pass's."""
    from drafters.draft_lm_graphs import GraphedPasses

    eager, padded = DraftLM(), DraftLM()
    padded.graphs = GraphedPasses(padded, capture=False)
    rng = random.Random(3)
    vocab = eager.model.config.vocab_size
    histories = {f"r{i}": [rng.randrange(vocab) for _ in range(30 + 23 * i)] for i in range(11)}

    def requests():
        return [DraftRequest(i, seed=n, position=len(h) - 20, token_ids=h, temperature=(0.0, 1.0, 0.7)[n % 3],
                             top_p=(1.0, 1.0, 0.9)[n % 3]) for n, (i, h) in enumerate(histories.items())]

    for step in range(10):
        drafts = eager.propose(requests(), 4)
        assert padded.propose(requests(), 4) == drafts
        ahead = []
        for r, d in zip(requests(), drafts):
            ahead.append(replace(r, token_ids=list(r.token_ids) + d, unverified=len(d), position=r.position + len(d)))
            if len(d) > 1:
                ahead.append(replace(r, token_ids=list(r.token_ids) + d[:1], unverified=1, rejected=d[1],
                                     position=r.position + 1))
        assert padded.propose_ahead(ahead, 4) == eager.propose_ahead(ahead, 4)
        missed = set(padded.graphs.wanted)  # a proposal ahead makes no pass: the next commit makes what it missed
        padded.commit("r0", [])
        assert not padded.graphs.wanted and missed <= set(padded.graphs.passes)
        for (i, h), d in zip(list(histories.items()), drafts):
            histories[i] = h + d[: rng.randrange(len(d) + 1)] + [rng.randrange(vocab)]
        if step == 4:
            for drafter in (eager, padded):
                drafter.remove("r3")
            del histories["r3"]
    assert any(span > 256 for _, span in padded.graphs.passes)  # the histories crossed a bucket
    assert any(rows > 16 for rows, _ in padded.graphs.passes)  # made at a commit for the outcomes ahead
    eager_states, padded_states = [eager.states[i] for i in histories], [padded.states[i] for i in histories]
    assert [s.fed for s in padded_states] == [s.fed for s in eager_states]
    chunks = [[rng.randrange(vocab)] for _ in histories]
    with torch.inference_mode():
        torch.testing.assert_close(padded.graphs(padded_states, chunks, may_capture=True),
                                   eager._forward(eager_states, chunks),
                                   atol=1e-5, rtol=1e-5)


def test_proposals_follow_rejections_and_honour_per_request_budgets(draft_lm):
    rng = random.Random(2)
    vocab = draft_lm.model.config.vocab_size
    history = [rng.randrange(vocab) for _ in range(30)]

    def req(h, **kw):
        return DraftRequest("a", seed=3, position=len(h) - 10, token_ids=h, temperature=1.0, **kw)

    first = draft_lm.propose([req(history)], 4)[0]
    kept = history + first[:1] + [(first[1] + 1) % vocab]  # the verifier took one draft, then its own token
    # a view of an engine-like buffer, as the bridge passes it: answers as a fresh drafter on the same history
    buffer = np.array(kept + [0] * 8)
    again = draft_lm.propose([req(buffer[: len(kept)], max_tokens=2)], 4)[0]
    draft_lm.remove("a")
    assert len(again) == 2 and again == draft_lm.propose([req(kept)], 2)[0]
    slots = len(draft_lm.cache.free)
    draft_lm.remove("a")
    assert len(draft_lm.cache.free) == slots + 1  # the slot goes back; a second remove is a no-op
    draft_lm.remove("a")
    assert len(draft_lm.cache.free) == slots + 1


def test_swapped_weights_are_what_the_next_proposal_drafts_with(draft_lm):
    """The forward reads weights packed from the model's (q/k/v and gate/up stacked): a swap repacks them, so the
    next proposal is the new weights' (here a copy with a changed final norm and MLP; checked against the model's
    own logits)."""
    vocab = draft_lm.model.config.vocab_size
    history = [random.Random(3).randrange(vocab) for _ in range(12)]
    original = {name: t.clone() for name, t in draft_lm.model.state_dict().items()}
    swapped = dict(original)
    # seeded: about 1 in 60 random norms leaves this history's argmax where it was, and the test failed then
    norm = original["model.norm.weight"]
    swapped["model.norm.weight"] = torch.randn(norm.shape, generator=torch.Generator().manual_seed(0), dtype=norm.dtype)
    swapped["model.layers.0.mlp.up_proj.weight"] = original["model.layers.0.mlp.up_proj.weight"] * 3
    greedy = DraftRequest("w", seed=1, position=0, token_ids=history, temperature=0.0)
    try:
        drafted = []
        for weights in (swapped, original):
            assert draft_lm.swap_weights(list(weights.items()))
            drafted += draft_lm.propose([greedy], 1)[0]
            assert drafted[-1] == int(reference_logits(draft_lm, history).argmax())
        assert drafted[0] != drafted[1]  # the swap changed the draft (stale packed weights would not)
    finally:
        draft_lm.swap_weights(list(original.items()))
        draft_lm.remove("w")


def scan(history: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """The definition: the longest n-gram ending the history, at its latest earlier occurrence."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == history[-n:]:
                return history[start + n : start + n + k]
    return []


def test_incremental_ngram_equals_a_scan_of_the_history():
    rng = random.Random(0)
    drafter = NgramDrafter()
    for trial in range(20):
        history = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]  # small vocabulary: many repeats
        rid = f"r{trial}"
        for _ in range(30):
            request = DraftRequest(rid, seed=0, position=0, token_ids=history)
            assert drafter.propose([request], 4) == [scan(history, 4)]
            committed = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
            drafter.commit(rid, committed)
            history = history + committed
        drafter.remove(rid)


PROMPT = [40, 41, 42, 43]


def req(rid: str, output: list[int], **kw) -> DraftRequest:
    return DraftRequest(rid, seed=0, position=len(output), token_ids=PROMPT + output, **kw)


def table(drafter: SuffixDrafter) -> dict:
    """PROMPT's counts as the next proposal from it reads them (commits and finished outputs are counted then)."""
    return drafter.prompts[drafter._catch_up(tuple(PROMPT))].counts


def test_suffix_drafts_from_siblings_without_interleaving_them():
    drafter = SuffixDrafter(min_n=2)
    drafter.propose([req("a", [1, 2, 3, 4, 5]), req("b", [9, 2, 7, 7, 7])], 4)
    # c's tail (1, 2) continues as in a; (9, 2) as in b: contexts never cross from one sibling into another
    assert drafter.propose([req("c", [1, 2])], 4) == [[3, 4, 5]]
    assert drafter.propose([req("d", [9, 2])], 4) == [[7, 7, 7, 7]]  # (7, 7) was followed by 7
    assert drafter.propose([DraftRequest("e", 0, 2, [50, 51, 1, 2])], 4) == [[]]  # another prompt: nothing known


def test_suffix_draft_length_follows_the_history_agreement():
    drafter = SuffixDrafter(min_n=1, min_share=0.6)
    drafter.propose([req("a", [1, 2, 3, 4]), req("b", [1, 2, 3, 8]), req("c", [1, 2, 3, 4])], 4)
    assert drafter.propose([req("d", [1])], 4) == [[2, 3, 4]]  # 4 follows (2, 3) in 2 of 3 siblings: kept
    strict = SuffixDrafter(min_n=1, min_share=0.7)
    strict.propose([req("a", [1, 2, 3, 4]), req("b", [1, 2, 3, 8]), req("c", [1, 2, 3, 4])], 4)
    assert strict.propose([req("d", [1])], 4) == [[2, 3]]  # 2 of 3 is not sure enough: the draft stops there


def test_suffix_keeps_finished_outputs_of_a_prompt_within_its_bounds():
    drafter = SuffixDrafter(max_sequences=1, max_prompts=2)
    drafter.propose([req("a", [1, 2, 3, 4])], 4)
    drafter.remove("a")  # finished: still the prompt's history
    assert drafter.propose([req("b", [1, 2])], 4) == [[3, 4]]
    drafter.commit("b", [5, 6])
    drafter.remove("b")  # one finished output per prompt is kept: a's goes
    assert drafter.propose([req("c", [9, 1, 2])], 4) == [[5, 6]]
    drafter.remove("c")
    for i in range(3):  # other prompts push the least recently used out
        drafter.propose([DraftRequest(f"x{i}", 0, 1, [60 + i, 61 + i, 1])], 4)
        drafter.remove(f"x{i}")
    assert len(drafter.prompts) <= 2 and tuple(PROMPT) not in drafter.prompts


def test_gumbel_at_is_the_samplers_noise():
    rng = random.Random(3)
    for _ in range(50):
        seed, position, tokens = rng.randrange(2**62), rng.randrange(10_000), rng.sample(range(272), 5)
        expected = gumbel(torch.tensor([seed]), torch.tensor([position]), 272)[0, tokens]
        torch.testing.assert_close(torch.tensor(gumbel_at(seed, position, tokens), dtype=torch.float64), expected,
                                   rtol=1e-14, atol=1e-14)


def test_suffix_draws_sampling_requests_with_the_coupled_noise():
    """Siblings sampled two tokens from q = (0.4, 0.3, 0.2, 0.1) each; a new sample's drafts agree with what the
    coupled sampler draws at its seed far more often than the most frequent token would (0.4), at both positions
    (a wrong noise position would fall back to chance at the second); a greedy request gets the most frequent."""
    q = torch.full((272,), float("-inf"))
    q[[1, 2, 3, 4]] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()

    def sample(seeds: list[int], position: int) -> list[int]:
        n = len(seeds)
        return coupled_sample(q.expand(n, -1), torch.tensor(seeds), torch.full((n,), position),
                              torch.ones(n))[0].tolist()

    drafter = SuffixDrafter(min_n=1, min_share=0.01)
    history = list(range(1000, 1200))
    firsts, seconds = sample(history, 0), sample(history, 1)
    for seed, first, second in zip(history, firsts, seconds):
        drafter.propose([DraftRequest(f"h{seed}", seed, 2, PROMPT + [first, second])], 1)
        drafter.remove(f"h{seed}")
    fresh = list(range(5000, 5300))
    firsts, seconds = sample(fresh, 0), sample(fresh, 1)
    proposals = drafter.propose([DraftRequest(f"n{s}", s, 0, PROMPT, temperature=1.0) for s in fresh], 2)
    assert all(len(p) == 2 for p in proposals)
    agree_first = [p[0] == t for p, t in zip(proposals, firsts)]
    agree_second = [p[1] == t for p, t, a in zip(proposals, seconds, agree_first) if a]
    assert sum(agree_first) / len(fresh) > 0.7  # 0.76; with exact probabilities it would be 1
    # 0.79 (the position unshifted: 0.36); after a draw, its context holds a fraction of the history
    assert sum(agree_second) / len(agree_second) > 0.6
    assert drafter.propose([DraftRequest("g", 0, 0, PROMPT)], 1) == [[1]]  # greedy: the most frequent


def test_suffix_tables_hold_exactly_the_history_whenever_a_proposal_reads_them():
    """Counting is left to the next proposal from a prompt; whatever happened meanwhile (commits, finished and
    remembered outputs, evictions past max_sequences, expired versions, a request shown another history), the table a
    proposal reads is the one counted from scratch from the prompt, its live sequences and its kept outputs."""
    rng = random.Random(5)

    def from_scratch(drafter: SuffixDrafter) -> Counter:
        entry, expected = drafter.prompts[tuple(PROMPT)], Counter()
        sequences = [*(drafter.sequences[r].tokens for r in entry.live), *(s.tokens for s in entry.past)]
        for tokens, first in [(PROMPT, 1), *((s, len(PROMPT)) for s in sequences)]:
            for i in range(first, len(tokens)):
                for n in range(drafter.min_n, min(drafter.max_n, i) + 1):
                    expected[(tuple(tokens[i - n : i]), tokens[i])] += 1
        return expected

    drafter, outputs, version = SuffixDrafter(max_n=4, max_sequences=3, max_versions=3), {}, 0
    for _ in range(400):
        op, rid = rng.random(), f"r{rng.randrange(5)}"
        if op < 0.35:
            outputs.setdefault(rid, [])
            if rng.random() < 0.1 and outputs[rid]:  # the engine shows another history (recomputed)
                outputs[rid][-1] = (outputs[rid][-1] + 1) % 6
            drafter.propose([req(rid, outputs[rid])], 4)
            table = Counter({(c, t): n for c, counts in drafter.prompts[tuple(PROMPT)].counts.items()
                             for t, n in counts.items()})
            assert table == from_scratch(drafter)
        elif op < 0.7 and rid in drafter.sequences:
            committed = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            outputs[rid] += committed
            drafter.commit(rid, committed)
        elif op < 0.8:
            drafter.remove(rid)
            outputs.pop(rid, None)
        elif op < 0.9:
            drafter.remember(PROMPT, [rng.randrange(6) for _ in range(rng.randrange(1, 8))], version - rng.randrange(4))
        else:
            version += 1
            drafter.new_policy(version)


def test_suffix_counts_after_a_rebuild_equal_a_fresh_drafters():
    drafter, fresh = SuffixDrafter(), SuffixDrafter()
    drafter.propose([req("a", [1, 2, 3])], 4)
    drafter.commit("a", [4, 5])
    drafter.propose([req("a", [1, 2, 9])], 4)  # the engine shows another history for "a" (e.g. recomputed)
    fresh.propose([req("a", [1, 2, 9])], 4)
    assert table(drafter) == table(fresh)


def test_suffix_counts_a_request_back_from_preemption_once():
    drafter, fresh = SuffixDrafter(), SuffixDrafter()
    drafter.propose([req("a", [1, 2, 3])], 4)
    drafter.remove("a")  # preempted (e.g. by a weight update): it left the batch with a partial output
    drafter.propose([req("a", [1, 2, 3, 4])], 4)  # and comes back with its whole history
    fresh.propose([req("a", [1, 2, 3, 4])], 4)
    assert table(drafter) == table(fresh)


def test_suffix_drafts_from_outputs_other_actors_sampled_as_from_its_own():
    """The learner sends every step's outputs to every actor (a prompt's next epoch may land on any of them):
    remembered, they are the prompt's history exactly as this engine's own finished requests are."""
    drafter, own = SuffixDrafter(max_sequences=2), SuffixDrafter(max_sequences=2)
    drafter.remember(PROMPT, [1, 2, 3, 4], 0)
    own.propose([req("a", [1, 2, 3, 4])], 4)
    own.remove("a")
    assert table(drafter) == table(own)
    assert drafter.propose([req("b", [1, 2])], 4) == [[3, 4]]
    drafter.remember(PROMPT, [1, 2, 7, 7], 0)
    drafter.remember(PROMPT, [1, 2, 7, 7], 0)  # two samples of one output count twice; [1, 2, 3, 4] is the oldest: gone
    assert drafter.propose([req("c", [1, 2])], 4) == [[7, 7]] and len(drafter.prompts[tuple(PROMPT)].past) == 2
    drafter.remove("b")  # a live request finishing still joins, and the window stays at max_sequences
    assert len(drafter.prompts[tuple(PROMPT)].past) == 2


def test_suffix_history_keeps_only_outputs_of_the_last_versions_when_asked():
    drafter, unbounded = SuffixDrafter(max_versions=2), SuffixDrafter()
    for d in (drafter, unbounded):
        d.new_policy(5)
        d.propose([req("a", [1, 2, 3, 4])], 4)  # started under version 5
        d.remember(PROMPT, [1, 2, 8, 8], 4)  # another actor's, started under 4
        d.remember(PROMPT, [1, 2, 9, 9], 3)  # too old for a window of 2 versions (4 and 5): never counted
    assert [s.tokens[-2:] for s in drafter.prompts[tuple(PROMPT)].past] == [[8, 8]]
    assert len(unbounded.prompts[tuple(PROMPT)].past) == 2
    drafter.new_policy(6)  # 4 leaves the window; a's output, finishing now, started under 5: kept
    drafter.remove("a")
    assert [s.tokens[-2:] for s in drafter.prompts[tuple(PROMPT)].past] == [[3, 4]]
    fresh = SuffixDrafter()
    fresh.propose([req("b", [1, 2, 3, 4])], 4)
    fresh.remove("b")
    assert table(drafter) == table(fresh)  # the old counts are gone
    drafter.new_policy(8)
    assert not drafter.prompts[tuple(PROMPT)].past and drafter.propose([req("c", [1, 2])], 4) == [[]]
    with pytest.raises(ValueError, match="max_versions"):
        SuffixDrafter(max_versions=-1)


def test_the_draft_lm_makes_every_tensor_on_its_own_device():
    """The device plumbing a GPU engine relies on (the engine hands the draft LM its device: drafters.base
    .load_drafter): with the default device set to `meta`, any tensor the drafter made without naming its device
    would land there and fail to mix with its weights; it drafts what it drafts with no default device set."""
    from drafters.base import load_drafter

    drafter = load_drafter("draft_lm", {}, device="cpu")
    assert drafter.device == torch.device("cpu") and drafter.cache.kv[0].device == drafter.device
    assert load_drafter("draft_lm", {"device": "cpu"}, device="meta").device == torch.device("cpu")  # config wins
    rng = random.Random(5)
    vocab = drafter.model.config.vocab_size
    rows = [DraftRequest(f"r{i}", seed=i, position=3, token_ids=[rng.randrange(vocab) for _ in range(n)],
                         temperature=t, top_k=tk, top_p=tp)
            for i, (n, t, tk, tp) in enumerate([(12, 1.0, 0, 1.0), (30, 0.7, 20, 0.9), (5, 0.0, 0, 1.0)])]
    torch.set_default_device("meta")
    try:
        meta = drafter.propose(rows, 4)
        meta = [meta[0]] + drafter.propose([DraftRequest("r0", 0, 4, [*rows[0].token_ids, meta[0][0]], 1.0)], 3)
    finally:
        torch.set_default_device(None)
    fresh = load_drafter("draft_lm", {}, device="cpu")
    plain = fresh.propose(rows, 4)
    plain = [plain[0]] + fresh.propose([DraftRequest("r0", 0, 4, [*rows[0].token_ids, plain[0][0]], 1.0)], 3)
    assert meta == plain and all(len(d) > 0 for d in meta)


@pytest.mark.parametrize("make", [NgramDrafter, SuffixDrafter, DraftLM])
def test_a_proposal_ahead_leaves_the_drafter_as_the_committed_history_left_it(make):
    """`propose_ahead` (decoupled speculation) on a history that runs past what is committed: the next proposal on the
    committed history is a fresh drafter's."""
    rng = random.Random(6)
    history = [rng.randrange(3, 60) for _ in range(12)] * 3  # repeats: n-gram and suffix tables find matches

    def ask(drafter, tokens, **kw):
        return DraftRequest("a", seed=2, position=len(tokens) - 5, token_ids=np.array(tokens), temperature=1.0, **kw)

    used, fresh = make(), make()
    used.propose([ask(used, history)], 4)
    used.commit("a", history[:1])
    committed = history + history[:1]
    ahead = used.propose_ahead([ask(used, committed + [7, 8], unverified=2, max_tokens=5)], 5)
    assert len(ahead) == 1 and len(ahead[0]) <= 5
    fresh.propose([ask(fresh, history)], 4)
    fresh.commit("a", history[:1])
    assert used.propose([ask(used, committed)], 4) == fresh.propose([ask(fresh, committed)], 4)
