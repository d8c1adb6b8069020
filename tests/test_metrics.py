"""untie.signals.metrics on hand-built matrices with known answers, and the role-gradient probe on real models."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

import untie
import untie.signals.probe
from untie.signals.metrics import (
    drift_metrics,
    knn_overlap,
    learned_z,
    linear_cka,
    pair_distances,
    pair_evidence_sums,
    pair_pushes,
    role_signals_on_rows,
    sampled_drift_metrics,
    summarize_pair_metrics,
    targets_from_gradient,
)
from untie.signals.probe import RoleGradientProbe
from untie.testing import TINY_MODELS, ToyLMDataset, conditional_gaps, cross_entropy_sums, role_signals, tiny_model


def test_pair_distances_are_euclidean_row_distances():
    matrix = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    assert pair_distances(matrix, [(0, 1), (0, 2), (1, 1)]) == {"0-1": 5.0, "0-2": 1.0, "1-1": 0.0}


def test_opposite_role_gradients_cancel():
    g = torch.tensor([[1.0, 2.0], [0.0, 0.0], [-3.0, 1.0]])
    signals = role_signals(g, -g)
    assert signals["cosine"] == pytest.approx(-1.0)
    assert signals["conflict"] == 1.0
    assert signals["norm_ratio"] == pytest.approx(1.0)
    assert signals["cancellation"] == pytest.approx(1.0)


def test_aligned_role_gradients_agree():
    g = torch.tensor([[1.0, 2.0], [0.0, 0.0], [-3.0, 1.0]])
    signals = role_signals(g, 2 * g)
    assert signals["cosine"] == pytest.approx(1.0)
    assert signals["conflict"] == 0.0
    assert signals["norm_ratio"] == pytest.approx(2.0)
    assert signals["cancellation"] == pytest.approx(-4 / 5)  # -2 * 2|g|^2 / (|g|^2 + 4|g|^2)


def test_cosine_and_conflict_only_count_rows_the_input_role_touched():
    g_in = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    g_out = torch.tensor([[1.0, 0.0], [0.0, -50.0]])  # a large output gradient on an unseen token
    signals = role_signals(g_in, g_out)
    assert signals["cosine"] == pytest.approx(1.0)
    assert signals["conflict"] == 0.0
    assert signals["norm_ratio"] == pytest.approx(math.sqrt(2501))


def test_pair_push_and_tension_by_hand():
    weight = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 3.0]])
    # Descent on the input role moves row 0 towards row 1 (pulls the pair together, push -1), on the output role
    # away from it (push +1): the roles fight over the pair's distance, straight along its axis.
    g_in = torch.tensor([[-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    g_out = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert pair_pushes(weight, g_in, [(0, 1)]).tolist() == [-1.0]
    signals = role_signals(g_in, g_out, weight, pairs=[(0, 1), (0, 2)])
    assert (signals["push_in/0-1"], signals["push_out/0-1"], signals["tension/0-1"]) == (-1.0, 1.0, 1.0)
    # Pair (0, 2) lies along the second axis: both roles move row 0 sideways, nothing changes its distance.
    assert signals["push_in/0-2"] == signals["push_out/0-2"] == signals["tension/0-2"] == 0.0
    # Same direction for both roles: no tension, whatever the scales.
    agree = role_signals(g_in, 100 * g_in, weight, pairs=[(0, 1)])
    assert agree["tension/0-1"] == 0.0
    # Tension is scale-free: a 1000x weaker input role fighting along the axis still gives 1.
    assert role_signals(g_in / 1000, g_out, weight, pairs=[(0, 1)])["tension/0-1"] == pytest.approx(1.0)


def test_agreement_is_the_correlation_of_pair_pushes():
    torch.manual_seed(0)
    weight, g = torch.randn(20, 4), torch.randn(20, 4)
    assert role_signals(g, 3 * g, weight)["agreement"] == pytest.approx(1.0)
    assert role_signals(g, -g, weight)["agreement"] == pytest.approx(-1.0)


def test_non_finite_gradients_give_nan_signals():
    g = torch.tensor([[1.0, float("nan")], [0.0, 1.0]])
    signals = role_signals(g, torch.ones(2, 2))
    assert math.isnan(signals["cosine"]) and math.isnan(signals["cancellation"]) and math.isnan(signals["norm_ratio"])


def test_knn_overlap_known_answers():
    torch.manual_seed(0)
    space = torch.randn(500, 16)
    rotation, _ = torch.linalg.qr(torch.randn(16, 16))
    assert knn_overlap(space, space) == 1.0
    assert knn_overlap(space, 5 * space @ rotation) == pytest.approx(1.0)  # cosine neighbours survive rotation/scale
    assert knn_overlap(space, torch.randn(500, 16)) < 0.1  # unrelated spaces share few neighbours
    with pytest.raises(ValueError, match="one row per token"):
        knn_overlap(space, space[:10])


def test_linear_cka_known_answers_in_both_computation_forms():
    torch.manual_seed(0)
    x = torch.randn(300, 8)
    rotation, _ = torch.linalg.qr(torch.randn(8, 8))
    for rows in (None, 6):  # feature form (300 > 8 rows) and Gram form (6 <= 8 rows)
        assert linear_cka(x, 2 * x @ rotation + 1.0, rows=rows) == pytest.approx(1.0)
    assert linear_cka(x, torch.randn(300, 8)) < 0.15
    # 50 rows <= 64 columns takes the Gram form; it must equal the textbook feature form.
    wide, other = torch.randn(50, 64).double(), torch.randn(50, 64).double()
    xc, yc = wide - wide.mean(0), (wide + other) - (wide + other).mean(0)
    textbook = (xc.T @ yc).square().sum() / ((xc.T @ xc).norm() * (yc.T @ yc).norm())
    assert linear_cka(wide, wide + other, rows=None) == pytest.approx(textbook.item(), rel=1e-9)


def test_drift_metrics_report_overlap_cka_and_pair_distances():
    torch.manual_seed(0)
    emb = torch.randn(100, 8)
    metrics = drift_metrics(emb, emb.clone(), pairs=[(0, 1)])
    assert metrics["knn_overlap"] == 1.0 and metrics["cka"] == pytest.approx(1.0)
    assert metrics["input_distance/0-1"] == metrics["output_distance/0-1"] == pytest.approx((emb[0] - emb[1]).norm())


def test_sampled_drift_metrics_read_only_the_sampled_rows_and_match_drift_metrics():
    torch.manual_seed(0)
    first, second = torch.randn(300, 8), torch.randn(300, 8)
    pairs = [(3, 250), (7, 8)]
    read = []

    def read_rows(ids):
        read.append(ids)
        return first[ids], second[ids]

    # The sample covers the whole vocabulary: the same numbers as on the whole matrices.
    whole = drift_metrics(first, second, pairs=pairs, seed=5, queries=None, pool=None, rows=None)
    sampled = sampled_drift_metrics(read_rows, 300, pairs=pairs, seed=5, queries=None, pool=None, rows=None)
    assert sampled == pytest.approx(whole, rel=1e-6)
    # A sample of 40 rows reads 40 rows plus the pairs' tokens, and still reports the exact pair distances.
    sampled = sampled_drift_metrics(read_rows, 300, pairs=pairs, seed=5, queries=16, pool=40, rows=20)
    assert len(read[-1]) <= 44 and {3, 250, 7, 8} <= set(read[-1].tolist())
    assert sampled["input_distance/3-250"] == pytest.approx((first[3] - first[250]).norm().item())
    assert sampled["output_distance/7-8"] == pytest.approx((second[7] - second[8]).norm().item())
    assert sampled_drift_metrics(lambda ids: (first[ids], first[ids]), 300, seed=1, pool=40)["knn_overlap"] == 1.0


def test_many_pairs_are_logged_as_max_and_mean_and_few_pairs_as_they_are():
    few = {"cosine": 0.5, "gap/0-1": 2.0, "gap/2-3": math.nan, "input_distance/0-1": 1.0}
    assert summarize_pair_metrics(few) == pytest.approx(few, nan_ok=True)
    many = {"cosine": 0.5, **{f"gap/{i}-{i + 100}": float(i) for i in range(10)}, "gap/50-150": math.nan}
    assert summarize_pair_metrics(many, keep=8) == {"cosine": 0.5, "gap/max": 9.0, "gap/mean": 4.5}


def _logits(*rows):
    """Logits whose softmax gives each row's probabilities (zeros become -1e4: probability 0 in float32)."""
    probs = torch.tensor(rows, dtype=torch.float64)
    return torch.where(probs > 0, probs.clamp_min(1e-300).log(), torch.full_like(probs, -1e4)).float()


