"""The Decide page's logic without Streamlit. State lives in a mapping under `decide.<name>`; each question has a stable
uid so its widgets keep their values when questions move."""

from __future__ import annotations

import base64
import hashlib
import json
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from clef_engine.errors import Problem
from clef_workbench import schemas
from workbench_ui import answers, schema_rows, state_input

PREFIX = "decide"
# a widget's value mirrored under this prefix survives a run that does not draw it (shell.kept_widget)
KEEP_PREFIX = "_keep."
ROW_FIELDS = ("id", "type", "instructions", "options", "levels", "true", "false")
# a new question's options and levels, whatever its type: they show when its type changes
NEW_OPTIONS = [{"id": "option_a", "description": ""}, {"id": "option_b", "description": ""},
               {"id": "unknown", "description": "None of these fits."}]
NEW_LEVELS = ["Low", "Medium", "High"]
DRAFT_FIELDS = ("state_text", "state_mode", "schema_name", "schema_description", "max_length", "overflow", "model")


def key(name: str) -> str:
    return f"{PREFIX}.{name}"


def set_kept(state: MutableMapping, name: str, value: Any) -> None:
    """Set a kept widget's value before it is drawn (from a callback or the first run)."""
    state[name] = value
    state[KEEP_PREFIX + name] = value


def kept(state: MutableMapping, name: str, default: Any = None) -> Any:
    """A kept widget's value: the widget's own while it is drawn, else the mirror's."""
    return state.get(name, state.get(KEEP_PREFIX + name, default))


def forget_kept(state: MutableMapping, name: str, unless_in: Any = ()) -> None:
    """Forget a kept widget's value unless it is among `unless_in` (its options now)."""
    for stale in (name, KEEP_PREFIX + name):
        if stale in state and state[stale] not in unless_in:
            del state[stale]


def row_keys(uid: int) -> dict[str, str]:
    return {f: key(f"q{uid}.{f}") for f in ROW_FIELDS}


