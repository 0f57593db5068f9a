"""The database schema as numbered migrations, tracked in `PRAGMA user_version`.

Each migration is a list of statements run in one transaction. Never edit a released migration: append a new one.
"""

from __future__ import annotations

MIGRATIONS: list[list[str]] = [
    # 1: case sets, cases with media, runs and results
    [
        """CREATE TABLE case_sets (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            schema_name TEXT,
            description TEXT NOT NULL DEFAULT '',
            created_at TEXT NOT NULL
        )""",
        """CREATE TABLE cases (
            id INTEGER PRIMARY KEY,
            case_set_id INTEGER NOT NULL REFERENCES case_sets(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            state_json TEXT NOT NULL,
            expected_json TEXT NOT NULL DEFAULT '{}',
            created_at TEXT NOT NULL
        )""",
        "CREATE INDEX cases_by_set ON cases(case_set_id, position)",
        """CREATE TABLE case_media (
            id INTEGER PRIMARY KEY,
            case_id INTEGER NOT NULL REFERENCES cases(id) ON DELETE CASCADE,
            kind TEXT NOT NULL CHECK (kind IN ('image', 'video')),
            position INTEGER NOT NULL,
            content_type TEXT NOT NULL,
            data BLOB NOT NULL
        )""",
        "CREATE INDEX media_by_case ON case_media(case_id, kind, position)",
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY,
            case_set_id INTEGER NOT NULL REFERENCES case_sets(id),
            schema_json TEXT NOT NULL,
            schema_name TEXT NOT NULL,
            schema_version TEXT NOT NULL,
            model_id TEXT NOT NULL,
            model_revision TEXT,
            status TEXT NOT NULL DEFAULT 'pending'
                CHECK (status IN ('pending', 'running', 'cancelled', 'finished', 'failed')),
            error TEXT,
            settings_json TEXT NOT NULL DEFAULT '{}',
            created_at TEXT NOT NULL,
            started_at TEXT,
            finished_at TEXT
        )""",
        """CREATE TABLE results (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            case_id INTEGER NOT NULL REFERENCES cases(id) ON DELETE CASCADE,
            response_json TEXT,
            error TEXT,
            latency_ms REAL,
            input_tokens INTEGER,
            started_at TEXT NOT NULL,
            finished_at TEXT NOT NULL,
            UNIQUE (run_id, case_id)
        )""",
    ],
    # 2: tags on cases, token counts per result, the review queue with its append-only audit log, review rules
    [
        "ALTER TABLE cases ADD COLUMN tags_json TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE results ADD COLUMN token_counts_json TEXT",
        """CREATE TABLE review_items (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            case_id INTEGER NOT NULL REFERENCES cases(id),
            question_id TEXT NOT NULL,
            question_type TEXT NOT NULL,
            distribution_json TEXT NOT NULL,
            predicted TEXT NOT NULL,
            confidence REAL NOT NULL,
            margin REAL NOT NULL,
            reason TEXT NOT NULL,
            model_id TEXT NOT NULL,
            schema_name TEXT NOT NULL,
            schema_version TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'open'
                CHECK (status IN ('open', 'accepted', 'corrected', 'unknown', 'skipped')),
            label_json TEXT,
            reviewer TEXT,
            version INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            UNIQUE (run_id, case_id, question_id)
        )""",
        "CREATE INDEX review_queue_order ON review_items(run_id, status, margin)",
        """CREATE TABLE review_actions (
            id INTEGER PRIMARY KEY,
            item_id INTEGER NOT NULL REFERENCES review_items(id),
            reviewer TEXT NOT NULL,
            at TEXT NOT NULL,
            action TEXT NOT NULL CHECK (action IN ('accept', 'correct', 'unknown', 'skip', 'undo')),
            before_json TEXT NOT NULL,
            after_json TEXT NOT NULL,
            undoes_action_id INTEGER REFERENCES review_actions(id)
        )""",
        "CREATE INDEX actions_by_reviewer ON review_actions(reviewer, id)",
        """CREATE TRIGGER review_actions_append_only_update BEFORE UPDATE ON review_actions
           BEGIN SELECT RAISE(ABORT, 'review_actions is an append-only audit log: rows cannot be changed'); END""",
        """CREATE TRIGGER review_actions_append_only_delete BEFORE DELETE ON review_actions
           BEGIN SELECT RAISE(ABORT, 'review_actions is an append-only audit log: rows cannot be deleted'); END""",
        """CREATE TABLE review_rules (
            schema_name TEXT PRIMARY KEY,
            rules_json TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""",
    ],
    # 3: soft delete with an append-only change log, content hashes so a re-import adds nothing twice, a lease so
    # one process at a time works on a run, drafts of the Decide page per browser session, reviewer comments
    [
        "ALTER TABLE case_sets ADD COLUMN deleted_at TEXT",
        "ALTER TABLE cases ADD COLUMN deleted_at TEXT",
        "ALTER TABLE runs ADD COLUMN deleted_at TEXT",
        "ALTER TABLE cases ADD COLUMN content_hash TEXT",
        "CREATE INDEX cases_by_hash ON cases(case_set_id, content_hash)",
        "ALTER TABLE runs ADD COLUMN lease_owner TEXT",
        "ALTER TABLE runs ADD COLUMN lease_expires_at REAL",
        "ALTER TABLE review_actions ADD COLUMN comment TEXT",
        """CREATE TABLE change_log (
            id INTEGER PRIMARY KEY,
            at TEXT NOT NULL,
            who TEXT NOT NULL DEFAULT '',
            action TEXT NOT NULL CHECK (action IN ('delete', 'restore')),
            kind TEXT NOT NULL CHECK (kind IN ('case_set', 'case', 'run', 'schema')),
            object_id TEXT NOT NULL,
            label TEXT NOT NULL,
            data_json TEXT
        )""",
        """CREATE TRIGGER change_log_append_only_update BEFORE UPDATE ON change_log
           BEGIN SELECT RAISE(ABORT, 'change_log is an append-only audit log: rows cannot be changed'); END""",
        """CREATE TRIGGER change_log_append_only_delete BEFORE DELETE ON change_log
           BEGIN SELECT RAISE(ABORT, 'change_log is an append-only audit log: rows cannot be deleted'); END""",
        """CREATE TABLE drafts (
            key TEXT PRIMARY KEY,
            data_json TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""",
    ],
    # 4: schema history: every saved content of a library schema, append-only; a run links the version it ran
    [
        """CREATE TABLE schema_versions (
            id INTEGER PRIMARY KEY,
            slug TEXT NOT NULL,
            number INTEGER NOT NULL,
            content_hash TEXT NOT NULL,
            run_hash TEXT NOT NULL,
            schema_json TEXT NOT NULL,
            action TEXT NOT NULL,
            who TEXT NOT NULL DEFAULT '',
            created_at TEXT NOT NULL,
            UNIQUE (slug, number)
        )""",
        "CREATE INDEX schema_versions_by_run_hash ON schema_versions(run_hash)",
        """CREATE TRIGGER schema_versions_append_only_update BEFORE UPDATE ON schema_versions
           BEGIN SELECT RAISE(ABORT, 'schema_versions is append-only: a version cannot be changed'); END""",
        """CREATE TRIGGER schema_versions_append_only_delete BEFORE DELETE ON schema_versions
           BEGIN SELECT RAISE(ABORT, 'schema_versions is append-only: a version cannot be deleted'); END""",
        "ALTER TABLE runs ADD COLUMN schema_version_id INTEGER REFERENCES schema_versions(id)",
    ],
    # 5: calibrations fitted on a run's labelled cases, kept with the schema version and the model of that run
    [
        """CREATE TABLE calibrations (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            schema_name TEXT NOT NULL,
            schema_version_id INTEGER REFERENCES schema_versions(id),
            model_id TEXT NOT NULL,
            payload_json TEXT NOT NULL,
            created_at TEXT NOT NULL
        )""",
    ],
    # 6: a case's own id from the file it came from (a ticket number): kept apart from the state the model reads
    [
        "ALTER TABLE cases ADD COLUMN source_id TEXT",
    ],
    # 7: schema sweeps: a base schema and its variants over a case set's labelled cases (frozen when it starts), one
    # answer per case and variant, and per finished case how many states computing it prefilled
    [
        """CREATE TABLE sweeps (
            id INTEGER PRIMARY KEY,
            case_set_id INTEGER NOT NULL REFERENCES case_sets(id),
            schema_json TEXT NOT NULL,
            schema_name TEXT NOT NULL,
            schema_version_id INTEGER REFERENCES schema_versions(id),
            model_id TEXT NOT NULL,
            model_revision TEXT,
            settings_json TEXT NOT NULL DEFAULT '{}',
            status TEXT NOT NULL DEFAULT 'pending'
                CHECK (status IN ('pending', 'running', 'cancelled', 'finished', 'failed')),
            error TEXT,
            created_at TEXT NOT NULL,
            started_at TEXT,
            finished_at TEXT
        )""",
        """CREATE TABLE sweep_variants (
            sweep_id INTEGER NOT NULL REFERENCES sweeps(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            name TEXT NOT NULL,
            kind TEXT NOT NULL,
            question TEXT,
            schema_json TEXT NOT NULL,
            relabel_json TEXT NOT NULL DEFAULT '{}',
            PRIMARY KEY (sweep_id, position),
            UNIQUE (sweep_id, name)
        )""",
        """CREATE TABLE sweep_cases (
            sweep_id INTEGER NOT NULL REFERENCES sweeps(id) ON DELETE CASCADE,
            case_id INTEGER NOT NULL REFERENCES cases(id),
            position INTEGER NOT NULL,
            state_prefills INTEGER,
            compute_ms REAL,
            finished_at TEXT,
            PRIMARY KEY (sweep_id, case_id)
        )""",
        """CREATE TABLE sweep_answers (
            sweep_id INTEGER NOT NULL REFERENCES sweeps(id) ON DELETE CASCADE,
            case_id INTEGER NOT NULL REFERENCES cases(id),
            variant INTEGER NOT NULL,
            response_json TEXT,
            error TEXT,
            PRIMARY KEY (sweep_id, case_id, variant)
        )""",
    ],
    # 8: a schema version's note: where a version came from when its action alone does not say (an adopted sweep's
    # result names the sweep and its figures)
    [
        "ALTER TABLE schema_versions ADD COLUMN note TEXT NOT NULL DEFAULT ''",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)
