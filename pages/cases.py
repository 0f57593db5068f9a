"""Case sets: create, import with a column mapping, edit, export. Rendering only (workbench_ui.cases_view)."""

from __future__ import annotations

import streamlit as st

from clef_workbench import case_table, importing
from workbench_ui import cases_view as view
from workbench_ui import shell, units
from workbench_ui.cases_view import NO_SCHEMA, NOT_MAPPED

shell.render_shell(__file__)
K = shell.page_key("cases")
DETECTED = "detected"

st.title("Case sets")
st.caption("A case set is a named list of records (state, images, videos, expected answers, tags) to run against a "
           "schema. Media are stored with the case in the workbench database.")
store = shell.get_store()
library = shell.get_library()
schema_slugs = library.slugs()
schema_choices = [NO_SCHEMA, *schema_slugs]


def flash(kind: str, message: str, *, undo: tuple[str, int] | None = None) -> None:
    st.session_state[K("flash")] = (kind, message, undo)


def undo_delete(kind: str, object_id: int | list[int]) -> None:
    outcome, message = view.restore_deleted(store, kind, object_id)
    if kind == "case_set" and outcome == "success":
        shell.set_widget(K("selected"), object_id)
    flash(outcome, message)


def show_problems(problems: list[str], *, stage: str) -> None:
    """The problems of a refused save (an error) or of a chosen file (a warning)."""
    heading = view.problems_heading(len(problems), stage=stage)
    if stage == "save":
        st.error(heading)
    else:
        st.warning(heading, icon=":material/warning:")
    st.markdown(view.problems_markdown(problems))


shell.show_message(K("flash"), undo_delete)
if deleted_sets := store.list_case_sets(deleted=True):
    with st.expander(f"Deleted case sets ({len(deleted_sets)})", icon=":material/restore_from_trash:"):
        for deleted in deleted_sets[:20]:
            cols = st.columns([5, 1], vertical_alignment="center")
            cols[0].write(view.deleted_set_label(deleted))
            cols[1].button("Restore", key=K(f"restore.{deleted['id']}"), on_click=undo_delete,
                           args=("case_set", deleted["id"]))
top = st.columns([3, 2])
with top[1]:
    if st.button("Load the example case sets", key=K("load_examples"), icon=":material/library_add:",
                 help="One example set per shipped schema, with expected answers."):
        st.success(view.load_examples(store, library))
    with st.popover("New case set", icon=":material/add:"):
        with st.form(K("create_form"), clear_on_submit=True):
            name = st.text_input("Name", key=K("new_name"))
            schema_pick = st.selectbox("Schema it is meant for", schema_choices, key=K("new_schema"))
            description = st.text_area("Description", key=K("new_description"))
            if st.form_submit_button("Create"):
                new_id, refused = units.refusal(store.create_case_set, name, description=description,
                                                schema_name=None if schema_pick == NO_SCHEMA else schema_pick)
                if refused:
                    st.error(refused)
                else:
                    shell.set_widget(K("selected"), new_id)
                    st.success(f"Created case set #{new_id}.")

sets = store.list_case_sets()
if not sets:
    st.info("No case sets yet. Create one, load the examples, or save cases from the Decide page.")
    st.stop()
labels = {s["id"]: view.case_set_label(s) for s in sets}
with top[0]:
    case_set_id = shell.pick_id(list(labels), K("selected"), "Case set", labels.get, param="set", what="case set")
    if case_set_id is None:  # the link names a case set that is not here: said above
        st.stop()
case_set = store.get_case_set(case_set_id)
schema, schema_warning = view.case_set_schema(library, case_set["schema_name"])
if schema_warning:
    st.warning(schema_warning)
st.caption(view.case_set_caption(case_set))
if st.button("Run this case set", key=K("run_set"), icon=":material/play_arrow:",
             help="Opens the Runs page's “Start a run” with this case set and its schema"):
    shell.set_widget(shell.RUNS_START_SET, case_set_id)
    st.session_state[shell.RUNS_START_OPEN] = True
    st.switch_page("pages/runs.py")

