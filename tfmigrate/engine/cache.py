"""A content-hash cache of `check` results, so that a second run over an unchanged tree
reads a few files instead of checking every one.

An entry is the result of checking one file: its findings, or its error (a syntax error is as
much a property of the content as a finding). The key covers everything the result depends
on: the file's bytes, its path (findings carry it; per-file ignores match on it), the enabled
configuration (select, ignore, the path's per-file ignores, target), and the engine itself
(tfmigrate's version and a hash of the engine's and the rules' source files, so that editing
a rule invalidates every entry without a version bump).

Layout, like ruff's: ``.tfmigrate_cache/`` at the project root (``TFMIGRATE_CACHE_DIR``
overrides it), holding a ``CACHEDIR.TAG`` (backup tools skip it) and a ``.gitignore`` of ``*``.
Under ``<version>/<engine hash>/`` are ``rules.catalog``, the rule catalog of that engine (see
:mod:`tfmigrate.engine.registry`: codes, names, trigger words), so that a run can validate codes,
prefilter files and answer from the cache without importing a rule or LibCST, and
``packs/<hash of a source folder>.json``: the entries of that folder's files, so that a run
reads one file per folder (a one-file pre-commit run reads its folder's only). An entry also
keeps the file's size, modification time and inode when they can stand for its content (see
``_RACY_NS``): then the file is not even read; otherwise it is hashed.

Each file is written to a temporary file and moved into place with ``os.replace``, so two
runs sharing the folder never see half of one; a pack that does not read back whole is
ignored and its files checked again. Nothing here ever fails a run: a cache folder that cannot
be written is simply not used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import stat
import tempfile
import time
from pathlib import Path

from tfmigrate import __version__

CACHE_DIR_NAME = ".tfmigrate_cache"
ENV_VAR = "TFMIGRATE_CACHE_DIR"
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by tfmigrate.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)
_FORMAT = 1  # bump when the entry layout changes


def content_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _rules_folder() -> Path:
    """Where the rule modules are, without importing them (that is the slow part)."""
    try:
        spec = importlib.util.find_spec("tfmigrate.rules")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[2] / "rules"  # a source checkout (see registry)


@functools.lru_cache(maxsize=None)
def engine_fingerprint() -> str:
    """A hash of every source file whose change could change a finding."""
    digest = hashlib.sha256(f"{__version__}/{_FORMAT}".encode())
    package = Path(__file__).resolve().parents[1]  # tfmigrate/: the engine and all its floors
    for folder, pattern in ((package, "**/*.py"), (_rules_folder(), "*.py")):
        for path in sorted(folder.glob(pattern)):
            digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
            try:
                digest.update(path.read_bytes())
            except OSError:
                digest.update(b"?")
    return digest.hexdigest()[:20]


def cache_root(project_root: Path) -> Path:
    override = os.environ.get(ENV_VAR)
    return Path(override) if override else Path(project_root) / CACHE_DIR_NAME


def _finding_to_json(finding) -> dict:
    data = dataclasses.asdict(finding)
    data["fix_safety"] = finding.fix_safety.value
    del data["path"]  # the path is part of the key; stored once, not per finding
    return data


def _finding_from_json(data: dict, path: str):
    from tfmigrate.findings import Finding, FixSafety, Location

    return Finding(
        **{**data, "path": path, "start": Location(**data["start"]), "end": Location(**data["end"]),
           "fix_safety": FixSafety(data["fix_safety"])}
    )


def _write_json(target: Path, data, *, prefix: str) -> None:
    """Write ``data`` as JSON to ``target`` in one step (a temporary file renamed over it), so
    that a run reading concurrently sees the old file or the new one, never part of one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