def test_conditional_gap_is_the_log_probability_ratio_where_the_pair_is_plausible():
    # Two spellings of one word drawn .1/.9: the gap is log 9 nats in every context that predicts the word.
    spelling = _logits([0.1, 0.9, 0.0, 0.0])
    assert conditional_gaps(spelling, [(0, 1)])["0-1"] == pytest.approx(math.log(9), rel=1e-5)
    # Drawn .5/.5 in an equally plausible context: the mean over the two contexts is half of log 9.
    even = _logits([0.5, 0.5, 0.0, 0.0])
    assert conditional_gaps(torch.cat([spelling, even]), [(0, 1)])["0-1"] == pytest.approx(math.log(9) / 2, rel=1e-5)
    # A context where neither symbol is plausible barely counts, however different their tiny probabilities are.
    implausible = _logits([1e-9, 1e-6, 0.5, 0.5 - 1e-6 - 1e-9])
    assert conditional_gaps(torch.cat([spelling, implausible]), [(0, 1)])["0-1"] == pytest.approx(math.log(9), rel=1e-4)
    # `positions` keeps only the contexts that carry a loss; a pair no context makes plausible is NaN.
    both = torch.cat([spelling, even]).reshape(1, 2, 4)
    assert conditional_gaps(both, [(0, 1)], positions=torch.tensor([[False, True]]))["0-1"] == pytest.approx(0.0)
    assert math.isnan(conditional_gaps(_logits([0.0, 0.0, 0.5, 0.5]), [(0, 1)])["0-1"])


