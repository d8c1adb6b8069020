"""EXor's claims: the paper's findings checked on a grid's run records (which hold, on which seeds, with what
evidence), and how the untie's optimizer state recovers the loss."""

from __future__ import annotations

import statistics

from untie_recipes.tasks.exor.data import VARIANTS, vocabulary
from untie_recipes.tasks.exor.setup import ARMS

#: A pair is close when its distance is below this fraction of the reference pair (0,2)'s, apart otherwise.
SEPARATION = 0.3
#: Loss and accuracy claims compare seed means of runs that each either learn parity or sit on the chance plateau for
#: a long time: on the paper preset one arm's final losses spread by 0.25-0.28 (standard deviation) over seeds, more
#: than the effects claimed. So they are checked on at least this many seeds shared by their arms, and reported as not
#: tested below that. The geometry claims are checked on any number: in runs that learn they hold seed by seed.
MIN_SEEDS_FOR_OUTCOMES = 3


#: Why the quick preset does not check the Mixer's tied claim (issue 69): its absolute form fails on the Mixer under
#: every schedule tried, and its relative form, pre-registered before seeds 43-45 ran, failed on seed 45.
QUICK_MIXER_TIED = (
    "not checked at the quick preset: the Mixer's shared (0,1) is not held apart there (0.13-0.28 of d(0,2) under five "
    "schedules; the relative form, pre-registered, failed on seed 45: below the untied arm's input (0,1)); it holds on "
    'the paper preset\'s Transformer. docs/recipes/exor.md, "The tied claim restated, and judged on fresh seeds"'
)


def chance_accuracy(variant: str) -> float:
    """The masked-bit accuracy of a model that ignores the parity (the chance plateau): it always names the likeliest
    surface form over both bits, each bit being as frequent as the other."""
    vocab = vocabulary(variant)
    return max(0.5 * w for w in (*vocab.zero_weights, *vocab.one_weights))


def learned(record: dict) -> bool:
    """Whether a run learned the task: its final masked-bit accuracy on the training strings is at least halfway from
    the chance plateau (`chance_accuracy`) to the Bayes ceiling. A run still at chance has learned nothing that tells
    the bits apart, so its tables answer none of the paper's geometry claims, whatever their distances."""
    chance, ceiling = chance_accuracy(record["variant"]), vocabulary(record["variant"]).bayes_accuracy()
    return record["train_accuracy"] >= (chance + ceiling) / 2


def learned_text(records: list[dict]) -> str:
    """ "N of M seeds learned the task" with the runs' accuracies, for a geometry claim's evidence."""
    variant = records[0]["variant"]
    chance, ceiling = chance_accuracy(variant), vocabulary(variant).bayes_accuracy()
    accuracies = ", ".join(f"{r['seed']}: {r['train_accuracy']:.3f}" for r in sorted(records, key=lambda r: r["seed"]))
    return (
        f"{records[0]['arm']}: {sum(map(learned, records))} of {len(records)} seeds learned the task (train accuracy "
        f"{accuracies}; chance {chance:.3f}, ceiling {ceiling:.3f}, learned from {(chance + ceiling) / 2:.3f})"
    )


def geometry_runs(*groups: list[dict]) -> tuple[list[list[dict]], str]:
    """The groups restricted to the seeds on which every group's run learned the task (`learned`), and the evidence
    that says how many did. Geometry claims are judged on those seeds only."""
    shared = on_common_seeds(*groups)
    seeds = {r["seed"] for r in shared[0]}
    for runs in shared:
        seeds &= {r["seed"] for r in runs if learned(r)}
    kept = [[r for r in runs if r["seed"] in seeds] for runs in shared]
    return kept, "; ".join(learned_text(runs) for runs in shared)


def no_learned_seed(evidence: str) -> str:
    return f"not tested: no seed learned the task, and a run at chance answers no geometry claim ({evidence})"


def mean_spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def group(records: list[dict], **match) -> list[dict]:
    return [r for r in records if all(r[k] == v for k, v in match.items())]


def on_common_seeds(*groups: list[dict]) -> list[list[dict]]:
    """Each group of runs restricted to the seeds that every group has: arms are compared on the same seeds only, so
    a grid that is still running (one arm ahead of another) never compares means over different seeds."""
    seeds = set.intersection(*({r["seed"] for r in rs} for rs in groups))
    return [[r for r in rs if r["seed"] in seeds] for rs in groups]


