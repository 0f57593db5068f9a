"""A System One response as the Decide page shows it: per-option tables, margins, charts, labels."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import altair as alt
import pandas as pd

from clef_engine.protocol import NOUL_DEFAULT_DESCRIPTIONS

CHOSEN_COLOR = "#f38020"  # highlighted bar
OTHER_COLOR = "#9aa5b1"
BUDGET_PARTS = ("prefix", "media", "state", "schema", "suffix")
BUDGET_COLORS = ("#9aa5b1", "#8e6bd8", "#2f80ed", "#27ae60", "#cbd2d9")
BUDGET_CHART_HEIGHT = 150  # pixels with the legend and axis


@dataclass(frozen=True)
class AnswerSummary:
    question_id: str
    type: str
    top_option: str  # "true"/"false", a choice id, or a score level "0".."n-1"
    confidence: float
    margin: float
    score: float | None  # expected level Σ i·p_i, score questions only
    label: str | bool | int  # the answer as an expected label: bool (noul), option id (choice), level int (score)


def option_table(question: dict[str, Any], answer: dict[str, Any]) -> pd.DataFrame:
    """An answer's distribution_table. For score questions the chosen level is the most probable one."""
    qtype = answer.get("type", question.get("type"))
    if qtype == "noul":
        p_true = float(answer["noul"])
        return distribution_table({**question, "type": qtype}, {"true": p_true, "false": 1.0 - p_true},
                                  "true" if p_true >= 0.5 else "false")
    probabilities = answer["probabilities"]
    chosen = answer["choice"] if qtype == "choice" else max(probabilities, key=lambda o: float(probabilities[o]))
    return distribution_table({**question, "type": qtype}, probabilities, chosen, legend=answer.get("legend"))


def distribution_table(question: dict[str, Any], distribution: dict[str, float], chosen: str, *,
                       legend: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per option of a distribution, in its order: option, label, description, probability, chosen."""
    qtype, criteria = question.get("type"), question.get("criteria")
    described = criteria if isinstance(criteria, dict) else {}
    if qtype == "score":
        levels = criteria if isinstance(criteria, list) else []
        described = legend if legend is not None else {str(level): text for level, text in enumerate(levels)}
    rows = []
    for option, p in distribution.items():
        description = described.get(option) or (NOUL_DEFAULT_DESCRIPTIONS.get(option, "") if qtype == "noul" else "")
        label = f"{option}: {description}" if qtype == "score" and description else option
        rows.append({"option": option, "label": label, "description": description, "probability": float(p),
                     "chosen": option == chosen})
    return pd.DataFrame(rows, columns=["option", "label", "description", "probability", "chosen"])


def margin(probabilities: list[float] | pd.Series) -> float:
    """top1 − top2; 1.0 when there is a single option."""
    ordered = sorted((float(p) for p in probabilities), reverse=True)
    return ordered[0] - ordered[1] if len(ordered) > 1 else 1.0


def summarize(question_id: str, question: dict[str, Any], answer: dict[str, Any]) -> AnswerSummary:
    table = option_table(question, answer)
    top = table.loc[table["chosen"]].iloc[0]
    qtype = answer["type"]
    label: str | bool | int
    if qtype == "noul":
        p_true = float(answer["noul"])
        confidence, label = max(p_true, 1.0 - p_true), p_true >= 0.5
    else:
        confidence = float(answer.get("confidence", top["probability"]))
        label = int(top["option"]) if qtype == "score" else str(top["option"])
    score = float(answer["score"]) if qtype == "score" else None
    return AnswerSummary(question_id, qtype, str(top["option"]), confidence, margin(table["probability"]), score,
                         label)


def expected_labels(questions: dict[str, Any], response: dict[str, Any]) -> dict[str, str | bool | int]:
    """The response's answers as expected labels for a case: what the store and the review queue compare to."""
    return {qid: summarize(qid, questions.get(qid, {}), answer).label
            for qid, answer in response.get("answers", {}).items()}


def percent(probability: float) -> str:
    """A probability as every number of an answer shows it ("81.7%"), so the bar and the card round alike."""
    return f"{probability:.1%}"


def probability_chart(table: pd.DataFrame, *, title: str | None = None) -> alt.Chart:
    """Bars of every option's probability, the chosen one highlighted, each label whole (wrapped)."""
    data = table.assign(percent=table["probability"].map(percent),
                        answer=table["chosen"].map({True: "chosen", False: "other"}),
                        label=[wrap_label(str(label)) for label in table["label"]])
    order = list(data["label"])
    base = alt.Chart(data).encode(
        # labelExpr splits the wrapped label into lines; labelOverlap off: no label is hidden to make room
        y=alt.Y("label:N", sort=order, title=None,
                axis=alt.Axis(labelExpr="split(datum.label, '\\n')", labelLimit=LABEL_LIMIT_PX, labelOverlap=False,
                              labelLineHeight=LABEL_LINE_PX)),
        x=alt.X("probability:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"), title="probability"),
    )
    bars = base.mark_bar(size=BAR_PX).encode(
        color=alt.Color("answer:N", scale=alt.Scale(domain=["chosen", "other"], range=[CHOSEN_COLOR, OTHER_COLOR]),
                        legend=None),
        tooltip=[alt.Tooltip("option:N"), alt.Tooltip("description:N"), alt.Tooltip("probability:Q", format=".4f")],
    )
    labels = base.mark_text(align="left", dx=3).encode(text="percent:N")
    # fit-x: the full width, and the rows' height (Streamlit's "fit" squeezed the labels into a fixed height)
    chart = (bars + labels).properties(height=alt.Step(option_step(data["label"])),
                                       autosize=alt.AutoSizeParams(type="fit-x", contains="padding"))
    return chart.properties(title=title) if title else chart


