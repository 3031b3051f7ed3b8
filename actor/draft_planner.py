"""How many tokens to draft for each running request, every engine step: the cost-model planner.

Speculation pays where verifying `1 + d` tokens costs little more than decoding one (small batches, the long tail)
and loses where the engine is compute-bound. Where that line lies depends on the machine, the model and the
drafter, so the planner learns it online from the engine's own steps instead of a fixed gate:
- `StepCost`: engine step seconds as a function of the tokens the step computes (piecewise linear over
  geometric buckets of exponentially averaged observations, monotone, extrapolated along its trend);
- `DraftCost`: drafting's seconds as a linear function of its draft passes, drafted tokens and catch-up tokens;
- `Acceptance`: each request's per-token acceptance probability, shrunk towards the drafter's running average;
- `Survival`: the chance that a request is still running a few tokens on, from the lengths of those that ended.
With acceptance `a`, the `j`-th draft token of a request adds `a**j` expected committed tokens (times its
survival); a drafter that rates its tokens (`Drafter.confidences`, calibrated in drafters/calibration.py) gives each
token's own gain once it has drafted. `plan` takes draft tokens in order of gain and keeps the prefix that maximises
expected committed tokens per second `(n + sum of gains) / (step(n + drafted) + draft(passes, drafted))`; 0
everywhere when no drafting pays (but for a rare exploring step, so the estimates never freeze where drafting
stopped). A plan of no drafts is kept for a few steps without planning (`Rest`): planning costs per request and step,
and where drafting does not pay that cost is all speculation adds.
Correctness never depends on it: drafts only change how fast the coupled sampler's tokens come out.
"""

from __future__ import annotations

import bisect

import numpy as np


EXPLORE_EVERY = 32  # engine steps without a draft before one request may draft anyway (`Explore`)
EXPLORE_SHARE = 0.01  # of the engine's time without drafts, what exploring steps may cost (`Explore`)
# the drafter's acceptance counts as measured after this many verified draft tokens, or rejections (`Acceptance`)
MEASURED_DRAFTS, MEASURED_REJECTIONS = 16, 4
REST_STEPS = 3  # engine steps the first rest keeps a plan of no drafts for without planning (`Rest`)
MAX_REST = 24  # the longest rest, in engine steps


class Rest:
    """Where the last two plans drafted nothing, the next steps draft nothing without planning: `REST_STEPS` of them,
    twice as many after each further plan of no drafts in a row (up to `MAX_REST`), unless the batch shrinks to half
    its size then (a smaller batch is where drafting starts to pay) or an exploring step is due. What a plan weighs
    moves slowly while nothing is drafted (no acceptance is observed; the step cost and the requests' survival move a
    step at a time), so a skipped plan would almost always have drafted nothing too. One plan of no drafts (the
    planner measuring a smaller step) is no rest."""

    def __init__(self):
        self.rows, self.left, self.idle = 0, 0, 0  # the batch size of the last plan; steps of rest left; idle plans

    def keeps(self, rows: int) -> bool:
        """Whether this step, of `rows` requests, keeps the plan of no drafts (counted as one step of the rest)."""
        if self.left > 0 and 2 * rows > self.rows:
            self.left -= 1
            return True
        return False

    def planned(self, rows: int, drafted: bool) -> None:
        """A plan was made for `rows` requests: from the second plan of no drafts in a row, it is kept for a rest."""
        self.idle = 0 if drafted else self.idle + 1
        self.rows, self.left = rows, min(REST_STEPS << min(self.idle - 2, 8), MAX_REST) if self.idle >= 2 else 0