def seed_mean(records: list[dict], key: str) -> float:
    """Mean of a record field (final_loss, train_accuracy, ...) over the runs' seeds."""
    return statistics.fmean(r[key] for r in records)


def seeds_text(records: list[dict]) -> str:
    return "seeds " + ", ".join(str(seed) for seed in sorted({r["seed"] for r in records}))


def relative(geometry: dict, space: str, pair: str) -> float:
    """A pair's distance over the reference pair (0,2) of different bits: weight decay shrinks all rows alike."""
    return geometry[space][pair] / max(geometry[space]["0-2"], 1e-12)


def mean_relative(records: list[dict], space: str, pair: str) -> float:
    """Seed mean of `relative` at the end of training."""
    return statistics.fmean(relative(r["history"]["geometry"][-1], space, pair) for r in records)


def claim_record(text: str, holds: bool | None, evidence: str, outcome_seeds: int | None = None) -> dict:
    """One claim's verdict. outcome_seeds: how many seeds a loss / accuracy claim compares (None for a geometry or
    trigger claim); below MIN_SEEDS_FOR_OUTCOMES the claim is reported with its numbers but not tested, and `leans`
    says which way those numbers (`numbers`) go, untested (True: the claim's way)."""
    leans, numbers = None, evidence
    if outcome_seeds is not None and outcome_seeds < MIN_SEEDS_FOR_OUTCOMES:
        leans = None if holds is None else bool(holds)
        holds = None
        evidence = (
            f"not tested on {outcome_seeds} seed(s): a loss / accuracy claim needs >= {MIN_SEEDS_FOR_OUTCOMES} (each "
            f"run either learns parity or sits at chance; add --seeds 42 43 44 45 46); {evidence}"
        )
    record = {"claim": text, "holds": None if holds is None else bool(holds), "evidence": evidence}
    return record if leans is None else {**record, "leans": leans, "numbers": numbers}


def check_claims(records: list[dict]) -> list[dict]:
    """The paper's claims (issue acceptance 1-4), checked on seed means for every model, each on the seeds that all of
    its arms have. A pair is *close* when its distance is below SEPARATION times the reference pair's, *apart*
    otherwise. Claims whose arms or variants were not run, and loss / accuracy claims on fewer than
    MIN_SEEDS_FOR_OUTCOMES seeds, are listed with holds=None and the reason in their evidence."""
    claims = []

    def claim(text: str, holds: bool | None, evidence: str, outcome_seeds: int | None = None) -> None:
        claims.append(claim_record(text, holds, evidence, outcome_seeds))

    for model in sorted({r["model"] for r in records}):
        arms = {
            (variant, arm): group(records, variant=variant, model=model, arm=arm)
            for variant in VARIANTS
            for arm in ARMS
        }
        untied, tied = arms["main", "untied"], arms["main", "tied"]
        _geometry_claims(model, untied, tied, claim)

        text = f"[{model}] tied (main): final loss above the untied arm's"
        tied_, untied_ = on_common_seeds(tied, untied)
        if tied_:
            loss_tied, loss_untied = seed_mean(tied_, "final_loss"), seed_mean(untied_, "final_loss")
            evidence = f"loss tied {loss_tied:.4f} vs untied {loss_untied:.4f} ({seeds_text(tied_)})"
            claim(text, loss_tied > loss_untied, evidence, outcome_seeds=len(tied_))
        else:
            claim(text, None, "not run: needs the tied and untied arms on main")

        text = f"[{model}] NDH: the untied arm learns the task far better than the tied arm (>= 0.1 accuracy)"
        ndh_untied, ndh_tied = on_common_seeds(arms["ndh", "untied"], arms["ndh", "tied"])
        if ndh_untied:
            acc_u, acc_t = seed_mean(ndh_untied, "train_accuracy"), seed_mean(ndh_tied, "train_accuracy")
            ceiling = vocabulary("ndh").bayes_accuracy()
            claim(
                text,
                acc_u - acc_t >= 0.1,
                f"train accuracy untied {acc_u:.3f} vs tied {acc_t:.3f} "
                f"(ceiling {ceiling:.2f}; {seeds_text(ndh_tied)})",
                outcome_seeds=len(ndh_tied),
            )
        else:
            claim(text, None, "not run: needs the tied and untied arms on ndh (--variants ndh)")

        for arm in ("scheduled", "scheduled-reset"):
            scheduled, untied_, tied_ = on_common_seeds(arms["main", arm], untied, tied)
            if not scheduled:
                continue
            step = scheduled[0]["untie_step"]
            (learned_scheduled, learned_tied), learning = geometry_runs(scheduled, tied_)
            if learned_scheduled:
                text, holds, evidence = scheduled_geometry_claim(model, arm, step, learned_scheduled, learned_tied)
                claim(text, holds, f"{evidence}; {learning}")
            else:
                claim(scheduled_geometry_claim(model, arm, step, scheduled, tied_)[0], None, no_learned_seed(learning))
            gap_before = loss_gap_at(scheduled, untied_, step)
            gap_end = seed_mean(scheduled, "final_loss") - seed_mean(untied_, "final_loss")
            claim(
                f"[{model}] {arm} (main): the loss gap to the untied arm shrinks after the untie",
                gap_end < gap_before,
                f"loss gap to untied: {gap_before:+.4f} at the untie -> {gap_end:+.4f} at the end "
                f"({seeds_text(scheduled)})",
                outcome_seeds=len(scheduled),
            )
        claims_for_auto(model, arms, claim)
    return claims


