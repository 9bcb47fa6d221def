"""A fake Hugging Face Hub: the few routes ``huggingface_hub.snapshot_download`` calls, over one repo.

A fake at the outside edge (kvgate never runs the Hub): the repository's
info, its file tree, and each file's metadata (HEAD) and bytes (GET) under
``/{repo}/resolve/{commit}/{path}``. Every request is recorded, so a test can
show which files were asked for, and which never were.
"""

from __future__ import annotations

import hashlib
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_fake_hub(repo: str, files: dict[str, bytes], log: list[tuple[str, str]]) -> Any:
    def blob(data: bytes) -> str:
        return hashlib.sha1(data).hexdigest()

    async def serve(request: Request) -> Response:
        path = request.url.path
        log.append((request.method, path))
        if path in (f"/api/models/{repo}/revision/main", f"/api/models/{repo}/revision/{COMMIT}"):
            return JSONResponse({"id": repo, "modelId": repo, "sha": COMMIT,
                                 "siblings": [{"rfilename": name} for name in files]})
        if path.startswith(f"/api/models/{repo}/tree/"):
            return JSONResponse([{"type": "file", "path": name, "size": len(data), "oid": blob(data)}
                                 for name, data in files.items()])
        prefix = f"/{repo}/resolve/{COMMIT}/"
        if path.startswith(prefix) and path[len(prefix):] in files:
            data = files[path[len(prefix):]]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{blob(data)}"', "Content-Length": str(len(data))}
            return Response(b"" if request.method == "HEAD" else data, headers=headers)
        return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound"})

    return Starlette(routes=[Route("/{path:path}", serve, methods=["GET", "HEAD"])])