LABEL_WRAP_CHARS = 34  # characters per label line: about 200 px at the axis font, leaving room for the bars
LABEL_LIMIT_PX = 240  # a line is never longer than this after wrapping; the limit only guards odd glyphs
LABEL_LINE_PX = 13
ROW_PADDING_PX = 12  # between two options' rows
BAR_PX = 18  # bars as thick whether a row holds one line of label or several


def wrap_label(label: str) -> str:
    """An option label on lines of at most LABEL_WRAP_CHARS characters (at spaces; a longer word is split)."""
    return "\n".join(textwrap.wrap(label, LABEL_WRAP_CHARS, break_on_hyphens=False)) or label


def option_step(labels: Iterable[str]) -> int:
    """Pixels per option row: enough for the longest (wrapped) label's lines and a bar."""
    lines = max((label.count("\n") + 1 for label in labels), default=1)
    return max(24, LABEL_LINE_PX * lines + ROW_PADDING_PX)


@dataclass(frozen=True)
class BudgetStatus:
    """What the budget bar says: does the record fit max_length, and if not, what happens."""

    total: int
    max_length: int
    state_tokens_over: int  # state tokens that would be cut (from the end) with overflow="truncate_state"
    fixed_tokens_over: int  # prefix + media + schema + suffix over max_length: cannot run at all
    overflow: str = "refuse"  # what the run does with a state that does not fit

    @property
    def message(self) -> str:
        if self.fixed_tokens_over:
            return (f"Even without the state, this record is {self.fixed_tokens_over:,} tokens over max_length "
                    f"{self.max_length:,}: shorten the schema, attach fewer or smaller media, or raise max_length.")
        if self.state_tokens_over and self.overflow == "truncate_state":
            return (f"The record is {self.total:,} tokens; max_length is {self.max_length:,}. The last "
                    f"{self.state_tokens_over:,} tokens of the state will be cut: the model will not read them.")
        if self.state_tokens_over:
            return (f"The record is {self.total:,} tokens; max_length is {self.max_length:,}, so Run will be "
                    f"refused: choose to truncate the state (its last {self.state_tokens_over:,} tokens are cut) "
                    "or raise max_length.")
        return f"{self.total:,} of {self.max_length:,} tokens used."

    @property
    def state_tokens_cut(self) -> int | None:
        """How many of the state's tokens a Run with this budget cuts; None: it is refused."""
        if self.state_tokens_over and self.overflow != "truncate_state":
            return None
        return self.state_tokens_over


def budget_status(counts: dict[str, int], overflow: str = "refuse") -> BudgetStatus:
    total = int(counts["total"])
    limit = int(counts["max_length"])
    fixed = total - int(counts["state"])
    state_over = int(counts.get("state_tokens_over", max(0, min(counts["state"], total - limit))))
    fixed_over = int(counts.get("fixed_tokens_over", max(0, fixed - limit)))
    return BudgetStatus(total, limit, state_over, fixed_over, overflow)


def budget_table(counts: dict[str, int]) -> pd.DataFrame:
    """One row per part with start/end offsets, then "free" up to max_length or "over max_length"."""
    rows, start = [], 0
    for part in BUDGET_PARTS:
        tokens = int(counts.get(part, 0))
        rows.append({"part": part, "tokens": tokens, "start": start, "end": start + tokens})
        start += tokens
    limit = int(counts.get("max_length", start))
    if start < limit:
        rows.append({"part": "free", "tokens": limit - start, "start": start, "end": limit})
    elif start > limit:
        rows.append({"part": "over max_length", "tokens": start - limit, "start": limit, "end": start})
    return pd.DataFrame(rows)


def budget_chart(counts: dict[str, int]) -> alt.Chart:
    table = budget_table(counts)
    domain = [*BUDGET_PARTS, "free", "over max_length"]
    return alt.Chart(table).mark_bar(height=26).encode(
        x=alt.X("start:Q", title="tokens", scale=alt.Scale(domain=[0, int(table["end"].max())])),
        x2="end:Q",
        color=alt.Color("part:N", sort=domain, scale=alt.Scale(domain=domain, range=[*BUDGET_COLORS, "#eef1f4",
                                                                                     "#d64545"]),
                        # labelLimit 0: every part's name whole (Vega cut "over max_length" to "over max_le…")
                        legend=alt.Legend(orient="top", title=None, direction="horizontal", labelLimit=0, columns=3)),
        tooltip=["part:N", alt.Tooltip("tokens:Q", format=","), alt.Tooltip("start:Q", format=","),
                 alt.Tooltip("end:Q", format=",")],
    ).properties(height=BUDGET_CHART_HEIGHT)