def _geometry_claims(model: str, untied: list[dict], tied: list[dict], claim) -> None:
    """Claims 1 and 2: the untied and the tied arm's geometry on main, each on the seeds that learned the task."""
    text = f"[{model}] untied (main): input (0,1) and (2,3) close; output (2,3) close, output (0,1) apart"
    if untied:
        (learned_untied,), learning = geometry_runs(untied)
        if learned_untied:
            d = {(s, p): mean_relative(learned_untied, s, p) for s in ("input", "output") for p in ("0-1", "2-3")}
            holds = max(d["input", "0-1"], d["input", "2-3"], d["output", "2-3"]) < SEPARATION <= d["output", "0-1"]
            evidence = ", ".join(f"{s} {p} {v:.3f}" for (s, p), v in d.items())
            claim(text, holds, f"d/d(0,2): {evidence} ({seeds_text(learned_untied)}; {learning})")
        else:
            claim(text, None, no_learned_seed(learning))
    else:
        claim(text, None, "not run: needs the untied arm on main")

    text = f"[{model}] tied (main): (2,3) close, (0,1) apart"
    if tied and model == "mixer" and all(r.get("settings", {}).get("preset") == "quick" for r in tied):
        claim(text, None, QUICK_MIXER_TIED)
    elif tied:
        (learned_tied,), learning = geometry_runs(tied)
        if learned_tied:
            t01, t23 = mean_relative(learned_tied, "input", "0-1"), mean_relative(learned_tied, "input", "2-3")
            evidence = f"d/d(0,2): 0-1 {t01:.3f}, 2-3 {t23:.3f} ({seeds_text(learned_tied)}; {learning})"
            claim(text, t23 < SEPARATION <= t01, evidence)
        else:
            claim(text, None, no_learned_seed(learning))
    else:
        claim(text, None, "not run: needs the tied arm on main")


def scheduled_geometry_claim(
    model: str, arm: str, step: int, scheduled: list[dict], tied: list[dict]
) -> tuple[str, bool, str]:
    """Claim 4's geometry: after the untie the scheduled arm ends in the untied pattern of claim 1 for the pair the
    task breaks (input (0,1) close, output (0,1) apart), its input (0,1) closer than the tied arm's. The tied arm is
    the counterfactual: the same run without the untie (identical up to the untie step). Its shared (0,1) is apart
    already (claim 2), so the output pair has to stay apart, not to end farther apart than there."""
    out_sched, out_tied = mean_relative(scheduled, "output", "0-1"), mean_relative(tied, "output", "0-1")
    in_sched, in_tied = mean_relative(scheduled, "input", "0-1"), mean_relative(tied, "input", "0-1")
    return (
        f"[{model}] {arm} (main): after the untie at step {step} the geometry moves to the untied pattern: input "
        "(0,1) close and closer than in the tied arm, output (0,1) apart",
        in_sched < min(in_tied, SEPARATION) and out_sched >= SEPARATION,
        f"d/d(0,2) {arm} vs tied at the end: input 0-1 {in_sched:.3f} vs {in_tied:.3f}, output 0-1 {out_sched:.3f} vs "
        f"{out_tied:.3f} (close below {SEPARATION}; {seeds_text(scheduled)})",
    )