class Builder:
    """The questions on screen and the library schema they came from (`loaded_slug`, their identity)."""

    def __init__(self, state: MutableMapping):
        self.state = state

    @property
    def uids(self) -> list[int]:
        return self.state.setdefault(key("uids"), [])

    @property
    def loaded_slug(self) -> str | None:
        return self.state.get(key("loaded_slug"))

    @property
    def loaded_version(self) -> int | None:
        return self.state.get(key("loaded_version"))

    @property
    def examples(self) -> list[dict]:
        return self.state.get(key("examples")) or []

    def _new_uid(self) -> int:
        uid = self.state.get(key("next_uid"), 0)
        self.state[key("next_uid")] = uid + 1
        return uid

    def _write_row(self, uid: int, row: dict[str, Any]) -> None:
        texts = {"options": schema_rows.options_to_text(row.get("options") or []),
                 "levels": schema_rows.levels_to_text(row.get("levels") or [])}
        for name, widget_key in row_keys(uid).items():
            set_kept(self.state, widget_key, texts.get(name, row.get(name) or ""))

    def set_rows(self, rows: list[dict[str, Any]]) -> None:
        self.state[key("uids")] = [self._new_uid() for _ in rows]
        for uid, row in zip(self.uids, rows, strict=True):
            self._write_row(uid, row)
        self.state.pop(key("removed"), None)  # the questions it undid are gone

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for uid in self.uids:
            keys = row_keys(uid)
            value = {f: kept(self.state, keys[f], "") for f in ROW_FIELDS}
            row = {"id": value["id"], "type": value["type"] or "noul", "instructions": value["instructions"]}
            if row["type"] == "choice":
                row["options"] = schema_rows.text_to_options(value["options"] or "")
            elif row["type"] == "score":
                row["levels"] = schema_rows.text_to_levels(value["levels"] or "")
            else:
                row["true"], row["false"] = value["true"], value["false"]
            out.append(row)
        return out

    def add_question(self, qtype: str) -> None:
        existing = {self.state.get(row_keys(u)["id"]) for u in self.uids}
        n = len(self.uids) + 1
        while f"q{n}" in existing:
            n += 1
        self.forget_removed()
        uid = self._new_uid()
        self._write_row(uid, {"id": f"q{n}", "type": qtype, "options": NEW_OPTIONS, "levels": NEW_LEVELS})
        self.uids.append(uid)

    def move(self, uid: int, step: int) -> None:
        self.forget_removed()
        uids = self.uids
        i = uids.index(uid)
        j = max(0, min(len(uids) - 1, i + step))
        uids[i], uids[j] = uids[j], uids[i]

    def remove(self, uid: int) -> None:
        """Take a question off screen; `undo_remove` puts it back where it was, with its kept values."""
        position = self.uids.index(uid)
        self.uids.remove(uid)
        self.state[key("removed")] = {"uid": uid, "position": position, "id": kept(self.state, row_keys(uid)["id"])}

    @property
    def last_removed(self) -> str | None:
        """The id of the question the last Remove took away, while it can be undone."""
        removed = self.state.get(key("removed"))
        return None if removed is None else str(removed["id"] or "")

    def undo_remove(self) -> None:
        removed = self.state.pop(key("removed"), None)
        if removed is not None and removed["uid"] not in self.uids:
            self.uids.insert(min(removed["position"], len(self.uids)), removed["uid"])

    def forget_removed(self) -> None:
        self.state.pop(key("removed"), None)

    def load(self, slug: str, schema: schemas.Schema) -> None:
        """Put a library schema on screen (undoable); the state editor gets its first example unless typed in."""
        typed = self._state_typed()
        if self.uids:
            self._remember_replaced("schema", f"Loaded “{slug}” in place of the questions that were here.")
        self.set_rows(schema_rows.questions_to_rows(schema.questions))
        self.saved_as(slug, schema)
        set_kept(self.state, key("schema_name"), schema.name)
        set_kept(self.state, key("schema_description"), schema.description)
        self.state[key("examples")] = schema.examples
        if schema.examples and not typed:
            set_kept(self.state, key("state_text"), state_input.state_to_text(schema.examples[0]["state"]))

    def new_schema(self) -> None:
        """Start an empty schema: no questions, no name, no examples, no identity (the state is kept)."""
        self.set_rows([])
        for name in self.LOADED:
            self.state.pop(key(name), None)
        for name, value in (("schema_name", ""), ("schema_description", ""), ("library_pick", None)):
            set_kept(self.state, key(name), value)

    def saved_as(self, slug: str, schema: schemas.Schema) -> None:
        self.state[key("loaded_slug")] = slug
        self.state[key("loaded_questions")] = schema.questions
        self.state[key("loaded_version")] = schema.version  # an Update is refused if the library moved on
        set_kept(self.state, key("library_pick"), slug)

    def use_example(self, index: int) -> None:
        """The loaded schema's example `index` into the state editor; what it replaces can be undone."""
        if not 0 <= index < len(self.examples):
            return
        example = state_input.state_to_text(self.examples[index]["state"])
        if self._state_typed():
            name = self.examples[index].get("name") or f"Example {index + 1}"
            self._remember_replaced("state", f"Replaced the state with the example “{name}”.")
        set_kept(self.state, key("state_text"), example)

    # Undo of Load and Use example: what they replaced, kept until the next replacement or its undo.
    REPLACEABLE = ("state_text", "schema_name", "schema_description", "library_pick")
    LOADED = ("loaded_slug", "loaded_questions", "loaded_version", "examples")

    def _state_typed(self) -> bool:
        """Whether the state editor holds something typed in: neither empty nor one of the examples."""
        examples = [state_input.state_to_text(example["state"]).strip() for example in self.examples]
        return str(kept(self.state, key("state_text")) or "").strip() not in {"", *examples}

    def _remember_replaced(self, place: str, message: str) -> None:
        self.state[key("replaced")] = {
            "place": place, "message": message, "rows": self.rows(),
            "values": {name: kept(self.state, key(name)) for name in self.REPLACEABLE},
            "loaded": {name: self.state.get(key(name)) for name in self.LOADED}}

    def replaced(self, place: str) -> str | None:
        """What the last Load ("schema") or Use example ("state") replaced, in words, while it can be undone."""
        replaced = self.state.get(key("replaced"))
        return replaced["message"] if replaced and replaced["place"] == place else None

    def undo_replace(self) -> None:
        """Put back what the last Load or Use example replaced."""
        replaced = self.state.pop(key("replaced"), None)
        if replaced is None:
            return
        if replaced["place"] == "schema":
            self.set_rows(replaced["rows"])
            for name, value in replaced["loaded"].items():
                if value is None:
                    self.state.pop(key(name), None)
                else:
                    self.state[key(name)] = value
            for name in ("schema_name", "schema_description", "library_pick"):
                set_kept(self.state, key(name), replaced["values"][name])
        else:
            set_kept(self.state, key("state_text"), replaced["values"]["state_text"])

    def unsaved_changes(self) -> bool:
        """True when the questions on screen differ from the loaded schema's (or exist, with none loaded)."""
        questions, _ = schema_rows.rows_to_questions(self.rows())
        loaded = self.state.get(key("loaded_questions"))
        if loaded is None:
            return bool(self.uids)
        return json.dumps(questions, sort_keys=True) != json.dumps(loaded, sort_keys=True)

    def schema_to_save(self, questions: dict, name: str, description: str, *, update: bool) -> schemas.Schema:
        """The schema the Save buttons write; examples go with an update only, not into a new schema."""
        return schemas.Schema(name=name.strip() or "Untitled schema", questions=questions, description=description,
                              examples=self.examples if update else [])


