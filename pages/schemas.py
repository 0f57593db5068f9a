"""Schemas: the library — browse, lint, create, edit, duplicate, delete (undo), import, export, history."""

from __future__ import annotations

import streamlit as st

from clef_workbench import schemas
from workbench_ui import links, shell, units
from workbench_ui import schemas_view as view
from workbench_ui.decide_actions import SCHEMA_PARAM

shell.render_shell(__file__)
K = shell.page_key("schemas")
library = shell.get_library()


def flash(kind: str, message: str, place: str = "top", *, undo: str | None = None) -> None:
    """A message for the next run, next to the action that caused it (`place`), or at the top with its Undo."""
    st.session_state[K(f"flash.{place}")] = (kind, message, None if undo is None else (undo,))


def editor_key(slug: str) -> str:
    return K(f"json.{slug}")


def reset_editor(slug: str) -> None:
    """The editor back to the file as it is, and its last save's problems gone."""
    shell.forget_widget(editor_key(slug))
    st.session_state.pop(K("edit_problems"), None)


def open_schema(slug: str, message: str, place: str = "top") -> None:
    """After an action: `slug` on screen with its file as it is now in the editor, and what was done."""
    shell.set_widget(K("selected"), slug)
    reset_editor(slug)
    flash("success", message, place)


def create_schema() -> None:
    name = st.session_state.get(K("new_name"), "").strip()
    if not name:
        flash("error", "Give the new schema a name.", "create")
        return
    slug = library.create(view.starter_schema(name, st.session_state.get(K("new_description"), "")))
    open_schema(slug, f"Created {slug}.json with one starter question: edit it below or open it in Decide.", "create")


def save_json(slug: str) -> None:
    text = st.session_state.get(editor_key(slug), "")
    try:
        schema = schemas.Schema.from_json(text, source=f"{slug}.json")
        saved = library.update(slug, schema)
    except schemas.SchemaError as exc:
        st.session_state[K("edit_problems")] = (slug, [p.msg for p in exc.problems])
        return
    reset_editor(slug)
    flash("success", f"Saved {slug}.json (version {saved.version}).", "edit")


def duplicate_schema(slug: str) -> None:
    new_name = st.session_state.get(K(f"dup_name.{slug}"), "").strip() or None
    new_slug, refused = units.refusal(library.duplicate, slug, new_name)
    if refused:
        flash("error", refused, "duplicate")
    else:
        open_schema(new_slug, f"Duplicated as {new_slug}.json.", "duplicate")


def delete_schema(slug: str) -> None:
    if not st.session_state.get(K(f"confirm_delete.{slug}")):
        flash("error", view.delete_unconfirmed_message(slug), "delete")
        return
    # the history keeps every version and the delete is logged: Undo writes it back
    _, refused = units.refusal(library.delete, slug)
    if refused:
        flash("error", refused, "delete")
        return
    shell.forget_pick(K("selected"), SCHEMA_PARAM)
    reset_editor(slug)
    flash("success", f"Deleted {slug}.json.", undo=slug)


def restore_schema(slug: str, number: int | None = None) -> None:
    """Undo a delete (number None), or make an old version the current one (a new version)."""
    restored, refused = units.refusal(library.restore, slug, number)
    if refused:
        flash("error", f"Not restored: {refused}")
    else:
        open_schema(slug, view.restored_message(slug, number, restored))


def import_schema() -> None:
    upload = st.session_state.get(K("import_file"))
    if upload is None:
        flash("error", "Choose a JSON file to import first.", "import")
        return
    slug, refused = units.refusal(library.import_json, upload.getvalue(), filename=upload.name,
                                  overwrite=bool(st.session_state.get(K("import_overwrite"))))
    if refused:
        flash("error", f"Not imported. {refused}", "import")
    else:
        open_schema(slug, f"Imported {upload.name} as {slug}.json.", "import")


st.title("Schema library")
st.caption(f"Folder: `{library.directory}` (set CLEF_SCHEMAS_DIR to change). One JSON file per schema, "
           "indented and in a fixed key order, so changes diff cleanly in git.")

# always there: a message appearing must not move the tabs below (they would jump back to the first)
with st.container():
    shell.show_message(K("flash.top"), restore_schema)

shown = view.listing(library)
if shown.entries:
    st.dataframe(shown.table(), hide_index=True, width="stretch")
else:
    st.info("The library is empty: create a schema or import one below.")

with st.expander("Create a new schema", icon=":material/add:"):
    st.text_input("Name", key=K("new_name"), placeholder="Refund request triage")
    st.text_area("Description", key=K("new_description"), height=68)
    st.button("Create", key=K("create"), on_click=create_schema)
    shell.show_message(K("flash.create"))

with st.expander("Import a schema file", icon=":material/upload:"):
    st.caption("A schema file exported from here, a bare System One questions map, or a whole request (its "
               "questions are taken). The file name is never used as a path.")
    st.file_uploader("JSON file", type=["json"], key=K("import_file"))
    st.checkbox("Replace a schema with the same name", key=K("import_overwrite"))
    st.button("Import", key=K("import"), on_click=import_schema)
    shell.show_message(K("flash.import"))

deleted = library.deleted()
deleted_area = st.container()  # always there, as the flash area above
if deleted:
    with deleted_area.expander(f"Deleted schemas ({len(deleted)})", icon=":material/delete:"):
        st.caption("Their versions are kept in the workbench's database; restoring writes the latest one back.")
        for gone in deleted:
            cols = st.columns([4, 1], vertical_alignment="center")
            cols[0].write(f"{gone}.json")
            cols[1].button("Restore", key=K(f"restore_deleted.{gone}"), on_click=restore_schema, args=(gone,))

