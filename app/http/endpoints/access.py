"""Who may reach the routes that store things, decided before a byte of the body is read.

FastAPI runs a route's dependencies before its endpoint, and these routes read their bodies by
hand, in the endpoint: a dependency here answers while the body is still unread (and before a
/jobs upload takes one of the ``NMT_MAX_FILE_REQUESTS`` places).

- ``same_origin_writes``: a request that changes what the service stores (POST, DELETE) is
  refused (403) when a browser says another site sent it. A page on any site can make its
  visitor's browser send a form, or a multipart ``fetch(..., {mode: "no-cors"})``, to an intranet
  instance without a CORS preflight: it could not read the answer, but the write would be done.
  Browsers say where a request comes from in ``Sec-Fetch-Site`` (every current one), and older
  ones in ``Origin``; neither can be set by a page. Clients that send neither (curl, SDKs) pass.
- ``key_first``: the key of the headers or query (``app.keys.limits.admit_given_key``).
- ``stores_first``: without keys, the stores shared by every client are off unless the operator
  shares them (403, ``app.keys.limits.STORES_OFF``).

The routers of /glossaries, /memories and /jobs take them as their dependencies (``STORES``,
``JOBS``); /translate, /detect and /translate_file call ``admit_given_key`` first thing.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Query, Request
from fastapi.params import Depends as Dependency

from app.http.deps import KeysDep, SettingsDep
from app.keys.limits import admit_given_key, check_stores

# The key in the query, documented where a route reads it (a header is checked the same way).
ApiKeyQuery = Annotated[
    str | None,
    Query(
        description="Your API key (when the server requires keys), unless it is in a header: "
        "X-API-Key or Authorization: Bearer, which keep it out of URLs and their logs"
    ),
]
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Sec-Fetch-Site values of a request sent by a page of another origin: "same-site" is another
# origin too (another port, another subdomain: another application).
OTHER_SITES = frozenset({"cross-site", "same-site"})
DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}
CROSS_SITE = (
    "a page of another site may not change what this service stores: send the request from the "
    "service's own page, or without a browser"
)


def origin_of(scheme: str, host: str) -> str:
    """``scheme://host[:port]`` lower-cased, without the scheme's default port, as ``Origin`` is."""
    scheme, host = scheme.lower(), host.lower()
    default = DEFAULT_PORTS.get(scheme)
    if default is not None and host.endswith(f":{default}") and not host.endswith("]"):
        host = host[: -len(default) - 1]
    return f"{scheme}://{host}"


def cross_site(request: Request) -> bool:
    """Whether a browser says another site sent the request: ``Sec-Fetch-Site`` of another site,
    or else an ``Origin`` other than the request's own (the scheme and the ``Host`` header)."""
    site = request.headers.get("sec-fetch-site", "").strip().lower()
    if site in OTHER_SITES:
        return True
    if site == "same-origin":
        # The browser compared the origins itself, with the address it was given: the Host header
        # may have been rewritten since (a reverse proxy), and the Origin would then look foreign.
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return False  # not a browser's request of another page (a form, a fetch): curl, an SDK
    scheme, separator, host = origin.strip().partition("://")
    if not separator:  # "null" (a sandboxed frame, a file: page) is no origin of ours either
        return True
    return origin_of(scheme, host) != origin_of(request.url.scheme, request.headers.get("host", ""))


async def same_origin_writes(request: Request) -> None:
    """403 for a POST or DELETE that a page of another site sent (``cross_site``)."""
    if request.method not in SAFE_METHODS and cross_site(request):
        raise HTTPException(403, CROSS_SITE)


async def stores_first(settings: SettingsDep, keys: KeysDep) -> None:
    """403 without keys where the stores are not shared (``NMT_SHARED_STORES``)."""
    check_stores(keys, settings)


async def key_first(request: Request, keys: KeysDep) -> None:
    """Admit the request under the key of its headers or query before its body is read: 403 for
    an unknown key, 429 over a limit (``admit_given_key``)."""
    await admit_given_key(request, keys)


# (async def, as app.http.deps explains: FastAPI would run a plain def on its thread pool.)
STORES: list[Dependency] = [Depends(same_origin_writes), Depends(stores_first), Depends(key_first)]
JOBS: list[Dependency] = [Depends(same_origin_writes), Depends(key_first)]