class Explore:
    """When a planner that drafts nothing drafts for one request anyway (`plan(explore=True)`), so that its estimates
    never freeze where drafting stopped: after `EXPLORE_EVERY` steps without a draft, and once those steps took the
    engine `1 / EXPLORE_SHARE` times what the last exploring step cost (its drafting, and the verify tokens it added;
    a step that drafted for one request only, as a forced exploring step does).
    Where drafting does not pay, exploring then costs about `EXPLORE_SHARE` of the engine's time, whatever a draft
    costs against a step on the hardware (a draft model's catch-up on one request can cost half a CPU step).
    A new planner also explores every step until the drafter's acceptance is measured (in its first `EXPLORE_EVERY`
    steps): a plan weighs drafts at their acceptance, and judged on the starting guess a good drafter can look not
    worth a try at the first full batch, and wait `EXPLORE_EVERY` steps for its first measure."""

    def __init__(self, acceptance: Acceptance):
        self.acceptance = acceptance
        self.steps, self.seconds, self.cost = 0, 0.0, 0.0  # steps and engine seconds since the last draft; its cost
        self.life = 0  # steps planned (or rested) so far

    def due(self) -> bool:
        if not self.acceptance.measured and self.life < EXPLORE_EVERY:
            return True
        return self.steps >= EXPLORE_EVERY and self.seconds * EXPLORE_SHARE >= self.cost

    def stepped(self, drafted: bool) -> None:
        """An engine step was planned (or rested): whether it drafted."""
        self.steps, self.seconds = (0, 0.0) if drafted else (self.steps + 1, self.seconds)
        self.life += 1

    def took(self, seconds: float) -> None:
        """The engine's last step took `seconds`."""
        self.seconds += seconds

    def explored(self, requests: int, cost: float) -> None:
        """An exploring step drafted for `requests` requests, at `cost` seconds of drafting and verifying: its cost
        is learnt where it drafted for one (a forced explore; a plan that drafted anyway is no measure of it)."""
        if requests == 1:
            self.cost = cost


class StepCost:
    """Seconds of one engine step as a function of the tokens it computes, learned from observations."""

    BUCKETS = 2.0 ** np.arange(0, 16, 0.5)  # bucket b holds steps with BUCKETS[b] <= tokens < BUCKETS[b + 1]
    EDGES = tuple(BUCKETS.tolist())  # (the same, for `bisect`: observed every engine step)
    STALE = 8  # observations after which `observe` makes the curve again for its own prediction

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.tokens = np.zeros(len(self.BUCKETS))  # per bucket: averaged tokens and seconds of its steps
        self.seconds = np.zeros(len(self.BUCKETS))
        self.seen = np.zeros(len(self.BUCKETS), dtype=bool)
        self.measured = False  # any step observed
        self.curve: tuple[np.ndarray, np.ndarray, float] | None = None  # the kept buckets and the slope beyond them
        self.changed = 0  # observations since the curve was made

    def observe(self, tokens: int, seconds: float) -> float:
        """Learns a step of `tokens` that took `seconds`; returns what the curve predicted for it (0 before any
        observation). That prediction comes from the curve as made up to `STALE` observations ago: between plans (the
        planner's rest) every step is observed, and remaking the curve each time would be most of a rest step's work."""
        b = min(max(bisect.bisect_right(self.EDGES, tokens) - 1, 0), len(self.BUCKETS) - 1)
        fresh = self.curve is None or self.changed >= self.STALE
        predicted = self._at(float(tokens), self._curve() if fresh else self.curve) if self.measured else 0.0
        # one stalled step (a weight update, a busy host) moves a measured bucket, never replaces it; a bucket's first
        # step is taken as measured: where the curve only extrapolates it can be several times wrong, and a guard
        # around a wrong prediction would keep it wrong for every later step of that size
        if self.seen[b]:
            clipped = min(max(seconds, predicted / 2), 2 * predicted)
            self.tokens[b] = self.decay * self.tokens[b] + (1 - self.decay) * tokens
            self.seconds[b] = self.decay * self.seconds[b] + (1 - self.decay) * clipped
            self.changed += 1
        else:
            self.tokens[b], self.seconds[b], self.seen[b], self.measured = tokens, seconds, True, True
            self.curve = None
        return predicted

    def predict(self, tokens: np.ndarray | int) -> np.ndarray:
        """Predicted seconds (0 before any observation: drafting looks free until the engine is measured)."""
        if not self.measured:
            return np.zeros_like(np.asarray(tokens, dtype=float))
        curve = self._curve()
        if np.ndim(tokens) == 0:  # a step's own prediction, several times a step: without arrays
            return np.float64(self._at(float(tokens), curve))
        x, y, slope = curve
        tokens = np.asarray(tokens, dtype=float)
        inside = np.interp(tokens, x, y)
        # below the smallest bucket: as if proportional to tokens, the cheapest a smaller step could be, so that a
        # planner that has only seen drafted steps tries one with fewer drafts and learns what it really costs
        below = y[0] * np.maximum(tokens, 1) / max(x[0], 1)
        return np.where(tokens > x[-1], y[-1] + slope * (tokens - x[-1]), np.where(tokens < x[0], below, inside))

    @staticmethod
    def _at(t: float, curve: tuple[np.ndarray, np.ndarray, float]) -> float:
        """`predict` of one step on `curve`."""
        x, y, slope = curve
        return float(y[-1] + slope * (t - x[-1]) if t > x[-1] else
                     y[0] * max(t, 1.0) / max(x[0], 1.0) if t < x[0] else np.interp(t, x, y))

    def _curve(self) -> tuple[np.ndarray, np.ndarray, float]:
        """The kept buckets' tokens and seconds, and the slope beyond the largest (made again after an observation).
        Fewer tokens never cost more: a bucket slower than some larger one is left out. Errors are one-sided (a stall
        only ever makes a step slower), so one stalled small step, never measured again, must not lift the curve:
        raising each bucket to the largest smaller one instead would make every larger step look as slow as that
        stall, drafting look free, and every request draft."""
        if self.curve is None or self.changed:
            x, y = self.tokens[self.seen], self.seconds[self.seen]
            kept = y <= np.minimum.accumulate(y[::-1])[::-1]
            x, y = x[kept], y[kept]
            slope = 0.0
            if len(x) >= 2:  # beyond the largest bucket: the trend of the last two buckets, never falling
                slope = max((y[-1] - y[-2]) / max(x[-1] - x[-2], 1e-9), 0.0)
            self.curve, self.changed = (x, y, slope), 0
        return self.curve


