"""The schema library: one human-readable, git-diffable JSON file per schema in a folder (default ./schemas), in
the format clef_workbench.schemas describes, with the history of every schema kept in the workbench's store."""

from __future__ import annotations

import builtins
import dataclasses
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_workbench.schemas import (
    Schema,
    SchemaError,
    SchemaProblem,
    loads_schema_json,
    plain_json,
    validate_schema_dict,
)
from clef_workbench.settings import WorkbenchSettings

SCHEMA_FILE_SUFFIX = ".json"
SLUG_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,79}")
MAX_IMPORT_BYTES = 2 * 1024 * 1024  # a 64-question schema with 255 long options each stays far below this


def _content(schema: Schema) -> dict[str, Any]:
    """What a save can change: everything but the version number."""
    data = schema.to_dict()
    data.pop("version")
    return data


def slugify(name: str) -> str:
    """A safe file stem for a schema name: lowercase ASCII letters, digits and dashes, at most 80 characters."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode("ascii")
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_name.lower()).strip("-")[:80].strip("-")
    return slug or "schema"


@dataclass(frozen=True)
class SchemaEntry:
    """A line of the library listing. `problem` is set (and the rest partly empty) when the file does not load."""

    slug: str
    path: Path
    name: str
    version: int
    description: str
    question_count: int
    problem: str | None = None


class SchemaLibrary:
    """The schema files of one folder; slugs (file stems, never with a path separator) are the ids. With a
    `history` (the workbench's Store), every content a schema is saved with, or that the library reads after git or
    an editor changed it, is kept there as a numbered version that the file carries; deleting keeps the history, so
    a deleted schema, or any version, can be restored as a new version."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, history: Any = None):
        if directory is None:
            directory = WorkbenchSettings.from_env().schemas_dir
        self.directory = Path(directory)
        self.history = history

    def path_of(self, slug: str) -> Path:
        """The file of a slug. Refuses anything that is not a plain slug, so no name can leave the folder."""
        if not isinstance(slug, str) or not SLUG_PATTERN.fullmatch(slug):
            raise SchemaError([SchemaProblem((), f"{slug!r} is not a schema id (lowercase letters, digits, dashes)")])
        return self.directory / f"{slug}{SCHEMA_FILE_SUFFIX}"

    def slugs(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(p.stem for p in self.directory.glob(f"*{SCHEMA_FILE_SUFFIX}")
                      if p.is_file() and SLUG_PATTERN.fullmatch(p.stem))

    def list(self) -> list[SchemaEntry]:
        """Every schema file, sorted by slug; files that fail to load are listed with their problem."""
        entries = []
        for slug in self.slugs():
            path = self.path_of(slug)
            try:
                schema = self.load(slug)
            except SchemaError as exc:
                entries.append(SchemaEntry(slug, path, slug, 0, "", 0, problem=str(exc)))
                continue
            entries.append(SchemaEntry(slug, path, schema.name, schema.version, schema.description,
                                       len(schema.questions)))
        return entries

    def exists(self, slug: str) -> bool:
        return self.path_of(slug).is_file()

    def load(self, slug: str) -> Schema:
        path = self.path_of(slug)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SchemaError([SchemaProblem((), f'no schema "{slug}" in {self.directory}')]) from None
        except UnicodeDecodeError:
            raise SchemaError([SchemaProblem((), "the file is not UTF-8 text")], source=path.name) from None
        schema = Schema.from_json(text, source=path.name)
        if self.history is not None and self.history.read_only:  # read as it is: a read-only store keeps no version
            return schema
        return self._recorded(slug, schema, "on disk")

    def _recorded(self, slug: str, schema: Schema, action: str, note: str = "") -> Schema:
        """The schema numbered as its version in the history (recorded there if its content is new)."""
        if self.history is None:
            return schema
        version = self.history.record_schema_version(slug, schema.to_dict(), action=action, note=note)
        return dataclasses.replace(schema, version=version["number"])

    def _write(self, slug: str, schema: Schema, action: str, note: str = "") -> Schema:
        problems = validate_schema_dict(schema.to_dict())
        if problems:
            raise SchemaError(problems, source=schema.name)
        # into the history first: a file never holds a version the history lacks
        schema = self._recorded(slug, schema, action, note)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_of(slug)
        tmp = path.with_name(f".{path.name}.tmp")
        # Write then rename, so a crash never leaves a half-written schema file.
        tmp.write_text(schema.to_json(), encoding="utf-8")
        os.replace(tmp, path)
        return schema

    def unique_slug(self, name: str) -> str:
        base = slugify(name)
        slug, n = base, 2
        while self.exists(slug):
            suffix = f"-{n}"
            slug = base[: 80 - len(suffix)] + suffix
            n += 1
        return slug

    def create(self, schema: Schema, *, action: str = "create") -> str:
        """Save a new schema under a fresh slug derived from its name; returns the slug. Never overwrites."""
        slug = self.unique_slug(schema.name)
        self._write(slug, schema, action)
        return slug

    def update(self, slug: str, schema: Schema, *, action: str = "update", note: str = "",
               expected_version: int | None = None) -> Schema:
        """Overwrite an existing schema. The version goes up by one when anything but the version changed (each
        save is a version, `note` kept with it in the history); returns what was saved. The slug (file name) stays,
        even if the name changed, so references to it keep working. With `expected_version` (the version an
        editor loaded), refused when the file has moved on since: the update would silently undo that change."""
        current = self.load(slug)
        if expected_version is not None and current.version != expected_version:
            raise SchemaError([SchemaProblem((), (
                f"{slug}.json changed since these questions were loaded from it (version {expected_version}; it is "
                f"at version {current.version} now): updating would undo that change. Save as a new schema, or load "
                "it again (Undo brings these questions back)"))])
        saved = dataclasses.replace(schema, questions=plain_json(schema.questions), version=current.version,
                                    examples=plain_json(list(schema.examples)))
        saved.version = current.version + 1 if _content(saved) != _content(current) else max(schema.version,
                                                                                              current.version)
        return self._write(slug, saved, action, note)

    def duplicate(self, slug: str, new_name: str | None = None) -> str:
        """Copy a schema under a new name (default "<name> (copy)"), starting again at version 1."""
        original = self.load(slug)
        return self.create(dataclasses.replace(original, name=new_name or f"{original.name} (copy)", version=1),
                           action="duplicate")

    def delete(self, slug: str, *, who: str = "") -> None:
        """Remove the file. With a history, its versions stay and the delete is logged: `restore` undoes it."""
        path = self.path_of(slug)
        if not path.is_file():
            raise SchemaError([SchemaProblem((), f'no schema "{slug}" in {self.directory}')])
        current = None if self.history is None else self.load(slug)  # records its content if the history lacks it
        path.unlink()
        if current is not None:
            self.history.log_change("delete", "schema", slug, f"{current.name} ({slug}.json)", who=who,
                                    data={"version": current.version})

    def deleted(self) -> builtins.list[str]:  # `list` here is the method above
        """Slugs with a history but no file: deleted schemas that `restore` brings back."""
        if self.history is None:
            return []
        return [slug for slug in self.history.schema_history_slugs() if not self.exists(slug)]

    def restore(self, slug: str, number: int | None = None, *, who: str = "", note: str = "") -> Schema:
        """Make version `number` of the schema its current content again, as a new version (nothing is lost; its
        history note says which version, or `note`), or bring a deleted schema back (number None: its latest
        version). Needs a history."""
        if self.history is None:
            raise SchemaError([SchemaProblem((), "this library keeps no history to restore from")])
        from clef_workbench.store import NotFoundError

        try:
            version = (self.history.latest_schema_version(slug) if number is None
                       else self.history.get_schema_version_number(slug, number))
        except NotFoundError as exc:
            raise SchemaError([SchemaProblem((), str(exc))]) from None
        if version is None:
            raise SchemaError([SchemaProblem((), f'schema "{slug}" has no history to restore')])
        schema = Schema.from_dict(version["schema"], source=f"{slug} version {version['number']}")
        was_deleted = not self.exists(slug)
        if was_deleted:
            saved = self._write(slug, schema, "restore")
            self.history.log_change("restore", "schema", slug, f"{saved.name} ({slug}.json)", who=who,
                                    data={"version": saved.version})
            return saved
        return self.update(slug, schema, action="restore", note=note or f"version {version['number']} restored")

    def import_json(self, data: bytes | str, *, filename: str | None = None, overwrite: bool = False) -> str:
        """Add a schema from uploaded JSON. The file name the user gave is used only in messages (never as a path);
        the slug comes from the schema's name. Also accepts a bare questions map or a System One request, then
        named after the file. Returns the slug. With overwrite, a schema of the same slug is replaced."""
        source = filename or "upload"
        if isinstance(data, bytes):
            if len(data) > MAX_IMPORT_BYTES:
                raise SchemaError([SchemaProblem((), f"the file is {len(data):,} bytes; at most "
                                                     f"{MAX_IMPORT_BYTES:,} are accepted")], source=source)
            try:
                data = data.decode("utf-8-sig")
            except UnicodeDecodeError:
                raise SchemaError([SchemaProblem((), "the file is not UTF-8 text")], source=source) from None
        parsed = loads_schema_json(data, source=source)
        if isinstance(parsed, dict) and "name" not in parsed:
            # A System One request or a bare questions map: wrap it, naming it after the uploaded file.
            parsed = {"name": Path(filename).stem if filename else "imported schema", "version": 1,
                      "description": f"Imported from {source}", "questions": parsed.get("questions", parsed)}
        schema = Schema.from_dict(parsed, source=source)
        slug = slugify(schema.name)
        if overwrite and self.exists(slug):
            self._write(slug, schema, "import")
            return slug
        return self.create(schema, action="import")

    def export_json(self, slug: str) -> str:
        """The schema file's canonical text (what a download gives)."""
        return self.load(slug).to_json()