# keyed and tracked: the open tab survives reruns whose layout above it changes (a message appearing or going)
tab_cases, tab_import, tab_export, tab_settings = st.tabs(["Cases", "Import", "Export", "Settings"], key=K("tabs"),
                                                         on_change="rerun")

with tab_cases:
    st.caption("Edit states (text, or JSON for structured states), expected answers as a JSON object "
               "`{question: answer}` (choice: option id, yes/no: true/false, score: level number) and tags. "
               "Add rows at the bottom; delete rows with the row menu. Nothing is written until you save.")
    frame = case_table.editor_frame(store, case_set_id)
    # after a refused deletion, a new editor: the edits with the refused rows back
    restored = st.session_state.get(K(f"editor_restored.{case_set_id}"))
    editor_key = K(f"editor.{case_set_id}" if restored is None else f"editor.{case_set_id}.{restored[0]}")
    edited = st.data_editor(
        frame if restored is None else restored[1], key=editor_key, num_rows="dynamic", hide_index=True,
        width="stretch",
        column_config={
            "id": st.column_config.NumberColumn("id", disabled=True),
            "state": st.column_config.TextColumn("state", width="large", required=True),
            "expected": st.column_config.TextColumn("expected (JSON)", width="medium"),
            "tags": st.column_config.TextColumn("tags"),
            "images": st.column_config.NumberColumn("images", disabled=True),
            "videos": st.column_config.NumberColumn("videos", disabled=True),
        },
    )
    if st.button("Save changes", key=K("save_edits"), icon=":material/save:"):
        edits = view.save_edits(store, case_set_id, edited, schema)
        if isinstance(edits, view.SaveRefused) and edits.kept_case_ids:
            generation = 1 + (0 if restored is None else restored[0])
            st.session_state[K(f"editor_restored.{case_set_id}")] = (
                generation, case_table.with_rows_restored(frame, edited, edits.kept_case_ids))
            flash("error", view.kept_rows_message(edits))
            st.rerun()
        elif isinstance(edits, view.SaveRefused):
            show_problems(edits.problems, stage="save")
        else:
            st.session_state.pop(editor_key, None)
            st.session_state.pop(K(f"editor_restored.{case_set_id}"), None)
            flash("success" if edits.changed else "info", edits.summary(),
                  undo=("cases", edits.deleted) if edits.deleted else None)
            st.rerun()


def import_file(case_set_id: int, case_set: dict, schema: dict | None) -> None:
    """The Import tab: a file, how to read it, its mapping, its problems and preview, then import."""
    # a new uploader after each import: replacing a file raced the page's rerun in the browser
    imports_done = st.session_state.get(K("imports_done"), 0)
    upload = st.file_uploader("CSV, tab-separated text, JSONL or Excel file",
                              type=[suffix[1:] for suffix in importing.FILE_SUFFIXES], key=K(f"upload.{imports_done}"),
                              help="JSONL: one object per line with state, and optionally expected, tags, images and "
                                   "videos (data URLs). CSV, text and Excel: map the columns below. Rows already "
                                   "in the case set are skipped.")
    source = None if upload is None else read_upload(upload)
    if source is None:
        return
    mapping = None if source.kind == "jsonl" else choose_mapping(source.columns, schema, upload.file_id)
    bad_rows = [] if mapping is None else importing.bad_rows(source, mapping)
    skip_bad_rows = bool(bad_rows) and offer_to_skip(bad_rows, upload.file_id)
    if mapping is not None and not (mapping.state_columns or mapping.state_text_column):
        return  # without a state the advice above says what to choose
    parsed, problems = view.parse_file(source, mapping, schema, skip_bad_rows)
    if problems:
        show_problems(problems, stage="file" if source.kind == "jsonl" else "cells")
    if not parsed:
        return
    st.markdown(f"**Preview** — {len(parsed)} case(s)")
    st.dataframe(view.preview_rows(parsed), hide_index=True, width="stretch")
    if st.button(f"Import {len(parsed)} cases", key=K("do_import"), type="primary", icon=":material/upload:"):
        added, refused = view.import_parsed(store, case_set_id, parsed)
        if added is None:
            st.error(f"Nothing imported: {refused}")
            return
        st.session_state.pop(K(f"editor.{case_set_id}"), None)
        st.session_state.pop(K(f"editor_restored.{case_set_id}"), None)
        st.session_state[K("imports_done")] = imports_done + 1
        flash(*view.imported_message(case_set["name"], len(parsed), len(added),
                                     [b.row for b in bad_rows] if skip_bad_rows else None))
        st.rerun()