class DraftCost:
    """Drafting's seconds per step (the drafter's call and the bridge's work on its proposals) as
    `c0 + c1 * passes + c2 * drafted_tokens + c3 * unseen_tokens` (passes: the largest number of tokens drafted for
    one request, i.e. sequential forwards of a draft model; unseen: history tokens the drafting requests had not shown
    the drafter in a proposal before, i.e. a draft model's catch-up: a new request's whole prompt, or what a request
    committed while it was not drafting), fitted by exponentially weighted least squares with every coefficient >= 0
    (exactly: Lawson and Hanson's active-set method); a drafter that costs nothing (n-gram lookup, replay) is learned
    as such. Clipping an unconstrained fit at 0 instead is not a fit: after a few like steps and one unlike one (many
    new requests drafting one token each) it can read a small step as a large fixed cost, and the planner would stop
    drafting for the rest of the batch."""

    TERMS = 4

    def __init__(self, decay: float = 0.97, ridge: float = 1e-9):
        self.decay, self.ridge = decay, ridge
        self.gram = np.zeros((self.TERMS, self.TERMS))
        self.moment = np.zeros(self.TERMS)
        self.coef = np.zeros(self.TERMS)

    @property
    def measured(self) -> bool:
        """Whether any drafting was observed (before, `predict` gives 0: drafting looks free)."""
        return bool(self.gram[0, 0] > 0)

    def observe(self, passes: int, drafted: int, unseen: int, seconds: float) -> None:
        x = np.array([1.0, passes, drafted, unseen])
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + seconds * x
        self.coef = self._nonnegative_fit()

    def _nonnegative_fit(self) -> np.ndarray:
        """Lawson and Hanson's active-set method on the normal equations: exact, a few small solves at most, and
        usually one: the last fit's terms, checked for optimality, before starting from none."""
        gram = self.gram + self.ridge * np.eye(self.TERMS)
        tolerance = 1e-12 * max(float(np.abs(self.moment).max()), 1e-30)
        free = self.coef > 0
        if free.any():
            coef = np.zeros(self.TERMS)
            coef[free] = np.linalg.solve(gram[np.ix_(free, free)], self.moment[free])
            if coef[free].min() > 0 and (free.all() or (self.moment - gram @ coef)[~free].max() <= tolerance):
                return coef
        coef, free = np.zeros(self.TERMS), np.zeros(self.TERMS, dtype=bool)
        for _ in range(4 * self.TERMS):
            gradient = self.moment - gram @ coef  # minus half the gradient of `x'Gx - 2x'm`
            if free.all() or gradient[~free].max() <= tolerance:
                break
            free[np.argmax(np.where(free, -np.inf, gradient))] = True
            while True:
                trial = np.zeros(self.TERMS)
                trial[free] = np.linalg.solve(gram[np.ix_(free, free)], self.moment[free])
                if trial[free].min() > 0:
                    coef = trial
                    break
                shrinking = free & (trial <= 0)  # step from coef towards trial until a coefficient reaches 0
                step = np.min(coef[shrinking] / np.maximum(coef[shrinking] - trial[shrinking], 1e-300))
                coef = coef + step * (trial - coef)
                free &= coef > 0
                coef[~free] = 0.0
        return coef

    def predict(self, passes: np.ndarray, drafted: np.ndarray, unseen: np.ndarray | int = 0) -> np.ndarray:
        cost = self.coef[0] + self.coef[1] * passes + self.coef[2] * drafted + self.coef[3] * np.asarray(unseen)
        return np.where(drafted > 0, cost, 0.0)