@dataclass
class Messages:
    """Errors and warnings per place on the page: "state", "media", "schema", "budget" or a question's row index."""

    errors: dict[Any, list[str]] = field(default_factory=dict)
    warnings: dict[Any, list[str]] = field(default_factory=dict)

    def add(self, place: Any, message: str, *, warning: bool = False) -> None:
        bucket = self.warnings if warning else self.errors
        if message not in bucket.setdefault(place, []):
            bucket[place].append(message)


def question_rows(target: int | str, rows: list[dict[str, Any]]) -> list[int]:
    if isinstance(target, int):
        return [target] if 0 <= target < len(rows) else []
    return [i for i, row in enumerate(rows) if str(row["id"]).strip() == target]


def route_schema_problems(problems: list[schemas.SchemaProblem], rows: list[dict[str, Any]],
                          messages: Messages) -> None:
    """Builder and lint problems next to their question, or on the schema; none for an empty builder."""
    for problem in problems:
        if not rows and problem.loc == ("questions",):
            continue
        indices = question_rows(problem.loc[1], rows) if len(problem.loc) >= 2 and problem.loc[0] == "questions" \
            else []
        warning = problem.severity == "warning"
        for i in indices:
            messages.add(i, problem.msg, warning=warning)
        if not indices and not warning:
            messages.add("schema", problem.msg)


ENGINE_PLACES = {"state": "state", "images": "media", "videos": "media", "questions": "schema"}


def route_engine_problems(problems: list[Problem], rows: list[dict[str, Any]], messages: Messages) -> None:
    """An engine refusal's problems next to what they concern: a question (else the schema), the state, the media;
    the rest (the model, the budget) under the budget."""
    for problem in problems:
        where = ".".join(str(part) for part in problem.loc)
        head = problem.loc[0] if problem.loc else None
        targets: list[Any] = (question_rows(str(problem.loc[1]), rows) or ["schema"]
                              if head == "questions" and len(problem.loc) > 1 else [ENGINE_PLACES.get(head, "budget")])
        for target in targets:
            messages.add(target, f"{where}: {problem.msg}" if where else problem.msg)


CONTROL_LABELS = {
    "overflow='truncate_state'": "“If the state does not fit: truncate the end of the state”",
    "overflow='refuse'": "“If the state does not fit: refuse”",
    "truncate_state": "“truncate the end of the state”",
}


def in_control_words(message: str) -> str:
    for api, label in CONTROL_LABELS.items():
        message = message.replace(api, label)
    return message


def fingerprint(request: dict[str, Any] | None) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest() if request else ""


