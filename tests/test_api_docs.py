"""/docs (Swagger UI) and /redoc come from the portal itself: on a network that reaches nothing else they work."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.web.main import create_app
from tests.support.browsers import needs_chromium


@pytest.fixture
def client(tmp_path, migrated_database):
    settings = Settings(database_url=f"sqlite:///{migrated_database}", data_dir=tmp_path)
    with TestClient(create_app(settings)) as client:
        yield client


def referenced_urls(html: str) -> list[str]:
    """Every URL the page loads: src and href attributes, and the document the script fetches."""
    return re.findall(r'(?:src|href|spec-url)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_reference_only_the_portals_own_files(client, page):
    html = client.get(page).text
    urls = referenced_urls(html)
    assert len(urls) >= 3, urls  # script, favicon, the OpenAPI document (and Swagger UI's stylesheet)
    for url in urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), f"{page} loads {url} from elsewhere"
        answer = client.get(url)
        assert answer.status_code == 200 and answer.content, url
    assert "cdn" not in html and "googleapis" not in html


def test_fastapis_cdn_pages_are_not_served(client):
    assert client.get("/docs/oauth2-redirect").status_code == 404
    assert "/static/vendor/swagger-ui-bundle.js" in client.get("/docs").text


@needs_chromium
@pytest.mark.parametrize("page, rendered", [("/docs", ".opblock-summary-path"), ("/redoc", "[data-section-id]")])
def test_docs_render_in_a_browser_that_reaches_only_the_portal(start_portal, chromium_browser, output_dir, page,
                                                               rendered):
    portal = start_portal()
    origin = portal.url.rstrip("/")
    elsewhere: list[str] = []

    def only_the_portal(route):
        if route.request.url.startswith(origin + "/") or route.request.url.startswith(("data:", "blob:")):
            return route.continue_()
        elsewhere.append(route.request.url)
        return route.abort()

    tab = chromium_browser.new_page(viewport={"width": 1280, "height": 900})
    blocked: list[str] = []  # what the page's Content-Security-Policy stopped before it left the browser
    tab.on("console", lambda message: blocked.append(message.text) if "Content Security Policy" in message.text
           else None)
    tab.route("**/*", only_the_portal)
    tab.goto(origin + page)
    tab.wait_for_selector(rendered, timeout=30_000)
    assert "/api/v1/runs/{slug}/swarm" in tab.inner_text("body")
    tab.screenshot(path=str(output_dir / f"api{page.replace('/', '-')}.png"))
    assert elsewhere == [], f"{page} tried to load {elsewhere}"
    assert all("cdn.redoc.ly" in line for line in blocked), blocked  # ReDoc's sidebar logo, and nothing else