if not shown.entries:
    st.stop()

slugs = shown.slugs
# a session's first visit opens the one its link names (?schema=), else the last edited
first_visit = shell.kept_value(K("selected")) is None
linked = st.query_params.get(SCHEMA_PARAM) if first_visit else None
if linked is not None and linked not in slugs:  # no other schema in its place: one edited by mistake
    st.error(links.missing_schema(linked, slugs, "the button below"), icon=":material/link_off:")
    if st.button("Open the library", key=K("not_found_open"), icon=":material/arrow_forward:"):
        st.query_params.pop(SCHEMA_PARAM, None)
        st.rerun()
    st.stop()
shell.set_widget(K("selected"), view.shown_schema(
    slugs, linked=linked, kept=shell.kept_value(K("selected")),
    last_edited=view.last_edited(library, slugs)))
slug = shell.kept_widget(st.selectbox, "Schema", K("selected"), slugs[0], options=slugs,
                         format_func=shown.label)
st.query_params[SCHEMA_PARAM] = slug  # the address bar links to the schema on screen
entry = shown.entry(slug)

if entry.problem:
    st.error(f"This file does not load: {entry.problem}")
schema = shown.schemas.get(slug)

# keyed: a save's message above the tabs must not send the user back to the first tab
tabs = st.tabs(["Overview and lint", "Edit JSON", "History", "Duplicate, delete, export"], key=K("tabs"))
with tabs[0]:
    if schema is not None:
        st.markdown(view.overview(schema))
        if schema.description:
            st.write(schema.description)
        st.dataframe(view.question_rows(schema), hide_index=True, width="stretch")
        problems = shown.lint.get(slug, [])
        if not problems:
            st.success("Lint: no warnings.")
        for problem in problems:
            (st.error if problem.severity == "error" else st.warning)(problem.msg)
        if st.button("Open in Decide", key=K("open_decide"), type="primary", icon=":material/psychology:"):
            st.session_state["decide.pending_load"] = slug
            st.switch_page("pages/decide.py")

with tabs[1]:
    # kept: an edit survives opening another schema and coming back, until saved or discarded; the file is read
    # only when the editor holds nothing of this schema
    if shell.kept_value(editor_key(slug)) is None:
        shell.set_widget(editor_key(slug), library.path_of(slug).read_text(encoding="utf-8") if entry.problem
                         else library.export_json(slug))
    shell.kept_widget(st.text_area, "Schema file", editor_key(slug), height=480, label_visibility="collapsed")
    edit_problems = st.session_state.get(K("edit_problems"))
    if edit_problems and edit_problems[0] == slug:
        for msg in edit_problems[1]:
            st.error(msg)
    cols = st.columns(2)
    cols[0].button("Save changes", key=K("save"), type="primary", on_click=save_json, args=(slug,))
    cols[1].button("Discard changes", key=K("discard"), on_click=reset_editor, args=(slug,))
    shell.show_message(K("flash.edit"))
    st.caption("The version goes up by one when the questions change.")

with tabs[2]:
    versions = shell.get_store().list_schema_versions(slug) if entry.problem is None else []
    if not versions:
        st.info("No history yet: fix the file so that it loads.")
    else:
        st.dataframe(view.version_rows(versions), hide_index=True, width="stretch",
                     column_config={"note": st.column_config.TextColumn(width="large")})
        numbers = [v["number"] for v in versions]
        cols = st.columns(2)
        # keyed by the latest number too: a new save resets the pair to (the one before, the latest)
        old_number = cols[0].selectbox("From version", numbers, index=view.default_diff_from(numbers),
                                       key=K(f"diff_from.{slug}.{numbers[0]}"))
        new_number = cols[1].selectbox("To version", numbers, index=0, key=K(f"diff_to.{slug}.{numbers[0]}"))
        diff = view.version_diff(versions, old_number, new_number)
        st.markdown(f"**{diff.title}**")
        st.code(diff.text, language=None, wrap_lines=True)
        if diff.rows:
            st.dataframe(diff.rows, hide_index=True, width="stretch")
        st.caption("[-removed-]{+added+} marks reworded text. Restoring a version saves it as a new version, so "
                   "nothing is lost; runs keep the version they ran.")
        if old_number != numbers[0]:
            st.button(f"Restore version {old_number}", key=K("restore_version"), icon=":material/history:",
                      on_click=restore_schema, args=(slug, old_number))

with tabs[3]:
    st.text_input("Name of the copy", key=K(f"dup_name.{slug}"), placeholder=f"{entry.name} (copy)")
    st.button("Duplicate", key=K("duplicate"), on_click=duplicate_schema, args=(slug,))
    shell.show_message(K("flash.duplicate"))
    st.divider()
    if schema is not None:
        st.download_button("Export (download JSON)", library.export_json(slug), file_name=f"{slug}.json",
                           mime="application/json", key=K("export"))
    st.divider()
    ticked = st.checkbox(f"Yes, delete {slug}.json", key=K(f"confirm_delete.{slug}"))
    st.button("Delete", key=K("delete"), on_click=delete_schema, args=(slug,), disabled=not ticked,
              help=None if ticked else f"Tick “Yes, delete {slug}.json” first")
    shell.show_message(K("flash.delete"))