def read_upload(upload):
    """The file read with the encoding and delimiter chosen; None, its problems shown, when unreadable."""
    kind = importing.file_kind(upload.name)
    read_cols = st.columns(2)
    encoding = delimiter = DETECTED
    if kind != "xlsx":
        encoding = read_cols[0].selectbox(
            "Encoding", [DETECTED, *importing.ENCODINGS], key=K(f"read.encoding.{upload.file_id}"),
            format_func=lambda codec: "Detected" if codec == DETECTED else importing.ENCODINGS[codec],
            help="The encoding the file was saved in; change it if the preview shows wrong characters.")
    if kind == "delimited":
        delimiter = read_cols[1].selectbox(
            "Delimiter", [DETECTED, *importing.DELIMITERS], key=K(f"read.delimiter.{upload.file_id}"),
            format_func=lambda d: "Detected" if d == DETECTED else importing.DELIMITERS[d].capitalize())
    source, problems = view.read_file(upload.name, upload.getvalue(), None if encoding == DETECTED else encoding,
                                      None if delimiter == DETECTED else delimiter)
    if problems:
        show_problems(problems, stage="read")
    else:
        st.caption(view.read_caption(source))
    return source


def choose_mapping(columns: list[str], schema: dict | None, file_id: str):
    """Which columns are the expected answers, the tags, the source id and the state. Every choice is the file's own
    (its key carries `file_id`): a file put in another's place gets its own guesses, not the other's choices."""
    st.write(f"Columns: {', '.join(f'`{c}`' for c in columns)}")
    questions = list((schema or {}).get("questions", {}))
    chosen_columns = view.ImportMapping(columns, questions,
                                        answer_names=[] if questions else view.library_question_ids(library))
    if questions:
        st.markdown("**Expected answers** (column per question)")
        guessed = importing.guess_expected_columns(columns, questions)
        cols = st.columns(min(3, len(questions)))
        for index, question_id in enumerate(questions):
            picked = cols[index % len(cols)].selectbox(
                question_id, [NOT_MAPPED, *columns], index=view.mapped_index(columns, guessed.get(question_id)),
                key=K(f"map.expected.{file_id}.{question_id}"))
            if picked != NOT_MAPPED:
                chosen_columns.expected[picked] = question_id
    else:
        st.caption("This case set has no schema, so expected answers cannot be mapped (set one under Settings).")
    label_cols = st.columns(2)
    chosen_columns.tags_column = label_cols[0].selectbox(
        "Tags column", [NOT_MAPPED, *columns], key=K(f"map.tags.{file_id}"), index=view.mapped_index(columns, "tags"))
    chosen_columns.id_column = label_cols[1].selectbox(
        "Source id column", [NOT_MAPPED, *columns], key=K(f"map.id.{file_id}"),
        index=view.mapped_index(columns, next(iter(importing.id_like_columns(columns)), None)),
        help="Each case keeps this value as its own id (a ticket number), shown in runs, review and exports. The "
             "model does not read it.")
    return choose_state(chosen_columns, file_id)


