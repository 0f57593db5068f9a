"""Altair charts for the Runs and Review pages, built from clef_workbench.stats outputs (no Streamlit here)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from workbench_ui.answers import CHOSEN_COLOR, OTHER_COLOR


def latency_histogram(results: list[dict]) -> alt.Chart:
    """Histogram of per-record compute over successful results, with p50 and p95 rules."""
    data = pd.DataFrame({"latency_ms": pd.Series([r["latency_ms"] for r in results if not r.get("error")
                                                  and r.get("latency_ms") is not None], dtype=float)})
    bars = alt.Chart(data).mark_bar(color="#2f80ed").encode(
        x=alt.X("latency_ms:Q", bin=alt.Bin(maxbins=30), title="compute per record (ms)"),
        y=alt.Y("count():Q", title="records"),
        tooltip=[alt.Tooltip("count():Q", title="records")],
    )
    quantiles = pd.DataFrame({
        "quantile": ["p50", "p95"],
        "latency_ms": [data["latency_ms"].quantile(0.5), data["latency_ms"].quantile(0.95)] if len(data) else [0, 0],
    })
    rules = alt.Chart(quantiles).mark_rule(color=CHOSEN_COLOR, strokeDash=[4, 3]).encode(
        x="latency_ms:Q", tooltip=["quantile:N", alt.Tooltip("latency_ms:Q", format=".1f")])
    return (bars + rules).properties(height=220, title="Compute per record")


def accuracy_chart(accuracy: pd.DataFrame) -> alt.Chart:
    """Bars of accuracy per question (questions without expected answers are left out)."""
    data = accuracy.dropna(subset=["accuracy"])
    return alt.Chart(data).mark_bar(color="#27ae60").encode(
        y=alt.Y("question_id:N", title=None, sort=list(data["question_id"])),
        x=alt.X("accuracy:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%")),
        tooltip=["question_id", "n_expected", "n_correct", alt.Tooltip("accuracy:Q", format=".1%")],
    ).properties(height=max(60, 26 * len(data)), title="Accuracy vs expected answers")


def accuracy_chart_height(question_count: int) -> int:
    """Pixels for the whole chart, axes included (without a height Streamlit squeezes it to one row)."""
    return 34 * question_count + 90


def confusion_heatmap_height(option_count: int) -> int:
    """Pixels for the whole heatmap: the cells plus the title and the rotated option labels under it."""
    return max(160, 34 * option_count) + 150


def confusion_heatmap(matrix: pd.DataFrame, question_id: str) -> alt.LayerChart:
    """Expected (rows) × predicted (columns) counts with the numbers printed in the cells."""
    order = list(matrix.index)
    data = matrix.reset_index().melt(id_vars="expected", var_name="predicted", value_name="count")
    base = alt.Chart(data).encode(
        y=alt.Y("expected:N", sort=order, title="expected"),
        x=alt.X("predicted:N", sort=order, title="predicted"),
    )
    cells = base.mark_rect().encode(color=alt.Color("count:Q", scale=alt.Scale(scheme="blues"), legend=None),
                                    tooltip=["expected", "predicted", "count"])
    text = base.mark_text().encode(text="count:Q")
    size = max(160, 34 * len(order))
    return (cells + text).properties(width=size, height=size, title=f"Confusion: {question_id}")


def reliability_diagram(question_id: str, bins: pd.DataFrame, calibrated: pd.DataFrame | None = None
                        ) -> alt.LayerChart:
    """Accuracy against mean confidence per bin and the diagonal; with `calibrated`, both curves."""
    curves = {"raw": bins} if calibrated is None else {"raw": bins, "calibrated (held out)": calibrated}
    data = pd.concat([b.assign(probabilities=name) for name, b in curves.items()])
    colors = [CHOSEN_COLOR] if calibrated is None else [OTHER_COLOR, CHOSEN_COLOR]
    diagonal = alt.Chart(pd.DataFrame({"x": [0.0, 1.0], "y": [0.0, 1.0]})).mark_line(
        color=OTHER_COLOR, strokeDash=[4, 3]).encode(x="x:Q", y="y:Q")
    base = alt.Chart(data[data["count"] > 0]).encode(
        x=alt.X("mean_confidence:Q", scale=alt.Scale(domain=[0, 1]), title="mean confidence"),
        y=alt.Y("accuracy:Q", scale=alt.Scale(domain=[0, 1]), title="accuracy"),
        color=alt.Color("probabilities:N", scale=alt.Scale(domain=list(curves), range=colors),
                        legend=None if calibrated is None else alt.Legend(orient="bottom", title=None)))
    points = base.mark_circle(opacity=0.9).encode(
        size=alt.Size("count:Q", legend=None),
        tooltip=["probabilities", "bin_low", "bin_high", "count", alt.Tooltip("mean_confidence:Q", format=".3f"),
                 alt.Tooltip("accuracy:Q", format=".3f")])
    return (diagonal + base.mark_line() + points).properties(
        width=220, height=220 if calibrated is None else 240, title=f"Reliability: {question_id}")


ROW_PX = 22  # a leaderboard row: room for the theme's label font
LEADERBOARD_COLORS = {"base": OTHER_COLOR, "better": "#27ae60", "worse": "#d64545", "no clear difference": "#2f80ed"}


def leaderboard_chart(data: pd.DataFrame) -> alt.FacetChart:
    """Per scope, each variant's accuracy on its 95 % interval, coloured by how it compares with the base."""
    variants = list(dict.fromkeys(data["variant"]))
    color = alt.Color("against the base:N", scale=alt.Scale(domain=list(LEADERBOARD_COLORS),
                                                           range=list(LEADERBOARD_COLORS.values())),
                      legend=alt.Legend(orient="bottom", title=None))
    # every variant named: at the theme's font size Vega hid every other label of a tight axis (labelOverlap)
    base = alt.Chart().encode(y=alt.Y("variant:N", sort=variants, title=None,
                                      axis=alt.Axis(labelLimit=240, labelOverlap=False)), color=color)
    interval = base.mark_rule(strokeWidth=2).encode(
        x=alt.X("low:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"), title="accuracy"), x2="high:Q")
    point = base.mark_point(filled=True, size=60).encode(
        x="accuracy:Q", tooltip=["variant", "scope", alt.Tooltip("accuracy:Q", format=".3f"),
                                 alt.Tooltip("low:Q", format=".3f"), alt.Tooltip("high:Q", format=".3f"),
                                 "against the base"])
    return alt.layer(interval, point, data=data).properties(width=240, height=ROW_PX * len(variants) + 10).facet(
        facet=alt.Facet("scope:N", sort=list(dict.fromkeys(data["scope"])), title=None), columns=3)
