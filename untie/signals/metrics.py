"""Equivalence metrics: plain functions on embedding matrices and role gradients, usable without Trainer.

Three families, matching the three moments of a tie-then-untie run:

* `pair_distances`: the paper's measure, Euclidean distances between given symbol rows (input or output space).
* `role_signals_on_rows`: while tied, what the shared matrix's two roles ask of it. ``input_grad`` is the gradient
  the matrix receives through the embedding lookup, ``output_grad`` the one through the LM head; they sum to the
  tied parameter's gradient. See `role_signals_on_rows` for the exact definitions.

The dense forms of these measurements, which the tests check the row-wise ones against, are in `untie.testing`.
* `pair_gap_sums_from_log_probs`: while tied or not, how differently the model predicts each pair's two symbols (its
  conditional gap), the paper's conditional-equivalence measure; on a pair the user knows to be semantically
  equivalent, a large gap means the distributional hypothesis fails there.
* `knn_overlap` and `linear_cka`: after the untie, how far the input and the output spaces have drifted apart,
  sampled and chunked so that they stay fast at a 256k x 4096 vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from untie.decision.metric_keys import metric_key, pair_key, split_metric_key  # noqa: F401 (re-exported)
from untie.errors import UntieValueError

Pairs = Sequence[tuple[int, int]]


def pair_distances(matrix: torch.Tensor, pairs: Pairs) -> dict[str, float]:
    """Euclidean distance between the rows of each pair (the paper's `cdist` entries)."""
    if not pairs:
        return {}
    rows = torch.as_tensor(pairs, device=matrix.device)
    diff = matrix.detach()[rows[:, 0]].float() - matrix.detach()[rows[:, 1]].float()
    return {pair_key(p): d for p, d in zip(pairs, diff.norm(dim=1).tolist(), strict=True)}


def pair_pushes(weight: torch.Tensor, grad: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    """How fast a gradient-descent step along ``-grad`` changes each pair's distance (positive: pushes it apart).

    For a pair (a, b) with unit direction u = (w_a - w_b) / |w_a - w_b|, the push is -u . (grad_a - grad_b), the
    derivative of |w_a - w_b| along -grad. A pair at distance zero has no direction and gets push 0.
    """
    rows = torch.as_tensor(pairs, device=weight.device)
    diff = weight.detach()[rows[:, 0]].float() - weight.detach()[rows[:, 1]].float()
    norm = diff.norm(dim=1, keepdim=True)
    direction = torch.where(norm > 0, diff / norm.clamp_min(torch.finfo(diff.dtype).tiny), torch.zeros_like(diff))
    grad_diff = grad[rows[:, 0]].float() - grad[rows[:, 1]].float()
    return -(direction * grad_diff).sum(dim=1)


@dataclass
class RoleGradients:
    """A step's two role gradients of a tied (V, d) matrix, kept on the rows that carry information.

    The input role G_in is zero outside the rows the embedding looked up, so it is exact on ``rows``. The output role
    G_out is dense, but every role signal reads it only on those rows, plus its squared norm over the whole matrix,
    which is kept as one number. The memory is O(len(rows) d), whatever the vocabulary.
    """

    rows: torch.Tensor
    """(R,) sorted token ids: every row the input role touched, and the pairs' rows."""
    input_grad: torch.Tensor
    """(R, d) float32: G_in on `rows` (zero on a pair's row that was not looked up)."""
    output_grad: torch.Tensor
    """(R, d) float32: G_out on `rows`."""
    output_sq_norm: float
    """|G_out|^2 over the whole (V, d) matrix."""
    weight: torch.Tensor | None = None
    """(R, d): the shared matrix's rows, for the pair pushes and ``agreement``; None leaves those out."""

    @classmethod
    def from_dense(
        cls, input_grad: torch.Tensor, output_grad: torch.Tensor, weight: torch.Tensor | None = None, pairs: Pairs = ()
    ) -> RoleGradients:
        """Keep the rows of two dense (V, d) role gradients that `role_signals` reads: those the input role touched
        and the pairs' rows."""
        g_in, g_out = input_grad.detach().float(), output_grad.detach().float()
        if g_in.shape != g_out.shape or g_in.dim() != 2:
            raise UntieValueError(
                f"role gradients must be two (V, d) matrices of one shape, got {g_in.shape} and {g_out.shape}"
            )
        keep = torch.linalg.vector_norm(g_in, dim=1) != 0  # a NaN row too: it must reach the signals
        if pairs:
            keep[torch.as_tensor(pairs, device=keep.device).reshape(-1)] = True
        rows = keep.nonzero().squeeze(1)
        return cls(
            rows=rows,
            input_grad=g_in[rows],
            output_grad=g_out[rows],
            output_sq_norm=float(torch.linalg.vector_norm(g_out, dtype=torch.float64).square()),
            weight=None if weight is None else weight.detach()[rows],
        )

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Where each token id sits in `rows` (the tokens must be there)."""
        return torch.searchsorted(self.rows, tokens.to(self.rows.device))

    def looked_up(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whether the input role touched each token's row (its G_in row is nonzero)."""
        tokens = tokens.to(self.rows.device)
        at = self.positions(tokens).clamp_max(max(len(self.rows) - 1, 0))
        if not len(self.rows):
            return torch.zeros_like(tokens, dtype=torch.bool)
        present = self.rows[at] == tokens
        return present & (torch.linalg.vector_norm(self.input_grad[at], dim=1) > 0)


def role_signals_on_rows(grads: RoleGradients, pairs: Pairs = (), sample_rows: int = 256) -> dict[str, float]:
    """Signals of disagreement between the two roles of a tied matrix, from the rows of its role gradients that they
    read (`RoleGradients`), in O(len(rows) d).

    With G_in, G_out the (V, d) role gradients and T the rows the input role touched (tokens seen in the batch):

    * ``cosine``: cosine between G_in and G_out over the rows in T (elsewhere G_in is zero and would only dilute it).
      Near 1 the roles pull the shared rows the same way; near -1 they fight and tying wastes the update.
    * ``conflict``: fraction of rows in T where G_in[i] . G_out[i] < 0 (the PCGrad conflict criterion).
    * ``norm_ratio``: |G_out| / |G_in| over the whole matrix: which role dominates the shared update.
    * ``cancellation``: -2 G_in . G_out / (|G_in|^2 + |G_out|^2), in [-1, 1]: the share of the two roles' update
      that cancels in their sum (1: they cancel exactly; 0: orthogonal; -1: equal and aligned). Untied, one
      gradient step lowers the loss (|G_in|^2 + |G_out|^2) / |G_in + G_out|^2 = 1 / (1 - cancellation) times as
      much as tied, to first order.
    * with ``weight``: ``agreement``, the correlation over all pairs of (up to ``sample_rows``) touched rows between
      the input role's and the output role's pushes on the pair distances (`pair_pushes`): positive when the two
      roles want the same pairs closer and the same pairs farther apart, negative when they disagree about the
      equivalence structure.
    * per pair (a, b), with ``weight`` and ``pairs``: ``push_in/<a-b>`` and ``push_out/<a-b>`` (see `pair_pushes`),
      and ``tension/<a-b>`` = max(0, -c_in * c_out), in [0, 1], where c_r = push_r / |G_r[a] - G_r[b]| is the share
      of role r's relative update of the pair that changes its distance (a cosine, so the two roles' very different
      gradient scales cancel out). 1: one role moves the pair straight together and the other straight apart;
      0: they agree on the pair's distance. A semantically but not conditionally equivalent pair builds tension.

    Every signal reads G_out only on T and the pairs' rows, and its norm, so these rows are all it needs (what
    `untie.signals.probe.RoleGradientProbe` keeps); `untie.testing.role_signals` is the same from the two dense
    (V, d) role gradients, the reference the tests check it against. Non-finite gradients give NaN signals (a trigger
    ignores them).
    """
    g_in, g_out = grads.input_grad.float(), grads.output_grad.float()
    # A row of T is one where the input role is nonzero (a looked-up padding row gets no gradient, as densely).
    row_norms_in = torch.linalg.vector_norm(g_in, dim=1, dtype=torch.float64)
    touched = row_norms_in > 0
    a, b = g_in[touched], g_out[touched]
    row_dots = (a.double() * b.double()).sum(dim=1)
    sq_in = row_norms_in.square().sum()
    sq_out = torch.tensor(grads.output_sq_norm, dtype=torch.float64)
    dot_touched = row_dots.sum()
    norm_a = torch.linalg.vector_norm(a, dtype=torch.float64)
    norm_b = torch.linalg.vector_norm(b, dtype=torch.float64)
    if not (torch.isfinite(sq_in.cpu() + sq_out) and torch.isfinite(g_out).all()):
        nan = math.nan
        signals = {"cosine": nan, "conflict": nan, "norm_ratio": nan, "cancellation": nan, "agreement": nan}
        for pair in pairs:
            signals.update({metric_key(name, pair): nan for name in ("push_in", "push_out", "tension")})
        return signals
    signals = {
        "cosine": _ratio(dot_touched, norm_a * norm_b),
        "conflict": float(row_dots.lt(0).double().mean()) if len(row_dots) else math.nan,
        "norm_ratio": _ratio(sq_out.sqrt(), sq_in.sqrt()),
        # G_in is zero outside T, so the full dot product equals the one over T.
        "cancellation": _ratio(-2 * dot_touched.cpu(), sq_in.cpu() + sq_out),
    }
    if grads.weight is not None:
        rows = touched.nonzero().squeeze(1)
        if len(rows) > sample_rows:  # evenly spaced: deterministic, and spread over the vocabulary
            rows = rows[torch.linspace(0, len(rows) - 1, sample_rows).long().to(rows.device)]
        w = grads.weight[rows].float()
        signals["agreement"] = _correlation(_push_matrix(w, g_in[rows]), _push_matrix(w, g_out[rows]))
    if pairs:
        if grads.weight is None:
            raise UntieValueError("role_signals: pass the shared `weight` to get per-pair pushes and tension.")
        local = grads.positions(torch.as_tensor(pairs).reshape(-1)).reshape(-1, 2).tolist()
        push_in = pair_pushes(grads.weight, g_in, local)
        push_out = pair_pushes(grads.weight, g_out, local)
        index = torch.as_tensor(local, device=g_in.device)
        share_in = push_in / (g_in[index[:, 0]] - g_in[index[:, 1]]).norm(dim=1)
        share_out = push_out / (g_out[index[:, 0]] - g_out[index[:, 1]]).norm(dim=1)
        tension = (-share_in * share_out).nan_to_num(0.0).clamp_min(0)
        values = zip(push_in.tolist(), push_out.tolist(), tension.tolist(), strict=True)  # one copy each
        for pair, (push_in_value, push_out_value, tension_value) in zip(pairs, values, strict=True):
            signals[metric_key("push_in", pair)] = push_in_value
            signals[metric_key("push_out", pair)] = push_out_value
            signals[metric_key("tension", pair)] = tension_value
    return signals


def pair_gap_sums_from_log_probs(
    log_a: torch.Tensor, log_b: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator, as (P,) float64 tensors to sum over batches and ranks, of each pair's conditional
    gap, from the (N, P) log-probabilities of its two symbols; ``mask``, (N,) bool, keeps the rows that carry a loss.

    The conditional gap of a pair (a, b) is how differently the model predicts a and b, in nats:
    gap(a, b) = sum_r w_r |log p(a|r) - log p(b|r)| / sum_r w_r over the contexts r, with w_r = p(a|r) + p(b|r).
    Zero when the model predicts both symbols alike in every context that matters to them (conditionally equivalent,
    so the paper's output theorem wants their output rows equal); log(9) = 2.2 for two spellings of one word drawn
    .1/.9. Weighting by p(a|r) + p(b|r) keeps contexts where neither symbol is plausible from drowning the measure.
    `untie.testing.conditional_gaps` computes it from dense logits (the tests' reference)."""
    weight = (log_a.exp() + log_b.exp()).double()
    if mask is not None:
        weight = weight * mask.double().unsqueeze(1)
    return (weight * (log_a - log_b).abs().double()).sum(dim=0), weight.sum(dim=0)


def targets_from_gradient(logits_grad: torch.Tensor) -> torch.Tensor:
    """The target token of each position from the gradient of a cross-entropy loss with respect to its logits.

    For cross-entropy, dL/dlogit_j = s (p_j - [j = target]) with s > 0 the position's loss weight, so the target is
    the only entry below zero and the row's smallest. Read off the gradient, the targets need no access to the batch
    or to the loss code (a custom loss, a shifted causal-LM loss, DDP). With label smoothing the smallest entry is
    still the target while the model gives it less than 1 - smoothing.
    """
    return logits_grad.argmin(dim=-1)


def pair_evidence_sums(logits: torch.Tensor, targets: torch.Tensor, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Evidence against each pair's conditional equivalence, from positions whose target is one of its two symbols.

    Conditional equivalence of (a, b) (the paper's definition: p(a | r) = p(b | r) in every context r) says that
    where the target is a or b, it is a or b with even odds, whatever the context. The model's prediction gives odds
    q_r = p(a | r) / (p(a | r) + p(b | r)) instead. The log likelihood ratio of the observed targets under the model's
    odds against even odds, sum of log(q_r(target) / (1/2)), is the evidence, in nats, that the data distinguish a
    from b the way the model does. Made before the targets are trained on, each position's factor has expectation 1
    under conditional equivalence, so the running product is a test martingale: it exceeds 1/alpha with
    probability at most alpha, ever (Ville's inequality). An untrained model's odds carry no information, and its
    evidence drifts down. Returns the (P,) float64 evidence sums and the (P,) counts of such positions.
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])
    index = torch.as_tensor(pairs, device=flat.device).reshape(-1, 2)
    log_odds = flat[:, index[:, 0]].float() - flat[:, index[:, 1]].float()  # log p(a|r) - log p(b|r)
    return pair_evidence_sums_from_log_odds(log_odds, targets.reshape(-1), index)


def pair_evidence_sums_from_log_odds(
    log_odds: torch.Tensor, targets: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pair_evidence_sums` from the (N, P) log-odds log p(a|r) - log p(b|r) of each pair (a, b), the (N,) targets
    and the (P, 2) pair ids; ``mask``, (N,) bool, keeps the rows that carry a loss."""
    is_a = targets.unsqueeze(1) == index[:, 0]
    is_b = targets.unsqueeze(1) == index[:, 1]
    signed = torch.where(is_a, log_odds, -log_odds)
    evidence = math.log(2.0) + torch.nn.functional.logsigmoid(signed)
    counted = is_a | is_b
    if mask is not None:
        counted = counted & mask.unsqueeze(1)
    return torch.where(counted, evidence, 0).double().sum(dim=0), counted.double().sum(dim=0)


def cross_entropy_sums_from_target_logits(
    log_norm: torch.Tensor, target_logit: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The sum of the positions' cross-entropies, the sum of their squares and their count, (3,) float64, from each
    row's log-normaliser (N,) and its target's logit (N,): the (V,) rows are not
    needed; ``mask``, (N,) bool, keeps the rows that carry a loss."""
    losses = (log_norm - target_logit).double()
    if mask is None:
        count = torch.tensor(float(len(losses)), dtype=torch.float64, device=losses.device)
    else:
        losses = losses * mask.double()
        count = mask.double().sum()
    return torch.stack([losses.sum(), losses.square().sum(), count])


def learned_z(loss_sums: torch.Tensor, vocab: int) -> float:
    """How many standard errors the mean cross-entropy lies below log(vocab) (from `cross_entropy_sums`).

    Any prediction that carries no information about the targets has an expected cross-entropy of at least
    log(vocab) (uniform odds reach it; random logits exceed it), so a large positive value is evidence that the model
    has learned something; an untrained model sits near zero or below. NaN with fewer than two positions.
    """
    total, squares, count = (float(x) for x in loss_sums)
    if count < 2:
        return math.nan
    mean = total / count
    variance = max(squares / count - mean * mean, 0.0) * count / (count - 1)
    standard_error = math.sqrt(variance / count)
    if standard_error == 0:
        return math.inf if mean < math.log(vocab) else -math.inf
    return (math.log(vocab) - mean) / standard_error


def _push_matrix(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`pair_pushes` for every pair of rows at once, as an (n, n) matrix, in O(n^2 d) without (n, n, d) temporaries."""
    wg = weight @ grad.T
    dot = wg.diagonal().unsqueeze(1) + wg.diagonal().unsqueeze(0) - wg - wg.T  # (w_i - w_j) . (g_i - g_j)
    sq = weight.square().sum(dim=1)
    dist = (sq.unsqueeze(1) + sq.unsqueeze(0) - 2 * weight @ weight.T).clamp_min(0).sqrt()
    return torch.where(dist > 0, -dot / dist.clamp_min(torch.finfo(dist.dtype).tiny), torch.zeros_like(dist))


def _correlation(first: torch.Tensor, second: torch.Tensor) -> float:
    """Pearson correlation of the strict upper triangles of two square matrices."""
    upper = torch.triu_indices(len(first), len(first), offset=1, device=first.device)
    x = first[upper[0], upper[1]].double()
    y = second[upper[0], upper[1]].double()
    x, y = x - x.mean(), y - y.mean()
    return _ratio((x * y).sum(), x.norm() * y.norm()) if len(x) > 1 else math.nan


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> float:
    num, den = float(numerator), float(denominator)
    if not (math.isfinite(num) and math.isfinite(den)) or den == 0:
        return math.nan
    return num / den


# ---------------------------------------------------------------------------------------------------------------
# Drift between untied spaces
# ---------------------------------------------------------------------------------------------------------------


def _sample_rows(vocab: int, size: int | None, generator: torch.Generator, device) -> torch.Tensor:
    if size is None or size >= vocab:
        return torch.arange(vocab, device=device)
    return torch.randperm(vocab, generator=generator)[:size].sort().values.to(device)


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _neighbours(space: torch.Tensor, queries: torch.Tensor, pool: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """Indices into ``pool`` of each query's k nearest rows by cosine, excluding the query itself."""
    candidates = torch.nn.functional.normalize(space[pool].float(), dim=1)
    position = torch.full((space.shape[0],), -1, dtype=torch.long, device=space.device)
    position[pool] = torch.arange(len(pool), device=space.device)
    out = []
    for start in range(0, len(queries), chunk):
        rows = queries[start : start + chunk]
        sims = torch.nn.functional.normalize(space[rows].float(), dim=1) @ candidates.T
        own = position[rows]
        sims[own >= 0, own[own >= 0]] = -math.inf  # a token is not its own neighbour
        out.append(sims.topk(k, dim=1).indices)
    return torch.cat(out)


def knn_overlap(
    first: torch.Tensor,
    second: torch.Tensor,
    k: int = 10,
    queries: int | None = 1024,
    pool: int | None = 16384,
    seed: int = 0,
    chunk: int = 256,
) -> float:
    """Mean Jaccard overlap of each sampled token's k nearest neighbours (cosine) in two spaces over one vocabulary.

    1 when both spaces give every token the same neighbours, `knn_overlap_chance(k, pool)` (about k / (2 pool))
    for unrelated spaces. ``queries``
    tokens are sampled, and their neighbours searched among ``pool`` sampled tokens (None: all), in chunks of
    ``chunk`` queries, so the cost is 2 * queries * pool * d multiply-adds per space.
    """
    if first.shape[0] != second.shape[0]:
        raise UntieValueError(
            f"knn_overlap: both spaces need one row per token, got {first.shape[0]} and {second.shape[0]}"
        )
    vocab = first.shape[0]
    generator = _generator(seed)
    pool_rows = _sample_rows(vocab, pool, generator, first.device)
    if k >= len(pool_rows):
        raise UntieValueError(f"knn_overlap: k={k} needs a pool of more than k tokens, got {len(pool_rows)}")
    query_rows = pool_rows[_sample_rows(len(pool_rows), queries, generator, first.device)]
    with torch.no_grad():
        a = _neighbours(first.detach(), query_rows, pool_rows, k, chunk)
        b = _neighbours(second.detach().to(first.device), query_rows, pool_rows, k, chunk)
    shared = (a.unsqueeze(2) == b.unsqueeze(1)).any(dim=2).sum(dim=1).float()
    return float((shared / (2 * k - shared)).mean())


def knn_overlap_chance(k: int, pool: int) -> float:
    """Expected `knn_overlap` of two unrelated spaces: the mean Jaccard of two random k-subsets of pool - 1 tokens."""
    n = pool - 1
    if not 0 < k <= n:
        raise UntieValueError(f"knn_overlap_chance: need 0 < k < pool, got k={k}, pool={pool}")
    total = math.comb(n, k)
    return sum(math.comb(k, s) * math.comb(n - k, k - s) / total * s / (2 * k - s) for s in range(k + 1))


def linear_cka(first: torch.Tensor, second: torch.Tensor, rows: int | None = 4096, seed: int = 0) -> float:
    """Linear CKA (Kornblith et al., 2019) between two (V, d) spaces over ``rows`` sampled tokens (None: all).

    1 when one space is an orthogonal transform and rescaling of the other. Computed in the Gram form
    (rows x rows) or the feature form (d x d), whichever is cheaper. CKA is inflated by width: compare it
    against the same measure on shuffled rows when the absolute value matters.
    """
    if first.shape[0] != second.shape[0]:
        raise UntieValueError(
            f"linear_cka: both spaces need one row per token, got {first.shape[0]} and {second.shape[0]}"
        )
    sample = _sample_rows(first.shape[0], rows, _generator(seed), first.device)
    with torch.no_grad():
        x = first.detach()[sample].double()
        y = second.detach().to(first.device)[sample].double()
        x = x - x.mean(dim=0)
        y = y - y.mean(dim=0)
        if len(sample) <= max(x.shape[1], y.shape[1]):
            kx, ky = x @ x.T, y @ y.T
            cross, self_x, self_y = (kx * ky).sum(), kx.norm(), ky.norm()
        else:
            cross = (x.T @ y).square().sum()
            self_x, self_y = (x.T @ x).norm(), (y.T @ y).norm()
    return _ratio(cross, self_x * self_y)


def drift_metrics(
    input_weight: torch.Tensor,
    output_weight: torch.Tensor,
    pairs: Pairs = (),
    seed: int = 0,
    queries: int | None = 1024,
    pool: int | None = 16384,
    rows: int | None = 4096,
) -> dict[str, float]:
    """Drift between the untied input and output spaces: neighbour overlap, linear CKA and pair distances."""
    metrics = {
        "knn_overlap": knn_overlap(
            input_weight, output_weight, k=min(10, input_weight.shape[0] // 2), queries=queries, pool=pool, seed=seed
        ),
        "cka": linear_cka(input_weight, output_weight, rows=rows, seed=seed),
    }
    metrics.update(_distances_in_both_spaces(input_weight, output_weight, pairs, names=[pair_key(p) for p in pairs]))
    return metrics


def _distances_in_both_spaces(
    input_weight: torch.Tensor, output_weight: torch.Tensor, pairs: Pairs, names: Sequence[str]
) -> dict[str, float]:
    """``input_distance/<name>`` and ``output_distance/<name>`` of each pair, under the name given for it."""
    metrics = {}
    for space, weight in (("input", input_weight), ("output", output_weight)):
        distances = pair_distances(weight, pairs)
        metrics.update({f"{space}_distance/{n}": distances[pair_key(p)] for p, n in zip(pairs, names, strict=True)})
    return metrics


def sampled_drift_metrics(
    read_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    vocab: int,
    pairs: Pairs = (),
    seed: int = 0,
    queries: int | None = 1024,
    pool: int | None = 16384,
    rows: int | None = 4096,
) -> dict[str, float]:
    """`drift_metrics` when the matrices are read a few rows at a time (sharded or too large to hold whole).

    Samples ``pool`` token ids (plus the pairs' tokens), reads those rows of the input and the output matrix through
    ``read_rows(ids) -> (input_rows, output_rows)``, and measures on them: neighbours are searched among the
    sampled tokens and CKA uses ``rows`` of them, the same sampling as `drift_metrics`.
    """
    ids = _sample_rows(vocab, pool, _generator(seed), "cpu")
    paired = torch.tensor([token for pair in pairs for token in pair], dtype=torch.long)
    ids = torch.unique(torch.cat([ids, paired]))  # sorted
    input_rows, output_rows = read_rows(ids)
    position = {int(token): i for i, token in enumerate(ids)}
    local_pairs = [(position[a], position[b]) for a, b in pairs]
    metrics = drift_metrics(input_rows, output_rows, seed=seed, queries=queries, pool=None, rows=rows)
    # The pairs' rows sit at other positions in the sample; report them under the pairs' own names.
    metrics.update(_distances_in_both_spaces(input_rows, output_rows, local_pairs, names=[pair_key(p) for p in pairs]))
    return metrics


def summarize_pair_metrics(metrics: dict[str, float], keep: int = 8) -> dict[str, float]:
    """`metrics` with per-pair entries ("name/a-b") replaced by their max and mean over the finite pair values
    ("name/max", "name/mean") when there are more than `keep` pairs, so that logs stay readable with many pairs."""
    per_pair: dict[str, list[float]] = {}
    for key, value in metrics.items():
        name, pair = split_metric_key(key)
        if pair:
            per_pair.setdefault(name, []).append(value)
    if not per_pair or max(len(values) for values in per_pair.values()) <= keep:
        return dict(metrics)
    summary = {key: value for key, value in metrics.items() if split_metric_key(key)[0] not in per_pair}
    for name, values in per_pair.items():
        finite = [v for v in values if math.isfinite(v)]
        summary[f"{name}/max"] = max(finite) if finite else math.nan
        summary[f"{name}/mean"] = sum(finite) / len(finite) if finite else math.nan
    return summary