class BudgetCache:
    """Token counts of the last request, per request, max_length and engine (held weakly)."""

    def __init__(self) -> None:
        self._last: tuple[tuple[str, int], weakref.ref, dict[str, int]] | None = None

    def counts(self, engine: Any, request: dict[str, Any], max_length: int) -> dict[str, int]:
        wanted = (fingerprint(request), max_length)
        if self._last is not None and self._last[0] == wanted and self._last[1]() is engine:
            return self._last[2]
        counts = engine.count_tokens(request, max_length=max_length)
        self._last = (wanted, weakref.ref(engine), counts)
        return counts


@dataclass(frozen=True)
class DecideResult:
    """What one press of Run produced, kept while the editors change."""

    request: dict[str, Any]
    response: dict[str, Any]
    questions: dict[str, Any]
    state: Any
    images: tuple[state_input.Media, ...]
    videos: tuple[state_input.Media, ...]
    schema_name: str
    model_label: str
    device: str
    schema_slug: str | None = None  # the library schema the questions came from (its identity), if any
    random_weights: bool = False  # the model that answered has random weights: the page says so next to them
    max_length: int | None = None  # the budget it ran with (None: not known, a draft kept before they were)
    overflow: str | None = None

    def default_case_set(self) -> str:
        return f"{self.schema_name or 'Decide'} cases"

    def stale_causes(self, *, questions: dict[str, Any], state: Any, images: list[state_input.Media],
                     videos: list[state_input.Media], model: str | None,
                     budget: answers.BudgetStatus | None = None) -> list[str]:
        """What changed on screen since Run, in words; empty when the answers still match the inputs. `budget`:
        the token budget on screen, when it is counted."""
        causes = []
        if json.dumps(questions, sort_keys=True) != json.dumps(self.questions, sort_keys=True):
            causes.append("the schema")
        if json.dumps(state, sort_keys=True, default=str) != json.dumps(self.state, sort_keys=True, default=str):
            causes.append("the state")
        if [m.data for m in (*images, *videos)] != [m.data for m in (*self.images, *self.videos)]:
            causes.append("the media")
        if model != self.model_label:
            causes.append("the model")
        cut_then = self.response.get("x_truncated_state_tokens", 0)
        if (budget is not None and not {"the schema", "the state", "the media"} & set(causes)
                and budget.state_tokens_cut != cut_then):
            causes.append("the token budget")  # the same record, cut otherwise: max_length or overflow changed
        return causes

    def expected_labels(self) -> dict[str, Any]:
        return answers.expected_labels(self.questions, self.response)

    def redacted_request(self) -> dict[str, Any]:
        return state_input.redact_media(self.request, list(self.images), list(self.videos))


def answer_text(summary: answers.AnswerSummary, answer: dict[str, Any]) -> str:
    """An answer card's headline: a score's level with its label ("level 1 · Medium")."""
    if summary.type != "score":
        return summary.top_option
    label = (answer.get("legend") or {}).get(summary.top_option)
    return f"level {summary.top_option}" + (f" · {label}" if label else "")


def stale_message(causes: list[str]) -> str:
    """The warning over answers whose inputs changed since they were computed (Run, or the run a link opened),
    naming what changed."""
    what = causes[0] if len(causes) == 1 else ", ".join(causes[:-1]) + " and " + causes[-1]
    verb = "has" if len(causes) == 1 else "have"
    return (f"**Outdated:** {what} {verb} changed since these answers were computed. They are for the request as "
            "it was then; press Run for answers to what is on screen.")


# Save as case's fields, proposed afresh from each new result
SAVE_AS_CASE_FIELDS = ("case_set_pick", "case_set_new", "confirm_labels", "case_tags")


def keep_result(state: MutableMapping, result: DecideResult) -> None:
    for name in SAVE_AS_CASE_FIELDS:
        state.pop(key(name), None)
    state[key("result")] = result