def claims_for_auto(model: str, arms: dict, claim) -> None:
    """The divergence trigger's claims (metrics issue): where it fires, and what the auto arm's loss ends at."""
    auto = {variant: arms[variant, "auto"] for variant in VARIANTS}
    text = f"[{model}] auto: the trigger fires in main and ndh, and never in ydh"
    if all(auto.values()):
        fired = {v: [r["trigger_step"] for r in rs] for v, rs in auto.items()}
        broken = [step for v in ("main", "ndh") for step in fired[v]]
        holds = None not in broken and all(step is None for step in fired["ydh"])
        evidence = "; ".join(f"{v}: " + ", ".join(f"{x:,}" if x else "never" for x in fired[v]) for v in fired)
        claim(text, holds, f"trigger steps per seed: {evidence}")
    else:
        claim(text, None, "not run: needs the auto arm on main, ydh and ndh")

    for variant in ("main", "ndh"):
        needed = on_common_seeds(*(arms[variant, arm] for arm in ("auto", "scheduled", "untied", "tied")))
        if not needed[0]:
            continue
        a, sched, u, t = (seed_mean(rs, "final_loss") for rs in needed)
        # Close: the auto arm keeps at most a quarter of what tying costs (tied - untied), or 0.02 nats if tying
        # costs nothing.
        close = a - u <= (0.25 * (t - u) if t > u else 0.02)
        claim(
            f"[{model}] auto ({variant}): final loss at most the scheduled arm's, and close to the untied arm's",
            a <= sched and close,
            f"final loss: auto {a:.4f}, scheduled {sched:.4f}, untied {u:.4f}, tied {t:.4f} (gaps to untied: auto "
            f"{a - u:+.4f}, scheduled {sched - u:+.4f}, tied {t - u:+.4f}; {seeds_text(needed[0])})",
            outcome_seeds=len(needed[0]),
        )
    rescued = on_common_seeds(*(arms["ndh", arm] for arm in ("auto", "untied", "tied")))
    if rescued[0]:
        acc_a, acc_u, acc_t = (seed_mean(rs, "train_accuracy") for rs in rescued)
        claim(
            f"[{model}] auto (ndh): learns the task as well as the untied arm (train accuracy within 0.05) and no "
            "worse than the tied arm",
            acc_a >= acc_u - 0.05 and acc_a >= acc_t,
            f"train accuracy: auto {acc_a:.3f}, untied {acc_u:.3f}, tied {acc_t:.3f} ({seeds_text(rescued[0])})",
            outcome_seeds=len(rescued[0]),
        )


def loss_gap_at(arm_records: list[dict], untied: list[dict], step: int) -> float:
    """Mean training-distribution eval loss of an arm minus the untied arm's, at the last eval at or before step."""

    def loss(record: dict) -> float:
        return [e for e in record["history"]["eval"] if e["step"] <= step][-1]["train_loss"]

    return statistics.fmean(loss(r) for r in arm_records) - statistics.fmean(loss(r) for r in untied)


def post_untie_loss(record: dict) -> float:
    """Mean training-distribution eval loss over the evaluations after the untie: how well the run recovers, less
    at the mercy of one noisy final point (losses spike at the peaks of the periodic schedule)."""
    after = [e["train_loss"] for e in record["history"]["eval"] if e["step"] > record["untie_step"]]
    return statistics.fmean(after) if after else float("nan")


def recovery_comparison(records: list[dict]) -> list[dict]:
    """Copied vs reset optimizer state on the scheduled arm, per variant and model, on the seeds both have: the better
    one has the lower mean loss after the untie."""
    rows = []
    for variant in sorted({r["variant"] for r in records}):
        for model in sorted({r["model"] for r in records}):
            copy, reset = on_common_seeds(
                group(records, variant=variant, model=model, arm="scheduled"),
                group(records, variant=variant, model=model, arm="scheduled-reset"),
            )
            if copy:
                row = {"variant": variant, "model": model, "seeds": len(copy)}
                for name, rs in (("copy", copy), ("reset", reset)):
                    row[f"{name}_final_loss"] = seed_mean(rs, "final_loss")
                    row[f"{name}_post_untie_loss"] = statistics.fmean(post_untie_loss(r) for r in rs)
                row["better"] = "copy" if row["copy_post_untie_loss"] <= row["reset_post_untie_loss"] else "reset"
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Issue 69: the tied claim restated as the paper's point, relative, pre-registered before the seeds that judge it.
# ---------------------------------------------------------------------------------------------------------------------

