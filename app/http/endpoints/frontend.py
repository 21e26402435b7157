"""The page at / (``app/web``: static files, no CDN) and LibreTranslate's GET /frontend/settings,
from which the page, and LibreTranslate-aware clients, configure themselves."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from app.formats.documents import FORMATS, SUPPORTED
from app.http.deps import RouterDep, SettingsDep
from app.http.schemas import DefaultLanguages, FileFormatName, FrontendSettings, LanguageName
from app.translation.codes import language_name, served_pairs

api = APIRouter(tags=["frontend"])

WEB_DIR = Path(__file__).resolve().parents[2] / "web"  # package data: installed with the app
# The page loads nothing from elsewhere; the browser is told to refuse anything that would.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def static_files() -> StaticFiles:
    """``app/web`` (app.js, style.css, ...), mounted at /static."""
    return StaticFiles(directory=WEB_DIR)


@api.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(
        WEB_DIR / "index.html",
        headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"},
    )


@api.get("/frontend/settings", response_model=FrontendSettings, summary="Settings for front ends")
async def frontend_settings(settings: SettingsDep, router: RouterDep) -> FrontendSettings:
    target = served_pairs(router)[0][1]  # the first model's first direction
    return FrontendSettings(
        charLimit=settings.max_chars,
        frontendTimeout=settings.frontend_timeout_ms,
        apiKeys=settings.keys_required,
        keyRequired=settings.keys_required,
        suggestions=False,
        filesTranslation=True,
        supportedFilesFormat=list(SUPPORTED),
        filesFormats=[FileFormatName(name=f.name, extensions=list(f.extensions)) for f in FORMATS],
        language=DefaultLanguages(
            source=LanguageName(code="auto", name="Auto Detect"),
            target=LanguageName(code=target, name=language_name(target)),
        ),
    )