# -- the probe -------------------------------------------------------------------------------------------------------


def _batch(n=4):
    ids = ToyLMDataset(8).ids[:n]
    return {"input_ids": ids, "labels": ids.clone()}


PAIRS = [(3, 4), (5, 47)]


def _dense_roles(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The two role gradients of a tied model, densely: the gradients of its untied twin's two matrices."""
    twin = untie.untie_embeddings(copy.deepcopy(model))
    twin(**batch).loss.backward()
    return twin.get_input_embeddings().weight.grad, twin.get_output_embeddings().weight.grad


def _assert_signals_equal(sparse: dict[str, float], dense: dict[str, float], tolerance: float = 1e-6) -> None:
    assert set(sparse) == set(dense)
    for key, value in dense.items():
        assert sparse[key] == pytest.approx(value, rel=tolerance, abs=tolerance, nan_ok=True), key


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_probe_keeps_the_touched_rows_and_its_signals_equal_the_dense_ones(arch):
    """The sparse measurement (G_in on the looked-up rows, G_out as W.grad - G_in, |G_out| from |W.grad|) equals the
    dense role gradients of an untied twin, and so do the signals, to 1e-6."""
    model = tiny_model(arch).eval()  # eval: no dropout, so the untied twin sees the same forward
    batch = _batch()
    dense_in, dense_out = _dense_roles(model, batch)
    probe = RoleGradientProbe(model, pairs=PAIRS)
    probe.armed = True
    model(**batch).loss.backward()
    grads = probe.collect()
    touched = (dense_in.norm(dim=1) > 0) | torch.isin(torch.arange(len(dense_in)), torch.tensor(PAIRS).reshape(-1))
    assert set(touched.nonzero().squeeze(1).tolist()) <= set(grads.rows.tolist())  # + a looked-up padding row
    assert len(grads.rows) < 2 * touched.sum()  # the looked-up rows (encoder and decoder inputs), not the vocabulary
    torch.testing.assert_close(grads.input_grad, dense_in[grads.rows], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads.output_grad, dense_out[grads.rows], rtol=1e-5, atol=1e-7)
    assert grads.output_sq_norm == pytest.approx(dense_out.double().square().sum().item(), rel=1e-6)
    weight = model.get_input_embeddings().weight
    dense = role_signals(dense_in, dense_out, weight=weight, pairs=PAIRS)
    _assert_signals_equal(role_signals_on_rows(grads, pairs=PAIRS), dense)
    assert math.isfinite(dense["cancellation"]) and math.isfinite(dense["tension/3-4"])


def test_probe_memory_scales_with_the_batch_not_the_vocabulary():
    """On a 4,096-token vocabulary, a batch of 10 distinct tokens gives 10 + pair rows: no (V, d) tensor is kept."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=4096, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(100, 110, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    dense_in, dense_out = _dense_roles(model, batch)
    probe = RoleGradientProbe(model, pairs=[(3, 4)])
    probe.armed = True
    model(**batch).loss.backward()
    grads = probe.collect()
    assert grads.rows.tolist() == sorted({*ids.unique().tolist(), 3, 4})
    for tensor in (grads.input_grad, grads.output_grad, grads.weight):
        assert tensor.shape == (len(grads.rows), model.config.n_embd)
    dense = role_signals(dense_in, dense_out, weight=model.get_input_embeddings().weight, pairs=[(3, 4)])
    _assert_signals_equal(role_signals_on_rows(grads, pairs=[(3, 4)]), dense)


def test_probe_accumulates_over_micro_batches_and_stays_idle_when_disarmed():
    model = tiny_model("llama").eval()
    probe = RoleGradientProbe(model)
    model(**_batch(2)).loss.backward()
    assert probe.collect() is None  # disarmed: nothing recorded
    model.zero_grad()
    probe.armed = True
    batch = _batch(4)
    halves = [{k: v[half] for k, v in batch.items()} for half in (slice(0, 2), slice(2, 4))]
    for half in halves:
        (model(**half).loss / 2).backward()
    grads = probe.collect()
    twin = untie.untie_embeddings(copy.deepcopy(model))
    twin.zero_grad()
    for half in halves:
        (twin(**half).loss / 2).backward()
    dense_in, dense_out = twin.get_input_embeddings().weight.grad, twin.get_output_embeddings().weight.grad
    torch.testing.assert_close(grads.input_grad, dense_in[grads.rows], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads.output_grad, dense_out[grads.rows], rtol=1e-5, atol=1e-7)
    assert grads.output_sq_norm == pytest.approx(dense_out.double().square().sum().item(), rel=1e-6)
    probe.remove()
    model(**batch).loss.backward()
    assert probe.collect() is None


def test_probe_takes_a_common_factor_out_of_the_gradient_and_refuses_other_changes(caplog):
    """Clipping or unscaling between backward and the optimizer step multiply W.grad by one factor: the signals are
    unchanged. A change that is not one factor (clamping values) gives NaN role signals, says so, and keeps the gaps."""
    model = tiny_model("gpt2").eval()
    batch = _batch()
    dense_in, dense_out = _dense_roles(model, batch)
    dense = role_signals(dense_in, dense_out, weight=model.get_input_embeddings().weight, pairs=PAIRS)
    probe = RoleGradientProbe(model, pairs=PAIRS)
    probe.armed = True
    model(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)  # scales every gradient by one factor
    grads = probe.collect()
    _assert_signals_equal(role_signals_on_rows(grads, pairs=PAIRS), dense, tolerance=1e-5)
    probe.pair_measurements(grads)
    model.zero_grad()
    probe.armed = True
    model(**batch).loss.backward()
    weight_grad = model.get_input_embeddings().weight.grad
    limit = weight_grad.abs().max() / 4
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=float(limit))
    with caplog.at_level("WARNING", logger="untie"):
        grads = probe.collect()
    signals = role_signals_on_rows(grads, pairs=PAIRS)
    assert math.isnan(signals["cancellation"]) and math.isnan(signals["tension/3-4"])
    assert "more than one common factor" in caplog.text
    assert math.isfinite(probe.pair_measurements(grads)["gap/3-4"])


def test_probe_measures_conditional_gaps_over_the_positions_that_carry_a_loss():
    model = tiny_model("gpt2").eval()
    # (0, 9): a position without a loss has a zero logit gradient, whose argmin reads as target 0: the mask must
    # keep such positions out of the evidence.
    pairs = [(3, 4), (5, 6), (3, 47), (0, 9)]
    probe = RoleGradientProbe(model, pairs=pairs)
    probe.armed = True
    ids = ToyLMDataset(8).ids[:4].clone()
    ids[ids == 47] = 46  # token 47 never occurs as input
    ids[0, 0] = 0  # token 0 does (without a loss)
    labels = ids.clone()
    labels[:, :5] = -100  # no loss on the first positions
    logits = model(input_ids=ids, labels=labels).logits
    logits.sum().mul(0).add(model(input_ids=ids, labels=labels).loss).backward()
    grads = probe.collect()
    gaps = probe.pair_measurements(grads)
    # A causal LM's logits at position t predict token t + 1: the loss positions are those with a label at t + 1.
    carries_loss = torch.zeros(labels.shape, dtype=torch.bool)
    carries_loss[:, :-1] = labels[:, 1:] != -100
    expected = conditional_gaps(logits, pairs[:2], positions=carries_loss)
    assert gaps["gap/3-4"] == pytest.approx(expected["3-4"], rel=1e-6)
    assert gaps["gap/5-6"] == pytest.approx(expected["5-6"], rel=1e-6)
    assert expected["3-4"] != pytest.approx(conditional_gaps(logits, pairs[:1])["3-4"], rel=1e-3)  # the mask matters
    # The evidence and learned_z: the dense functions on the loss positions' logits and their (shifted) targets.
    flat, targets = logits.detach()[:, :-1][carries_loss[:, :-1]], labels[:, 1:][carries_loss[:, :-1]]
    measured = [(3, 4), (5, 6), (0, 9)]
    evidence, counted = pair_evidence_sums(flat, targets, measured)
    assert (counted > 0).all() and (evidence != 0).all()  # every pair occurs as a target: the check bites
    for pair, value in zip(measured, evidence.tolist(), strict=True):
        assert gaps[f"evidence/{pair[0]}-{pair[1]}"] == pytest.approx(value, rel=1e-6, abs=1e-6), pair
    assert gaps["learned_z"] == pytest.approx(learned_z(cross_entropy_sums(flat, targets), vocab=48), rel=1e-6)
    assert math.isnan(gaps["gap/3-47"])  # 47 was never looked up: no evidence about it
    assert math.isnan(probe.pair_measurements(grads)["gap/3-4"])  # reset after reading
    # A later step that looks 47 up measures the pair from then on, also in steps where 47 does not occur.
    for step_ids in (torch.full_like(ids, 47), ids):
        probe.armed = True
        model(input_ids=step_ids, labels=labels).loss.backward()
        last = probe.pair_measurements(probe.collect())
    assert math.isfinite(last["gap/3-47"])


def test_probe_refuses_pairs_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"pairs=\[\(3, 48\)\].*vocabulary of 48"):
        RoleGradientProbe(tiny_model("gpt2"), pairs=[(3, 48)])


def test_probe_refuses_an_untied_model():
    model = tiny_model("gpt2")
    untie.untie_embeddings(model)
    with pytest.raises(ValueError, match="needs a tied model"):
        RoleGradientProbe(model)


# -- evidence against conditional equivalence ----------------------------------------------------------------------


def test_targets_are_read_off_the_cross_entropy_gradient():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    labels = torch.tensor([3, -100, 0, 10, -100, 7])
    torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.1).backward()
    carries = logits.grad.ne(0).any(dim=1)
    assert carries.tolist() == [True, False, True, True, False, True]
    assert targets_from_gradient(logits.grad[carries]).tolist() == [3, 0, 10, 7]


def test_pair_evidence_is_the_log_likelihood_ratio_of_the_models_odds_against_even_odds():
    odds_9_to_1 = _logits([0.45, 0.05, 0.25, 0.25])
    logits = odds_9_to_1.repeat(3, 1)
    evidence, counted = pair_evidence_sums(logits, torch.tensor([0, 1, 2]), [(0, 1), (2, 3)])
    # target 0 (the likelier form): log(2 * .9); target 1: log(2 * .1); target 2 counts for (2, 3) at even odds: 0
    assert evidence[0].item() == pytest.approx(math.log(1.8) + math.log(0.2), rel=1e-6)
    assert evidence[1].item() == pytest.approx(0.0, abs=1e-6)
    assert counted.tolist() == [2.0, 1.0]


def test_pair_evidence_stays_below_log_one_over_alpha_under_conditional_equivalence():
    """Ville's inequality, simulated: a model with arbitrary odds, targets drawn a/b at even odds (the pair is
    conditionally equivalent). The running sum of the evidence reaches log(1/alpha) in at most alpha of the runs."""
    generator = torch.Generator().manual_seed(0)
    runs, positions, alpha = 2000, 200, 0.05
    logits = torch.zeros(runs * positions, 2)
    logits[:, 0] = torch.randn(runs * positions, generator=generator) * 2  # the model's log odds, anything
    targets = torch.randint(0, 2, (runs * positions,), generator=generator)
    is_a = targets == 0
    log_odds = logits[:, 0] - logits[:, 1]
    evidence = math.log(2.0) + torch.nn.functional.logsigmoid(torch.where(is_a, log_odds, -log_odds))
    total, _ = pair_evidence_sums(logits, targets, [(0, 1)])
    assert total.item() == pytest.approx(evidence.double().sum().item(), rel=1e-6)  # the function, position by position
    running = evidence.reshape(runs, positions).double().cumsum(dim=1)
    crossed = int((running.max(dim=1).values >= math.log(1 / alpha)).sum())
    assert crossed / runs <= alpha
    # and the same model facing skewed targets (.9/.1, its odds right on average) crosses in most runs
    skewed = torch.rand(runs * positions, generator=generator) < 0.9
    informed = torch.full((runs * positions, 2), 0.0)
    informed[:, 0] = math.log(9)
    strong = math.log(2.0) + torch.nn.functional.logsigmoid(torch.where(skewed, informed[:, 0], -informed[:, 0]))
    assert (strong.reshape(runs, positions).double().cumsum(dim=1)[:, -1] >= math.log(1 / alpha)).float().mean() > 0.99


def test_learned_z_tells_an_informed_model_from_an_uninformed_one():
    targets = torch.arange(8) % 4
    uninformed = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    informed = torch.nn.functional.one_hot(targets, 4).float() * 6
    assert learned_z(cross_entropy_sums(informed, targets), vocab=4) > 10
    assert learned_z(cross_entropy_sums(uninformed, targets), vocab=4) < 3
    uniform = torch.zeros(8, 4)
    assert learned_z(cross_entropy_sums(uniform, targets), vocab=4) == -math.inf  # exactly log(4): nothing learned
    assert math.isnan(learned_z(cross_entropy_sums(informed[:1], targets[:1]), vocab=4))


def test_probe_reports_evidence_and_learning_with_the_gaps():
    model = tiny_model("gpt2")
    pairs = [(3, 4), (5, 6)]
    probe = RoleGradientProbe(model, pairs=pairs)
    probe.armed = True
    ids = torch.randint(7, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    ids[:, ::2] = 3  # pair symbols as inputs and as targets
    ids[:, 1::4] = 4
    ids[:, 3::4] = 5
    ids[0, -1] = 6
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    measured = probe.pair_measurements(probe.collect())
    assert set(measured) == {"gap/3-4", "gap/5-6", "evidence/3-4", "evidence/5-6", "learned_z"}
    # the causal LM's targets are the next tokens: recompute the evidence from the logits and the shifted labels
    logits = out.logits.detach()[:, :-1].reshape(-1, out.logits.shape[-1])
    evidence, _ = pair_evidence_sums(logits, ids[:, 1:].reshape(-1), pairs)
    assert measured["evidence/3-4"] == pytest.approx(evidence[0].item(), rel=1e-5, abs=1e-6)
    expected_z = learned_z(cross_entropy_sums(logits, ids[:, 1:].reshape(-1)), model.config.vocab_size)
    assert measured["learned_z"] == pytest.approx(expected_z, rel=1e-4)
    probe.remove()


def test_probe_holds_no_logits_until_backward_and_a_kept_logits_head_measures_the_same(monkeypatch):
    """With a linear head the probe keeps (N, 2P + 1) numbers per position until backward, not the (N, V) logits
    (autograd frees them once the loss is computed). Another head keeps the logits; both measure the same."""
    model = tiny_model("gpt2").eval()
    ids = ToyLMDataset(8).ids[:4]
    measured = []
    for keep_logits in (False, True):
        if keep_logits:  # the path of any non-linear head (or one FSDP2 manages)
            monkeypatch.setattr(untie.signals.probe, "FSDPModule", torch.nn.Linear)
        probe = RoleGradientProbe(model, pairs=PAIRS)
        probe.armed = True
        out = model(input_ids=ids, labels=ids)
        (hook,) = out.logits._backward_hooks.values()  # the probe's hook on the logits' gradient: what it holds
        held = [c.cell_contents for c in hook.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
        assert any(t.numel() == out.logits.numel() for t in held) is keep_logits
        out.loss.backward()
        measured.append(probe.pair_measurements(probe.collect()))
        probe.remove()
        model.zero_grad()
    _assert_signals_equal(measured[0], measured[1], tolerance=1e-5)
    assert math.isfinite(measured[0]["learned_z"]) and math.isfinite(measured[0]["gap/3-4"])
