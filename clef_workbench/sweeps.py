"""Schema sweeps: many versions of a schema scored on a labelled case set at the cost of one state per case.

An analyst's loop is "change a question's wording, run the case set again, see whether it got better". A sweep does
the whole loop at once: from a base schema it builds variants (the analyst's own, and automatic ones: each option's
description removed, the instructions removed, the options reversed or shuffled, an "unknown" option added or
removed), runs every variant on every labelled case, and scores them honestly:

- per variant and question: accuracy, macro-F1, log loss and ECE against the gold labels, each with a percentile
  bootstrap interval over cases (`compare.bootstrap_interval`, seeded);
- against the base schema: the cases whose answer flips, the exact McNemar test on the paired right/wrong outcomes
  (scipy's binomial test on the discordant pairs) and the paired bootstrap interval of the accuracy change; a variant
  is "better" only when that interval lies above zero;
- order sensitivity per question: the share of cases whose answer changes when only the options' order changes
  (the reversed and shuffled variants against the base), flagged above a threshold the analyst sets;
- no overfitting by selection: per question, the best variant is chosen on the training folds of a k-fold split of
  the cases and scored on the held-out fold (`best`); the composed schema takes, for each question, the wording
  chosen on all cases.

Execution is case-major (`run_sweep`): for each case the engine prefills the state once and continues every
variant's schema from it in one worker call (`Engine.decide_variants`), so a sweep of V variants over N cases
prefills N states, not N × V. A sweep is stored like a run (case set, base schema, variants, model, precision,
status, one answer per case and variant) and resumes after a kill without computing a finished case again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_VARIANTS = 64  # a sweep's variants, the base included
DEFAULT_FOLDS = 5
DEFAULT_SEED = 0
AUTO_KINDS = ("no_descriptions", "no_instructions", "reversed", "shuffled", "unknown_added", "unknown_removed")
ORDER_KINDS = ("reversed", "shuffled")  # the options' order only: what order sensitivity compares with the base
VARIANT_KINDS = ("base", *AUTO_KINDS, "custom")
SWEEP_STATUSES = ("pending", "running", "cancelled", "finished", "failed")


class SweepError(ValueError):
    """A sweep cannot be built or started as asked (an unlabelled case set, a bad variant, too many variants): the
    message says what and where."""


@dataclass(frozen=True)
class Variant:
    """One version of the schema a sweep scores. `schema` is a whole schema dict (name, version, questions);
    `kind` one of VARIANT_KINDS; `question` the question it changes (None for the base, or a custom variant that
    changes several)."""

    name: str
    schema: dict[str, Any]
    kind: str
    question: str | None = None


@dataclass(frozen=True)
class Metric:
    """A number with its 95% bootstrap interval; None where there is nothing to measure (no labelled answers)."""

    value: float | None
    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class QuestionScore:
    """One variant's answers to one question against the gold labels, and against the base schema's answers."""

    question: str
    n: int  # cases with a gold label for the question and an answer from the variant
    accuracy: Metric
    macro_f1: Metric
    log_loss: Metric
    ece: Metric
    flips: list[int]  # case ids whose predicted answer differs from the base's
    accuracy_change: Metric  # variant − base, paired bootstrap over the same cases
    mcnemar_p: float | None  # exact McNemar (two-sided) on right/wrong vs the base; None for the base itself
    better: bool  # accuracy_change's interval lies entirely above zero


@dataclass(frozen=True)
class VariantScore:
    """A variant's scores: per question, and overall (every labelled (case, question) answer pooled; the interval
    resamples cases)."""

    variant: Variant
    accuracy: Metric
    accuracy_change: Metric
    questions: dict[str, QuestionScore]
    flips_vs_base: list[int]  # case ids where any question's answer differs from the base's
    order_sensitivity: float | None  # order variants: share of cases whose answer to `question` changed; else None


@dataclass(frozen=True)
class BestSchema:
    """The composed best schema and what it scores where it was not chosen.

    `choices`: per question, the variant whose wording of it was best on all cases. `heldout_accuracy`: per fold,
    each question's best variant chosen on the other folds and scored on this fold, pooled over folds, with a
    bootstrap interval over cases. `base_heldout_accuracy`: the base on the same answers, for comparison."""

    schema: dict[str, Any]
    choices: dict[str, str]
    folds: int
    heldout_accuracy: Metric
    base_heldout_accuracy: Metric


@dataclass(frozen=True)
class SweepProgress:
    """Where a sweep stands: cases done of total, state prefills so far in this process, rate and ETA (None until
    measured), and its status."""

    sweep_id: int
    done: int
    total: int
    status: str
    rate_per_s: float | None = None
    eta_s: float | None = None
    state_prefills: int = 0
    error: str | None = None


@dataclass(frozen=True)
class SweepResult:
    """A stored sweep and its scores (`load_sweep`). `variants[0]` is the base. `order_sensitivity`: per question,
    the share of cases whose answer changes under an order-only variant (questions without one are absent);
    `flagged`: the questions above `threshold`."""

    id: int
    status: str
    case_set_id: int
    case_set_name: str
    base_schema: dict[str, Any]
    model_id: str
    settings: dict[str, Any]
    created_at: str
    cases: int  # labelled cases in the sweep
    done: int  # cases with an answer for every variant
    state_prefills: int  # states prefilled to compute the answers (stored with each case's answers)
    variants: list[VariantScore]
    order_sensitivity: dict[str, float]
    threshold: float | None
    flagged: list[str]
    best: BestSchema | None
    errors: list[dict[str, Any]] = field(default_factory=list)  # {case_id, variant, error} of failed answers

    def to_json(self) -> dict[str, Any]:
        """The CLI's --json document (docs/workbench.md "Schema sweeps")."""
        raise NotImplementedError


