"""A content-hash cache of `check` results, so that a second run over an unchanged tree only
hashes files.

An entry is the result of checking one file: its findings, or its error (a syntax error is as
much a property of the content as a finding). The key covers everything the result depends
on: the file's bytes, its path (findings carry it; per-file ignores match on it), the enabled
configuration (select, ignore, the path's per-file ignores, target), and the engine itself
(tfmigrate's version and a hash of the engine's and the rules' source files, so that editing
a rule invalidates every entry without a version bump).

Layout, like ruff's: ``.tfmigrate_cache/`` at the project root (``TFMIGRATE_CACHE_DIR``
overrides it), holding a ``CACHEDIR.TAG`` (backup tools skip it) and a ``.gitignore`` of ``*``.
Entries live in ``<version>/<engine hash>/<2 hex>/<key>.json``, next to ``rules.catalog``, the
rule catalog of that engine (see :mod:`tfmigrate.registry`: codes, names, trigger words), so
that a run can validate codes, prefilter files and answer from the cache without importing a
rule or LibCST. Each is written to a temporary
file and moved into place with ``os.replace``, so two runs sharing the folder never see half an
entry; an entry that does not read back as what we wrote is ignored and recomputed. Nothing
here ever fails a run: a cache folder that cannot be written is simply not used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
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
    return Path(__file__).resolve().parent.parent / "rules"  # a source checkout (see registry)


@functools.lru_cache(maxsize=None)
def engine_fingerprint() -> str:
    """A hash of every source file whose change could change a finding."""
    digest = hashlib.sha256(f"{__version__}/{_FORMAT}".encode())
    engine = Path(__file__).resolve().parent
    for folder in (engine, _rules_folder()):
        for path in sorted(folder.glob("*.py")):
            digest.update(path.name.encode() + b"\0")
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
    def __init__(self, folder: Path) -> None:
        self.root = Path(folder)
        self.folder = self.root / __version__ / engine_fingerprint()
        self.usable = True
        self.hits = 0

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
        }
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()

    def _entry(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, path: str, config):
        """The cached FileResult for the file as it is now, or None."""
        from tfmigrate.findings import FileResult

        if not os.path.isfile(path):  # a FIFO would block the open: let the check report it
            return None
        try:
            with open(path, "rb") as handle:
                digest = content_digest(handle.read())
        except OSError:
            return None  # let the check itself report it
        key = self.key(path, digest, config)
        try:
            with open(self._entry(key), "rb") as handle:
                data = json.loads(handle.read())
            if data.get("key") != key:  # a foreign or damaged entry
                return None
            result = FileResult(
                path=path, error=data["error"], parsed=data["parsed"], notes=list(data["notes"]), digest=digest,
                findings=[_finding_from_json(f, path) for f in data["findings"]],
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # missing, partial or corrupt: recompute
        self.hits += 1
        return result

    def put(self, result, config) -> None:
        if not self.usable or result.digest is None:
            return
        if result.error and result.error.startswith("internal error"):
            return  # a bug, or a transient failure: never make it stick
        key = self.key(result.path, result.digest, config)
        entry = {
            "key": key,
            "error": result.error,
            "parsed": result.parsed,
            "notes": result.notes,
            "findings": [_finding_to_json(f) for f in result.findings],
        }
        try:
            self._prepare()
            _write_json(self._entry(key), entry, prefix=".entry-")
        except OSError:
            self.usable = False  # read-only checkout, full disk...: run without a cache

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


# --- the rule catalog -----------------------------------------------------------------------
CATALOG_NAME = "rules.catalog"  # JSON; not *.json, which are the entries


def load_catalog(root: Path):
    """The rule catalog stored for this engine under ``root``, or None (missing, damaged, or
    written by another engine: the folder is named by the engine fingerprint)."""
    from tfmigrate.registry import RuleInfo

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
