"""User paths (workdirs, checkpoints, reports, data dirs): local or object-store URLs.

Every user path goes through ``as_path``, an etils ``epath.Path`` (the path type orbax uses),
so ``gs://bucket/run`` stays a URL end to end instead of becoming a local folder named ``gs:``
(what ``os.path.abspath`` and ``open`` make of it). ``gs://`` needs gcsfs at run time
(``pip install 'etils[epath-gcs]'``, the ``tpu`` extra); local paths need nothing extra.

A GCS emulator named by ``STORAGE_EMULATOR_HOST`` (the variable gcsfs and google-cloud-storage
read) is also given to tensorstore, which writes orbax's arrays and reads only
``TENSORSTORE_GCS_HTTP_URL``; see ``use_gcs_emulator``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from etils import epath

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL (``gs://...``, ``s3://...``) rather than a local path."""
    return bool(_URL.match(os.fspath(path)))


def as_path(path: str | os.PathLike) -> epath.Path:
    """An ``epath.Path``: local paths made absolute, URLs left exactly as given."""
    path = os.fspath(path)
    if path.startswith("gs://"):
        use_gcs_emulator()
    return epath.Path(path if is_url(path) else os.path.abspath(path))


def use_gcs_emulator() -> None:
    """Points tensorstore at the GCS emulator of ``STORAGE_EMULATOR_HOST``, if one is set and
    ``TENSORSTORE_GCS_HTTP_URL`` is not. Without it, a run against an emulator sends its
    checkpoint metadata there (gcsfs) but its arrays to storage.googleapis.com (tensorstore),
    and where that is unreachable the first save retries for minutes. Tensorstore reads the
    variable once, at its first GCS request: ``as_path`` of a gs:// path calls this first."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default") or "TENSORSTORE_GCS_HTTP_URL" in os.environ:
        return
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = host if "://" in host else f"http://{host}"


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value stored at ``path``."""
    return json.loads(as_path(path).read_text())


def write_json_atomic(path: str | os.PathLike, value: Any, **dump_kwargs: Any) -> None:
    """Writes ``value`` as JSON via ``<path>.tmp`` then a rename, so readers never see half."""
    path = as_path(path)
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(json.dumps(value, **dump_kwargs))
    tmp.replace(path)


def dir_identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of a local directory, None for a URL or a missing one: the same path
    made again (e.g. by a writer that creates its parents) has another identity."""
    if is_url(path):
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def dir_removed(path: str | os.PathLike, identity: tuple[int, int] | None) -> bool:
    """Whether the local directory whose `dir_identity` was `identity` is gone (removed, or
    removed and made again). Always False for a URL."""
    return identity is not None and dir_identity(path) != identity
