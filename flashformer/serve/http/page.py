"""The chat page at GET /: HTML, CSS and JavaScript shipped in the package (serve/webui/),
nothing fetched from elsewhere, since the server runs offline. The page talks to the
server's own /v1 endpoints as any client does (the API key included); it reads what it
needs before its first call from /webui/config.json: whether it serves a chat model or an
encoder (then it compares two texts' embeddings) and whether the API wants a key.

Model output reaches the page's DOM only as text nodes (app.js builds its Markdown from
elements), and the Content-Security-Policy below forbids inline script and other origins:
HTML in an answer is shown, never run.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

# what the page's files may load: only this server's own scripts, styles and API
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
PAGES = {  # route -> (file under serve/webui/, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/webui/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
}


def add_page(app: FastAPI, mode: str, key_required: bool) -> None:
    """Serve the page's files (read once, here) and its config on `app`. mode: "chat" (a text
    model) or "embeddings" (an encoder: the page compares two texts)."""
    if mode not in ("chat", "embeddings"):
        raise ValueError(f"mode must be 'chat' or 'embeddings'; got {mode!r}")
    folder = files("flashformer.serve") / "webui"
    for route, (name, media_type) in PAGES.items():
        body = (folder / name).read_bytes()

        async def serve(body=body, media_type=media_type) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        app.add_api_route(route, serve, methods=["GET"], include_in_schema=False)

    config = {"mode": mode, "api_key_required": key_required}

    @app.get("/webui/config.json", include_in_schema=False)
    async def page_config():
        return JSONResponse(config, headers=HEADERS)
