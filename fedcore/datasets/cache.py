"""Decoded arrays cached as .npy files, so that a dataset is decoded once per machine.

Layout: ``CACHE_DIR/NAME-KEY/`` holds one ``ARRAY.npy`` per array and ``source.json``, where KEY is
the first 16 hex digits of the sha256 of ``source.json``'s content: the dataset name, the decoder
version, and each source file's resolved path, size and modification time. A different source (other
files, a moved or rewritten file, a new decoder version) therefore has a different folder and can
never be read for another. Entries are written into a temporary folder beside the final one and
renamed into place in one step, so a reader sees a whole entry or none; while one process decodes,
others that want the same entry wait on a lock file (``.NAME-KEY.lock``) and then read it. Loads
memory-map the files copy-on-write: a second load costs a millisecond, and pages are read only
when touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


def source_identity(paths: Sequence[Path]) -> list[list[object]]:
    """(resolved path, size, mtime in ns) of each source file or folder, the part of the key that changes with it."""
    out: list[list[object]] = []
    for path in paths:
        st = path.stat()
        out.append([str(path.resolve()), st.st_size if path.is_file() else 0, st.st_mtime_ns])
    return out


def cache_key(description: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def _read(entry: Path) -> Arrays | None:
    try:
        meta = json.loads((entry / "source.json").read_text())
        return {name: np.load(entry / f"{name}.npy", mmap_mode="c") for name in meta["arrays"]}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the unreadable cache entry %s (%s); decoding again", entry, exc)
        return None


def _write(entry: Path, arrays: Arrays, description: Mapping[str, object]) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        meta = {**description, "arrays": sorted(arrays)}
        (tmp / "source.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "source.json").is_file():
                raise
            logger.debug("another process wrote %s first", entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def cached(
    cache_dir: Path | None,
    name: str,
    sources: Sequence[Path],
    decode: Callable[[], Arrays],
    *,
    version: int,
) -> Arrays:
    """The arrays that `decode` makes from `sources`, from the cache when an entry for exactly these sources exists.

    `cache_dir=None` decodes every time. A cache folder that cannot be written is reported once per
    call as a warning, and the decoded arrays are returned all the same.
    """
    if cache_dir is None:
        return decode()
    description = {"dataset": name, "version": version, "sources": source_identity(sources)}
    entry = Path(cache_dir).expanduser() / f"{name}-{cache_key(description)}"
    found = _read(entry)
    if found is not None:
        logger.debug("%s: decoded arrays from the cache %s", name, entry)
        return found
    with _decoding(entry):
        found = _read(entry)  # another process may have written it while this one waited
        if found is not None:
            return found
        if entry.exists():  # unreadable: replace it
            shutil.rmtree(entry, ignore_errors=True)
        arrays = decode()
        try:
            _write(entry, arrays, description)
        except OSError as exc:
            logger.warning("%s: could not write the cache %s (%s); it will be decoded again", name, entry, exc)
            return arrays
    logger.info("%s: decoded arrays cached in %s", name, entry)
    read = _read(entry)
    return read if read is not None else arrays


@contextlib.contextmanager
def _decoding(entry: Path) -> Iterator[None]:
    """An exclusive lock on ``.NAME-KEY.lock`` while one process decodes, so that processes started
    together (a coordinator and node hosts) decode once; without a writable cache folder or
    fcntl, no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle = (entry.parent / f".{entry.name}.lock").open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks until the decoding process is done
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