def save_as_case(store: Any, result: DecideResult, case_set_name: str, *, with_labels: bool, tags_text: str) -> int:
    """Add the run's state and media to a case set (created if missing). Raises StoreError / ValueError."""
    # the library identity (the slug the Case sets and Runs pages load), not the display name
    case_set_id = store.get_or_create_case_set(case_set_name, schema_name=result.schema_slug or None)
    return store.add_case(
        case_set_id, state=result.state,
        images=[m.data for m in result.images] or None,
        videos=[m.data for m in result.videos] or None,
        expected=result.expected_labels() if with_labels else None,
        tags=[t.strip() for t in tags_text.split(",") if t.strip()] or None,
    )


def set_media(state: MutableMapping, media: list[state_input.Media]) -> None:
    state[key("media")] = list(media)


def restored_media(state: MutableMapping) -> list[state_input.Media]:
    return list(state.get(key("restored_media")) or [])


def remove_restored_media(state: MutableMapping, index: int) -> None:
    state[key("restored_media")] = [m for i, m in enumerate(restored_media(state)) if i != index]


def with_restored(restored: list[state_input.Media], uploaded: list[state_input.Media]) -> list[state_input.Media]:
    """The restored media, then the uploaded ones that are not the same file again (uploaded again after a reload)."""
    seen = {m.data for m in restored}
    return restored + [m for m in uploaded if m.data not in seen]


def _media_entry(media: state_input.Media) -> dict[str, Any]:
    return {"kind": media.kind, "name": media.name, "content_type": media.content_type, "width": media.width,
            "height": media.height, "duration_s": media.duration_s,
            "sha256": hashlib.sha256(media.data).hexdigest()}


def result_entry(result: DecideResult | None) -> dict[str, Any] | None:
    """The last run's result as JSON-able data: the request without media, the media by digest."""
    if result is None:
        return None
    return {"request": {k: v for k, v in result.request.items() if k not in ("images", "videos")},
            "response": result.response, "questions": result.questions, "state": result.state,
            "media": [_media_entry(m) for m in (*result.images, *result.videos)],
            "schema_name": result.schema_name, "model_label": result.model_label, "device": result.device,
            "schema_slug": result.schema_slug, "random_weights": result.random_weights,
            "max_length": result.max_length, "overflow": result.overflow}


def draft_of(state: MutableMapping) -> dict[str, Any]:
    """The editors' contents and the last result as JSON-able data, media by digest."""
    builder = Builder(state)
    values = {name: kept(state, key(name)) for name in DRAFT_FIELDS}
    media = state.get(key("media"), state.get(key("restored_media"))) or []
    return {**values, "rows": builder.rows(), "loaded_slug": builder.loaded_slug,
            "loaded_questions": state.get(key("loaded_questions")), "loaded_version": builder.loaded_version,
            "examples": builder.examples,
            "media": [_media_entry(m) for m in media], "result": result_entry(state.get(key("result")))}


def with_media_bytes(draft: dict[str, Any], state: MutableMapping) -> dict[str, Any]:
    """The draft as stored: each medium with its bytes (base64), once, so a reload brings the uploads back."""
    on_screen = {hashlib.sha256(m.data).hexdigest(): m.data
                 for m in state.get(key("media"), state.get(key("restored_media"))) or []}
    stored = {**draft, "media": [{**entry, "base64": _base64(on_screen[entry["sha256"]])}
                                 for entry in draft.get("media") or [] if entry["sha256"] in on_screen]}
    result: DecideResult | None = state.get(key("result"))
    if draft.get("result") and result is not None:
        ran_with = {hashlib.sha256(m.data).hexdigest(): m.data for m in (*result.images, *result.videos)}
        stored["result"] = {**draft["result"], "media": [
            entry if entry["sha256"] in on_screen else {**entry, "base64": _base64(ran_with[entry["sha256"]])}
            for entry in draft["result"]["media"]]}
    return stored


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _media_of(entry: dict[str, Any], data: bytes) -> state_input.Media:
    return state_input.Media(entry["kind"], entry["name"], entry["content_type"], data, entry["width"],
                             entry["height"], entry.get("duration_s"))