#: The tied claim's collapse contrast: the shared (0,1) must be at least this many times (2,3)'s distance.
COLLAPSE_FACTOR = 10
#: The seeds that judge the restated claim: none of them ran before it was committed (seed 42 and development seeds
#: 1-2 did, and showed the absolute claim failing at (0,1) = 0.13-0.28). More are added one by one (46, 47, ...) until
#: at least `JUDGE_MIN_LEARNED` seeds learned the task in both arms.
JUDGE_SEEDS = (43, 44, 45)
JUDGE_MIN_LEARNED = 2


def relative_tied_claim_text(model: str) -> str:
    return (
        f"[{model}] tied (main): (2,3) close, and (0,1) at least {COLLAPSE_FACTOR} times (2,3)'s distance and at "
        "least the untied arm's input (0,1), all relative to d(0,2)"
    )


def relative_tied_seed(tied: dict, untied: dict) -> dict:
    """The restated tied claim on one seed: the tied run's shared table keeps apart the pair the output role
    separates, (0,1), while the pair both roles merge, (2,3), collapses. Close: below `SEPARATION` of d(0,2); the
    contrast: (0,1) at least `COLLAPSE_FACTOR` times (2,3) and at least the untied run's input (0,1), the distance
    the input role alone gives that pair (each over its own table's d(0,2)). Judged only where both runs learned the
    task (`learned`): a run at chance answers no geometry claim."""
    final_tied, final_untied = tied["history"]["geometry"][-1], untied["history"]["geometry"][-1]
    t01, t23 = relative(final_tied, "input", "0-1"), relative(final_tied, "input", "2-3")
    u01 = relative(final_untied, "input", "0-1")
    both_learned = learned(tied) and learned(untied)
    holds = t23 < SEPARATION and t01 >= COLLAPSE_FACTOR * t23 and t01 >= u01
    return {
        "seed": tied["seed"],
        "learned": both_learned,
        "tied_0_1": t01,
        "tied_2_3": t23,
        "untied_input_0_1": u01,
        "holds": holds if both_learned else None,
    }


def judge_relative_tied_claim(records: list[dict], model: str = "mixer") -> dict:
    """The restated tied claim's verdict on the main variant's tied and untied runs of `model`, seeds in
    `JUDGE_SEEDS` or after them (seed 42 and the development seeds are excluded: they shaped the claim).

    "holds": it holds on every seed whose two runs learned the task, and at least `JUDGE_MIN_LEARNED` did; "fails":
    it fails on a seed whose runs learned (more seeds cannot undo that); "undecided": fewer than
    `JUDGE_MIN_LEARNED` seeds learned, so the next seed must run (`next_seed`)."""
    tied = {r["seed"]: r for r in group(records, variant="main", model=model, arm="tied") if r["seed"] >= 43}
    untied = {r["seed"]: r for r in group(records, variant="main", model=model, arm="untied") if r["seed"] >= 43}
    seeds = sorted(set(tied) & set(untied))
    rows = [relative_tied_seed(tied[s], untied[s]) for s in seeds]
    judged = [row for row in rows if row["learned"]]
    missing = [s for s in JUDGE_SEEDS if s not in seeds]
    if any(not row["holds"] for row in judged):
        verdict = "fails"
    elif missing or len(judged) < JUDGE_MIN_LEARNED:
        verdict = "undecided"
    else:
        verdict = "holds"
    next_seed = (missing[0] if missing else max(seeds) + 1) if verdict == "undecided" else None
    return {
        "claim": relative_tied_claim_text(model),
        "verdict": verdict,
        "seeds": rows,
        "learned_seeds": [row["seed"] for row in judged],
        "missing_seeds": missing,
        "next_seed": next_seed,
    }