class Cache:
    """The results of one engine, one pack file per source folder (see the module doc)."""

    def __init__(self, folder: Path) -> None:
        self.root = Path(folder)
        self.folder = self.root / __version__ / engine_fingerprint()
        self.usable = True
        self.hits = 0
        self._packs: dict[str, dict] = {}  # source folder -> its pack's entries, as read
        self._changed: dict[str, dict] = {}  # source folder -> entries to write: file name -> entry

    @classmethod
    def for_config(cls, config) -> Cache:
        return cls(cache_root(config.root))

    def key(self, path: str, digest: str, config) -> str:
        relevant = {
            "path": os.path.normpath(path),
            "content": digest,
            "select": sorted(config.select),
            "ignore": sorted(config.ignore + config.ignores_for(path)),
            "target": config.target,
            "tower_input": config.tower_input,
        }
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()

    def _pack_path(self, source_folder: str) -> Path:
        name = hashlib.sha256(source_folder.encode("utf-8", "surrogateescape")).hexdigest()[:24]
        return self.folder / "packs" / f"{name}.json"

    def _read_pack(self, source_folder: str) -> dict:
        """The entries stored for a source folder ({} when none, or not readable whole)."""
        try:
            with open(self._pack_path(source_folder), "rb") as handle:
                data = json.loads(handle.read())
            if data.get("folder") != source_folder or not isinstance(data.get("files"), dict):
                return {}  # a foreign or damaged pack
            return data["files"]
        except (OSError, ValueError, AttributeError):
            return {}

    def _pack(self, source_folder: str) -> dict:
        if source_folder not in self._packs:
            self._packs[source_folder] = self._read_pack(source_folder)
        return self._packs[source_folder]

    def get(self, path: str, config):
        """The cached FileResult for the file as it is now, or None."""
        from tfmigrate.findings import FileResult

        source_folder, name = os.path.split(os.path.abspath(path))
        stored = self._pack(source_folder).get(name)
        if not isinstance(stored, dict):
            return None
        try:
            info = os.stat(path)
        except OSError:
            return None  # let the check itself report it
        if not stat.S_ISREG(info.st_mode):
            return None  # a FIFO would block the open: let the check report it
        try:
            if stored.get("stat") == _stat_signature(info):
                digest = stored["digest"]  # unchanged since it was checked (see _stat_signature)
            else:
                with open(path, "rb") as handle:
                    digest = content_digest(handle.read())
            if digest != stored["digest"]:
                return None  # changed content
            entry = stored["results"].get(self.key(path, digest, config))
            if entry is None:
                return None  # checked with another configuration only
            result = FileResult(
                path=path, error=entry["error"], parsed=entry["parsed"], notes=list(entry["notes"]), digest=digest,
                findings=[_finding_from_json(f, path) for f in entry["findings"]],
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # unreadable, partial or corrupt: recompute
        self.hits += 1
        return result

    def put(self, result, config) -> None:
        """Keep a result for :meth:`flush` to write."""
        if not self.usable or result.digest is None or not result.cacheable:
            return  # (a result that read other files of the project is not keyed by them)
        if result.error and result.error.startswith("internal error"):
            return  # a bug, or a transient failure: never make it stick
        entry = {
            "error": result.error,
            "parsed": result.parsed,
            "notes": result.notes,
            "findings": [_finding_to_json(f) for f in result.findings],
        }
        source_folder, name = os.path.split(os.path.abspath(result.path))
        self._changed.setdefault(source_folder, {})[name] = (
            result.digest, _stat_when_unchanged(result.path, result.digest), self.key(result.path, result.digest, config),
            entry,
        )

    def flush(self) -> None:
        """Write the packs that have new entries. Each pack is read again just before, so that
        what a concurrent run wrote since is kept (unless both write at the same moment: then
        one run's new entries are lost, and computed again next time; never wrong).

        A file keeps the results of its current content only, one per configuration it was
        checked with (a few: `check` and `check --select ...` do not push each other out)."""
        if not self.usable:
            return
        try:
            self._prepare()
            for source_folder, changed in self._changed.items():
                files = {
                    name: stored for name, stored in self._read_pack(source_folder).items()
                    if os.path.exists(os.path.join(source_folder, name))  # forget deleted files
                }
                for name, (digest, signature, key, entry) in changed.items():
                    stored = files.get(name)
                    results = {}
                    if isinstance(stored, dict) and stored.get("digest") == digest and isinstance(stored.get("results"), dict):
                        results = dict(list(stored["results"].items())[-(_RESULTS_PER_FILE - 1):])
                    results.pop(key, None)
                    results[key] = entry  # the newest last
                    files[name] = {"digest": digest, "stat": signature, "results": results}
                _write_json(self._pack_path(source_folder), {"folder": source_folder, "files": files}, prefix=".pack-")
        except OSError:
            self.usable = False  # read-only checkout, full disk...: run without a cache
        self._changed.clear()

    def _prepare(self) -> None:
        """Create the cache folder with its CACHEDIR.TAG and .gitignore, once."""
        if getattr(self, "_prepared", False):
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for name, text in (("CACHEDIR.TAG", CACHEDIR_TAG), (".gitignore", "# Created by tfmigrate.\n*\n")):
            path = self.root / name
            if not path.exists():
                fd, temp = tempfile.mkstemp(prefix=".tag-", dir=self.root)
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(text)
                os.replace(temp, path)
        self._prepared = True


_RESULTS_PER_FILE = 4  # configurations remembered per file content

# A file's size, inode and modification and change times stand for its content only when the
# times are older than the moment they were recorded by more than a file system's time
# resolution (up to 2 s on FAT): a change within that window could leave them as they were
# (git's "racy clean" problem). Such a file is hashed each time. The change time (ctime) is
# there because no program can set it back: a file rewritten and given its old modification
# time again is still seen as changed.
_RACY_NS = 3_000_000_000


def _stat_signature(info: os.stat_result) -> list[int]:
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]


def _stat_when_unchanged(path: str, digest: str) -> list[int] | None:
    """The file's stat signature, if its content is still the one checked (``digest``) and it
    was last modified long enough ago; else None (the entry is then matched by content)."""
    try:
        before = os.stat(path)
        if time.time_ns() - max(before.st_mtime_ns, before.st_ctime_ns) < _RACY_NS:
            return None
        with open(path, "rb") as handle:
            same = content_digest(handle.read()) == digest
        after = os.stat(path)
    except OSError:
        return None
    if not same or _stat_signature(before) != _stat_signature(after):
        return None
    return _stat_signature(after)


# --- the rule catalog -----------------------------------------------------------------------
CATALOG_NAME = "rules.catalog"  # JSON; not *.json, which are the entries


def load_catalog(root: Path):
    """The rule catalog stored for this engine under ``root``, or None (missing, damaged, or
    written by another engine: the folder is named by the engine fingerprint)."""
    from tfmigrate.engine.registry import RuleInfo

    path = Path(root) / __version__ / engine_fingerprint() / CATALOG_NAME
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read())
        if data.get("engine") != engine_fingerprint():
            return None
        entries = tuple(RuleInfo.from_json(item) for item in data["rules"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return entries or None


def save_catalog(root: Path, entries) -> None:
    """Store the catalog (computed from the rules) for the next run; never fails a run."""
    cache = Cache(root)
    path = cache.folder / CATALOG_NAME
    try:
        cache._prepare()
        _write_json(path, {"engine": engine_fingerprint(), "rules": [e.to_json() for e in entries]}, prefix=".catalog-")
    except OSError:
        pass
