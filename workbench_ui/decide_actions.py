"""What the Decide page's buttons and first run do to the session state, the URL, the library and the drafts."""

from __future__ import annotations

import secrets

import streamlit as st

from clef_workbench import schemas
from workbench_ui import decide_model as vm
from workbench_ui import links, schema_rows
from workbench_ui.shell import get_library, get_store, model_manager

K = vm.key
PREFERRED_START_SCHEMA = "support-ticket-routing"
DRAFT_PARAM = "draft"  # the URL parameter naming this browser session's draft: a reload brings the editors back
SCHEMA_PARAM = "schema"  # the library schema on screen: a link opens it in a new session
SCHEMAS_PAGE_PICK = "schemas.selected"  # the Schemas page's selected schema


def builder() -> vm.Builder:
    return vm.Builder(st.session_state)


def draft_key(token: str) -> str:
    return f"decide:{token}"


def save_draft() -> None:
    """Keep the editors for a reload of this browser session (when changed; none with a read-only database)."""
    store = get_store()
    if not store.read_only:
        vm.save_draft_if_changed(st.session_state,
                                 lambda draft: store.save_draft(draft_key(st.session_state[K("draft_token")]), draft))


def load_schema(slug: str) -> None:
    """Callback: put a library schema into the builder; the state typed stays."""
    try:
        schema = get_library().load(slug)
    except schemas.SchemaError as exc:
        st.session_state[K("library_error")] = str(exc)
        return
    builder().load(slug, schema)
    st.session_state.pop(K("library_error"), None)
    st.session_state.pop(K("confirm_load"), None)


def ask_load(slug: str) -> None:
    """Callback of Load: loads at once unless the questions on screen have unsaved changes; then asks first."""
    if builder().unsaved_changes():
        st.session_state[K("confirm_load")] = slug
    else:
        load_schema(slug)


def new_schema() -> None:
    builder().new_schema()
    st.session_state.pop(K("confirm_load"), None)


def init_page() -> None:
    """A session's first run: the draft the URL names, a linked case, else the preferred schema (or a pending one)."""
    pending = st.session_state.pop(K("pending_load"), None)
    # a token of its own: a session opened from another's draft never overwrites it
    token = st.session_state.setdefault(K("draft_token"), secrets.token_urlsafe(9))
    if K("uids") not in st.session_state:
        linked = st.query_params.get(DRAFT_PARAM)
        draft = get_store().load_draft(draft_key(linked)) if linked else None
        case_link = links.linked_ids(st.query_params) if draft is None else None
        sweep_link = links.linked_sweep_case(st.query_params) if draft is None else None
        if case_link:  # a case of a run (the Runs page's results, or a link someone sent): that state and schema
            draft, note = links.case_draft(get_store(), get_library(), *case_link,
                                           random_weights=model_manager().random_weights)
        elif sweep_link:  # a flipped case of a sweep (the Sweeps page): that state and the variant's questions
            draft, note = links.sweep_case_draft(get_store(), get_library(), *sweep_link)
        if case_link or sweep_link:
            st.session_state[K("link_note")] = ("info" if draft else "warning", note)
        if draft is not None:
            vm.restore_draft(st.session_state, draft)
        else:
            st.session_state[K("uids")] = []
            if pending is None:
                slugs = get_library().slugs()
                linked = st.query_params.get(SCHEMA_PARAM)
                # a link to a schema that is not in the library opens none in its place (the page says so)
                pending = (linked if linked in slugs else None if linked else PREFERRED_START_SCHEMA
                           if PREFERRED_START_SCHEMA in slugs else (slugs[0] if slugs else None))
    for name in ("run", "case", "sweep", "variant"):  # opened once; from here on the draft is what the URL names
        st.query_params.pop(name, None)
    if st.query_params.get(DRAFT_PARAM) != token:
        st.query_params[DRAFT_PARAM] = token
    if pending:
        load_schema(pending)


def save_schema(update: bool) -> None:
    questions, problems = schema_rows.rows_to_questions(builder().rows())
    if any(p.severity == "error" for p in problems):
        st.session_state[K("save_flash")] = ("error", "Fix the errors in the questions first; nothing was saved.")
        return
    library = get_library()
    slug = builder().loaded_slug if update else None
    schema = builder().schema_to_save(questions, st.session_state.get(K("schema_name"), ""),
                                      st.session_state.get(K("schema_description"), ""), update=update)
    try:
        if slug:
            schema = library.update(slug, schema, expected_version=builder().loaded_version)
            flash = ("success", f"Updated {slug}.json (version {schema.version}).")
        else:
            slug = library.create(schema)
            flash = ("success", f"Saved as {slug}.json in the schema library (Schemas page).")
    except schemas.SchemaError as exc:
        flash = ("error", str(exc))
    else:
        builder().saved_as(slug, schema)
        vm.set_kept(st.session_state, SCHEMAS_PAGE_PICK, slug)  # the Schemas page opens on the schema edited last
    st.session_state[K("save_flash")] = flash