def choose_state(chosen_columns: view.ImportMapping, file_id: str):
    """The state: fields from chosen columns or one column's text; a warning when answers leak into it."""
    columns = chosen_columns.columns
    state_mode = st.radio("State", view.STATE_MODES, horizontal=True, key=K(f"map.state_mode.{file_id}"))
    if state_mode == view.FIELDS_FROM_COLUMNS:
        candidates = chosen_columns.suggested_state()
        state_key = K(f"map.state.{file_id}")
        chosen = st.multiselect("Columns that become state fields (a.b nests)", columns, key=state_key,
                                placeholder="Choose the columns the model reads",
                                help="Only the columns chosen here are sent to the model.")
        if candidates and not chosen:
            st.button(view.suggest_button_label(candidates), key=K(f"map.state_suggest.{file_id}"),
                      on_click=st.session_state.update, args=({state_key: candidates},))
        mapping = chosen_columns.mapping(state_columns=chosen)
        if not chosen:
            st.info(view.state_choice_advice(candidates), icon=":material/arrow_upward:")
    else:
        state_column = st.selectbox("State column", columns, key=K(f"map.state_text.{file_id}"))
        mapping = chosen_columns.mapping(state_text_column=state_column)
        chosen = [state_column]
    state_warning = chosen_columns.state_warning(chosen)
    if state_warning and state_warning[0] == "warning":
        st.warning(state_warning[1], icon=":material/warning:")
    elif state_warning:
        st.caption(state_warning[1])
    return mapping


def offer_to_skip(bad_rows: list, file_id: str) -> bool:
    """The rows that cannot be imported, and the choice to import the others (False until chosen)."""
    with st.container(border=True, key=K("bad_rows")):
        st.warning(f"{len(bad_rows)} row(s) cannot be imported as cases (rows count the header as row 1):",
                   icon=":material/warning:")
        st.markdown(view.problems_markdown(bad_rows))
        return st.checkbox(f"Skip these {len(bad_rows)} row(s) and import the others",
                           key=K(f"skip_bad_rows.{file_id}"))


with tab_import:
    import_file(case_set_id, case_set, schema)

with tab_export:
    files = view.export_files(store, case_set)
    st.download_button("Download JSONL (with media)", files.jsonl, file_name=f"{files.stem}.jsonl",
                       mime="application/jsonl", key=K("export_jsonl"), icon=":material/download:", on_click="ignore")
    st.download_button("Download CSV (media counted, not included)", files.csv, file_name=f"{files.stem}.csv",
                       mime="text/csv", key=K("export_csv"), icon=":material/download:", on_click="ignore")

with tab_settings:
    with st.form(K(f"settings.{case_set_id}")):
        new_name = st.text_input("Name", value=case_set["name"])
        new_schema = st.selectbox("Schema", schema_choices,
                                  index=schema_choices.index(view.schema_pick(case_set, schema_slugs)))
        new_description = st.text_area("Description", value=case_set["description"])
        if st.form_submit_button("Save settings"):
            _, refused = units.refusal(store.update_case_set, case_set_id, name=new_name, description=new_description,
                                       schema_name="" if new_schema == NO_SCHEMA else new_schema)
            if refused:
                st.error(refused)
            else:
                st.rerun()
    if st.button("Delete this case set", key=K("delete"), icon=":material/delete:"):
        refusal = view.delete_refusal(case_set, store.list_runs(case_set_id))
        if refusal:  # refused anyway: say why at once rather than ask first
            st.error(refusal)
        else:
            st.session_state[K("confirm_delete")] = case_set_id
    if st.session_state.get(K("confirm_delete")) == case_set_id:
        question = f"Delete “{case_set['name']}” and its {case_set['case_count']} case(s)? You can undo this."
        if shell.confirm(question, K, K("confirm_delete")):
            _, refused = units.refusal(store.delete_case_set, case_set_id)
            if refused:
                st.error(refused)
            else:
                shell.forget_pick(K("selected"), "set")
                flash("success", f"Deleted case set “{case_set['name']}”.", undo=("case_set", case_set_id))
                st.rerun()