ProgressCallback = Callable[[SweepProgress], None]


def auto_variants(schema: dict[str, Any], kinds: Sequence[str] = AUTO_KINDS, *,
                  seed: int = DEFAULT_SEED) -> list[Variant]:
    """The automatic variants of `schema` of the given kinds, one per question where the kind applies (option
    descriptions and the order of options: choice questions; instructions: every question; "unknown": choice
    questions, added where none is offered and removed where one is). Shuffles are seeded. The base is not
    included."""
    raise NotImplementedError


def base_variant(schema: dict[str, Any]) -> Variant:
    """The schema as it is, the variant every other is compared with."""
    return Variant("base", schema, "base", None)


def variants_from_json(text: str, base: dict[str, Any], *, source: str = "variants") -> list[Variant]:
    """The analyst's variants from a JSON file: a list of {"name", "questions"} (questions: a map of question id →
    question replacing the base's; other questions keep the base's wording), or the word "auto". Raises SweepError
    naming the entry and field of every problem."""
    raise NotImplementedError


def start_sweep(store: Any, case_set_id: int, schema: dict[str, Any], variants: Sequence[Variant], *,
                model_id: str, model_revision: str | None = None, settings: dict[str, Any] | None = None,
                folds: int = DEFAULT_FOLDS) -> int:
    """Record a sweep of the case set's labelled cases (status pending) and return its id. The base variant is
    added first when `variants` lacks it. Raises SweepError when the case set has no labelled case, a variant's
    schema is invalid or its questions differ in ids from the base's, names repeat, or there are more than
    MAX_VARIANTS."""
    raise NotImplementedError


def run_sweep(store: Any, sweep_id: int, engine: Any, *, progress: ProgressCallback | None = None,
              stop: Callable[[], bool] | None = None) -> SweepProgress:
    """Compute the sweep's cases that have no answers yet, case-major: per case one call of
    `engine.decide_variants` (its state prefilled once, every variant continued from it); an engine without it
    (a remote endpoint) gets each variant as a request. Each case's answers are stored in one transaction, so a
    kill loses at most the case in flight and a later call resumes with the rest. `progress` is called after each
    case; `stop()` true ends the sweep as cancelled after the case in flight. Returns the final progress."""
    raise NotImplementedError


def load_sweep(store: Any, sweep_id: int, *, threshold: float | None = None, folds: int | None = None,
               seed: int = DEFAULT_SEED) -> SweepResult:
    """A stored sweep with its scores over the cases done so far (see the module docstring)."""
    raise NotImplementedError


def list_sweeps(store: Any, case_set_id: int | None = None) -> list[dict[str, Any]]:
    """Sweeps, newest first (optionally of one case set): id, case_set_id, case_set_name, schema_name, model_id,
    status, variants (count), done, total, created_at."""
    raise NotImplementedError