class Acceptance:
    """Per-request probability that a draft token is accepted, given the one before it was: accepted tokens over
    accepted tokens plus rejections, with `prior` pseudo-observations of the drafter's running average."""

    def __init__(self, prior: float = 2.0, decay: float = 0.99, start: float = 0.5):
        self.prior, self.decay = prior, decay
        self.accepted: dict[str, float] = {}
        self.rejected: dict[str, float] = {}
        self.global_accepted, self.global_rejected = start, 1.0 - start
        self.verified = self.rejections = 0  # draft tokens verified so far (to each proposal's first rejection)

    @property
    def measured(self) -> bool:
        """Whether the running average rests on `MEASURED_DRAFTS` verified draft tokens, or `MEASURED_REJECTIONS`
        rejections (a drafter mostly rejected shows it in fewer tokens); before, on `start` mostly."""
        return self.verified >= MEASURED_DRAFTS or self.rejections >= MEASURED_REJECTIONS

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        rejected = 1.0 if accepted < drafted else 0.0
        self.verified += accepted + int(rejected)
        self.rejections += int(rejected)
        self.accepted[request_id] = self.accepted.get(request_id, 0.0) + accepted
        self.rejected[request_id] = self.rejected.get(request_id, 0.0) + rejected
        self.global_accepted = self.decay * self.global_accepted + accepted
        self.global_rejected = self.decay * self.global_rejected + rejected

    def rates(self, request_ids: list[str]) -> np.ndarray:
        mean = self.global_accepted / max(self.global_accepted + self.global_rejected, 1e-9)
        a = np.fromiter((self.accepted.get(r, 0.0) for r in request_ids), dtype=float, count=len(request_ids))
        r = np.fromiter((self.rejected.get(r, 0.0) for r in request_ids), dtype=float, count=len(request_ids))
        return np.minimum((a + self.prior * mean) / (a + r + self.prior), 0.99)

    def remove(self, request_id: str) -> None:
        self.accepted.pop(request_id, None)
        self.rejected.pop(request_id, None)


class Survival:
    """How likely a running request is to still be running `j` tokens on, from the output lengths of the requests that
    ended (counted, forgetting), with one pseudo-request that runs to `max_len`, so that a request longer than every
    one that ended is given no end. A draft past a request's end commits nothing: the planner weighs each draft's gain
    by it, so that in a batch of short answers the drafts of requests about to end count for what they commit."""

    def __init__(self, max_len: int, decay: float = 0.998):
        self.decay = decay
        self.ended_at = np.zeros(max_len + 2)  # per output length, the requests that ended there
        self.ended_at[-1] = 1.0  # the pseudo-request, never forgotten
        self.beyond: np.ndarray | None = None  # per length x, the requests that ended at x or later (until one ends)

    def ended(self, length: int) -> None:
        self.ended_at[:-1] *= self.decay
        self.ended_at[min(max(length, 0), len(self.ended_at) - 2)] += 1.0
        self.beyond = None

    def factors(self, positions: list[int], k: int) -> np.ndarray:
        """Per running request with `p` tokens output (so it ends at `p + 1` or later), the probability that it
        outputs `p + 1 + j` or more, i.e. that the token its `j`-th accepted draft adds is inside it, j = 1..k
        (one row per request)."""
        if self.beyond is None:  # asked several times a step, on a model-length array
            self.beyond = np.cumsum(self.ended_at[::-1])[::-1]
        at = np.minimum(np.asarray(positions, dtype=int)[:, None] + 1 + np.arange(k + 1), len(self.beyond) - 1)
        alive = self.beyond[at]
        return alive[:, 1:] / alive[:, :1]


