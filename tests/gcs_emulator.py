"""A local GCS (JSON API) for tests: gcp-storage-emulator, in memory, on a free localhost port.

    python tests/gcs_emulator.py      # prints "port <N>" once it listens, serves until killed

gcsfs and google-cloud-storage reach it through ``STORAGE_EMULATOR_HOST=http://localhost:<N>``,
tensorstore (orbax's arrays) through ``TENSORSTORE_GCS_HTTP_URL`` (tg_jax.paths sets it from
the former).

Three things real GCS does and the emulator does not are added, each needed by a client:

* ``objects.moveTo``, which gcsfs tries first for every rename (``epath.Path.replace``):
  without it each rename waits out gcsfs's retries of the 501 answer (about 30 s) before
  falling back to copy and delete.
* The ``x-goog-generation`` header on downloads, where tensorstore reads an object's
  generation: without it orbax's OCDBT manifest update fails with "Malformed StorageGeneration".
* Generation preconditions (``ifGenerationMatch``, ``ifGenerationNotMatch``) on reads, writes
  and deletes, which tensorstore's conditional writes rely on: 412, or 304 for a read whose
  object has not changed.
"""

from __future__ import annotations

import threading
from http import HTTPStatus

from gcp_storage_emulator import server, settings
from gcp_storage_emulator.exceptions import Conflict, NotFound
from gcp_storage_emulator.handlers import objects


def _generation(storage, bucket: str, name: str) -> str | None:
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return None


def _failed_precondition(request, storage, name: str | None, *, read: bool):
    """The status a request's generation preconditions answer with, or None if they hold.
    Generation 0 in ``ifGenerationMatch`` means the object must not exist (GCS's rule)."""
    if name is None:
        return None
    have = _generation(storage, request.params["bucket_name"], name)
    match = request.query.get("ifGenerationMatch", [None])[0]
    if match is not None:
        if read and have is None:
            return HTTPStatus.NOT_FOUND
        if (match == "0" and have is not None) or (match != "0" and match != have):
            return HTTPStatus.PRECONDITION_FAILED
    not_match = request.query.get("ifGenerationNotMatch", [None])[0]
    if not_match is not None and have is not None and not_match == have:
        return HTTPStatus.NOT_MODIFIED if read else HTTPStatus.PRECONDITION_FAILED
    return None


def _refuse(response, status) -> None:
    response.status = status
    if status == HTTPStatus.PRECONDITION_FAILED:
        response.json({"error": {"code": 412, "message": "conditionNotMet"}})


def _upload_name(request) -> str | None:
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    if isinstance(data, dict):
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else data
        return meta.get("name")
    return None


def _with_preconditions(handler, *, read: bool, upload: bool = False):
    def wrapped(request, response, storage, *args, **kwargs):
        name = _upload_name(request) if upload else request.params.get("object_id")
        status = _failed_precondition(request, storage, name, read=read)
        if status is not None:
            return _refuse(response, status)
        handler(request, response, storage, *args, **kwargs)
        if read and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            generation = _generation(storage, request.params["bucket_name"], name)
            if generation is not None:
                response["x-goog-generation"] = generation
                response["x-goog-metageneration"] = "1"

    return wrapped


def move(request, response, storage, *args, **kwargs):
    """objects.moveTo: the source object renamed within its bucket (a copy, then a delete)."""
    bucket, src = request.params["bucket_name"], request.params["object_id"]
    status = _failed_precondition(request, storage, src, read=False)
    if status is not None:
        return _refuse(response, status)
    try:
        dest = objects._copy(  # noqa: SLF001 (the copy the emulator's copyTo makes)
            request.base_url, storage, bucket, src, bucket, request.params["dest_object_id"]
        )
        storage.delete_file(bucket, src)
        response.json(dest)
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
    except Conflict as err:
        objects._handle_conflict(response, err)  # noqa: SLF001


MOVE_ROUTE = (
    rf"^{settings.API_ENDPOINT}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
    r"(?P<dest_object_id>.*[^/]+)$",
    {server.POST: move},
)


def install() -> None:
    """Adds the moveTo route and wraps the object handlers with preconditions."""
    wrapped = {
        objects.get: _with_preconditions(objects.get, read=True),
        objects.download: _with_preconditions(objects.download, read=True),
        objects.delete: _with_preconditions(objects.delete, read=False),
        objects.insert: _with_preconditions(objects.insert, read=False, upload=True),
    }
    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            handlers[method] = wrapped.get(handler, handler)
    # The router falls back to `objects.insert` for uploads posted without /upload.
    objects.insert = wrapped[objects.insert]
    server.HANDLERS = (MOVE_ROUTE, *server.HANDLERS)  # before the generic object route


def main() -> None:
    install()
    emulator = server.create_server("localhost", 0, in_memory=True)  # port 0: a free one
    emulator.start()  # serves in a thread; returns once it listens
    print(f"port {emulator._api._httpd.server_address[1]}", flush=True)  # noqa: SLF001
    threading.Event().wait()  # until SIGTERM or SIGINT ends the process


if __name__ == "__main__":
    main()