def _restored_result(entry: dict[str, Any], on_screen: dict[str, bytes]) -> DecideResult | None:
    """The last result from its draft entry; None when a medium it ran with is missing."""
    media = []
    for medium in entry.get("media") or []:
        data = base64.b64decode(medium["base64"]) if medium.get("base64") else on_screen.get(medium["sha256"])
        if data is None:
            return None
        media.append(_media_of(medium, data))
    images = tuple(m for m in media if m.kind == "image")
    videos = tuple(m for m in media if m.kind == "video")
    request = state_input.build_request(entry["state"], entry["request"]["questions"], images=images, videos=videos,
                                        model=entry["request"]["model"])
    return DecideResult(request={**entry["request"], **request}, response=entry["response"],
                        questions=entry["questions"], state=entry["state"], images=images, videos=videos,
                        schema_name=entry["schema_name"], model_label=entry["model_label"], device=entry["device"],
                        schema_slug=entry.get("schema_slug"), random_weights=bool(entry.get("random_weights")),
                        max_length=entry.get("max_length"), overflow=entry.get("overflow"))


def restore_draft(state: MutableMapping, draft: dict[str, Any]) -> None:
    builder = Builder(state)
    builder.set_rows(draft.get("rows") or [])
    for name in DRAFT_FIELDS:
        if draft.get(name) is not None:
            set_kept(state, key(name), draft[name])
    for name in Builder.LOADED:
        if draft.get(name) is not None:
            state[key(name)] = draft[name]
    set_kept(state, key("library_pick"), draft.get("loaded_slug"))
    media = [_media_of(entry, base64.b64decode(entry["base64"])) for entry in draft.get("media") or []
             if entry.get("base64")]
    state[key("restored_media")] = media
    set_media(state, media)
    result = _restored_result(draft["result"], {hashlib.sha256(m.data).hexdigest(): m.data for m in media}) \
        if draft.get("result") else None
    if result is not None:
        keep_result(state, result)


def save_draft_if_changed(state: MutableMapping, save: Callable[[dict[str, Any]], None]) -> bool:
    draft = draft_of(state)
    if draft == state.get(key("saved_draft")):
        return False
    save(with_media_bytes(draft, state))
    state[key("saved_draft")] = draft
    return True


IMAGE_PREVIEW_PX = 320  # an attached image's preview: enough to see what it shows, not the column's whole width


def image_preview_width(width: int) -> int:
    """The width an attached image is drawn at: its own when smaller than IMAGE_PREVIEW_PX (never enlarged)."""
    return min(width, IMAGE_PREVIEW_PX)


FRAME_THUMBNAIL_PX = 160  # wide enough to tell what a frame shows, four to a row in half a page


def frame_thumbnail(frame: np.ndarray, width: int = FRAME_THUMBNAIL_PX) -> Image.Image:
    """A sampled frame at least `width` px wide, enlarged by whole pixels: exactly what the model read."""
    image = Image.fromarray(np.asarray(frame))
    if image.width >= width:
        return image
    factor = -(-width // image.width)  # ceiling: a whole number of screen pixels per frame pixel
    return image.resize((image.width * factor, image.height * factor), Image.Resampling.NEAREST)


def model_for_run(state: MutableMapping, names: list[str], default: str | None) -> tuple[str | None, str | None]:
    """The model this page's next run uses: the one picked here (or by the draft or link the page opened with)
    while loaded, until the default changes; and, when the pick is not loaded, a note saying which is used."""
    seen = state.get(key("model_default_seen"))
    if seen != default:
        state[key("model_default_seen")] = default
        if seen is not None:  # the default changed: follow it
            forget_kept(state, key("model"))
    picked = kept(state, key("model"))
    chosen = chosen_model(names, picked)
    set_kept(state, key("model"), chosen)
    if picked is None or picked == chosen or chosen is None:
        return chosen, None
    return chosen, f"{picked} is not loaded, so this page's runs use {chosen}: add {picked} in the sidebar to use it."


def chosen_model(names: list[str], picked: str | None) -> str | None:
    """The picked model while it stays loaded, else the default (`names[0]`)."""
    if picked in names:
        return picked
    return names[0] if names else None