def geometric(rates: np.ndarray, k: int) -> np.ndarray:
    """Per rate, the gains of `k` draft tokens accepted at that rate each: the j-th is reached and accepted with
    `rate**j` (one row per rate)."""
    return np.power.outer(np.asarray(rates, dtype=float), np.arange(1, k + 1))


def plan(gains: list[list[float]] | np.ndarray, base_tokens: int, step: StepCost, draft: DraftCost | None,
         explore: bool = False, unseen: list[int] | None = None, elsewhere: float = 0.0) -> tuple[list[int], float]:
    """Draft tokens per request maximising expected committed tokens per second, and the predicted step seconds of
    that plan (engine step only). `gains[i][j]`: the expected committed tokens the `j+1`-th draft token of request `i`
    adds (the probability that it and every one before it are accepted; never rising in `j`), so request `i` gets at
    most `len(gains[i])` (a 2-D array: as many for every request). `base_tokens`: tokens the step computes without
    drafts (one per decoding request, plus any prefill). `draft`: the drafting cost model; None when the drafts are
    already made (their cost is paid, only verifying them is left to decide). `unseen`: per request, the history
    tokens the drafter would see for the first time if it drafted (its catch-up, paid with the request's first draft
    token; zeros if not given). `explore`: where no drafting pays, the request most likely to accept drafts gets all
    of its tokens anyway, so that a planner that stopped drafting keeps measuring what drafting gives (acceptance and
    costs drift with the policy and the batch); its caller decides how rarely. `elsewhere`: the tokens the step is
    expected to commit for requests not in `gains` (decoupled: those whose drafts were prepared), which drafting for
    these delays too."""
    n = len(gains)
    if not step.measured:  # nothing measured yet: draft fully, and learn what verifying costs
        return [len(g) for g in gains], 0.0
    if explore and n:
        chosen, engine = plan(gains, base_tokens, step, draft, unseen=unseen, elsewhere=elsewhere)
        if not any(chosen):
            likeliest = int(np.argmax([g[0] if len(g) else 0.0 for g in gains]))
            chosen[likeliest] = len(gains[likeliest])
            engine = float(step.predict(base_tokens + chosen[likeliest]))
        return chosen, engine
    unseen = np.zeros(n) if unseen is None else np.asarray(unseen, dtype=float)
    coef = draft.coef if draft is not None else np.zeros(DraftCost.TERMS)
    if isinstance(gains, np.ndarray):
        lengths, flat = np.full(n, gains.shape[1] if gains.ndim == 2 else 0), gains.astype(float).ravel()
    else:
        lengths = np.array([len(g) for g in gains], dtype=int)
        flat = np.fromiter((x for g in gains for x in g), dtype=float, count=int(lengths.sum()))
    owner = np.repeat(np.arange(n), lengths)  # the request of each draft token, and its place in the request (1..)
    place = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths) + 1
    # the order drafts are taken in: by gain, a request's catch-up weighing on all of its drafts (in units of a plain
    # step), so that its drafts stay in order (stable: gains never rise within a request) and one long-idle request
    # does not end the prefix of everyone else's
    plain = max(float(step.predict(base_tokens)), 1e-9)
    weight = 1 + coef[3] * unseen / plain
    order = np.argsort(-flat / weight[owner], kind="stable")
    owner, place = owner[order], place[order]
    drafted = np.arange(len(order) + 1)
    passes = np.concatenate([[0], np.maximum.accumulate(place)]) if len(order) else np.zeros(1)
    caught_up = np.concatenate([[0.0], np.cumsum(np.where(place == 1, unseen[owner], 0.0))])
    committed = n + elsewhere + np.concatenate([[0.0], np.cumsum(flat[order])])
    engine = step.predict(base_tokens + drafted)
    seconds = engine + (draft.predict(passes, drafted, caught_up) if draft is not None else 0.0)
    best = int(np.argmax(committed / np.maximum(seconds, 1e-9)))
    return np.bincount(owner[:best], minlength=n).tolist(), float(engine[best])
