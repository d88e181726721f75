"""The documentation site: it builds strict, its generated references hold what the code has (every config key,
every CLI subcommand, no raw Sphinx role), its links resolve, and in a real headless Chromium every page loads with
no console error and no request leaving the machine, search finds what users look for, code blocks have copy
buttons and the diagrams draw. Screenshots of three pages are kept where a passing run leaves them."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "gen"))
from griffe_roles import ROLE, to_markdown  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENS = Path(os.environ.get("ENVKIT_TEST_REPORT", ROOT / ".cache" / "test-report")) / "docs-screens"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built as ``make docs`` builds it (strict: a warning fails)."""
    out = tmp_path_factory.mktemp("site")
    assert (ROOT / "docs/javascripts/vendor/mermaid.min.js").exists(), "mermaid is vendored by `make docs`"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def test_the_config_reference_lists_every_key_the_trainer_composes(site: Path):
    job = subprocess.run([sys.executable, "-m", "trainer", "--cfg", "job"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout
    keys: list[str] = []

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            keys.append(prefix[:-1])

    walk(yaml.safe_load(job), "")
    page = (site / "reference/config/index.html").read_text()
    rows = set(re.findall(r"<tr>\s*<td><code>([\w.]+)</code></td>", page))
    # a user dict (env.kwargs, placement.trainer_resources) is one row: its entries are the user's
    missing = [k for k in keys if not any(".".join(k.split(".")[:n]) in rows for n in range(1, k.count(".") + 2))]
    assert len(keys) > 120 and not missing, missing
    assert {"algorithm.clip_high", "weight_sync.transport", "generator.tool_parser", "sft.num_demos"} <= rows
    assert "<code>algorithm=dr_grpo</code>" in page and "<code>+recipe=tool_agent</code>" in page  # the groups


def test_the_cli_reference_has_every_subcommand_and_option(site: Path):
    from importlib.metadata import entry_points

    page = _text((site / "reference/cli/index.html").read_text())
    plugins = [ep.name for ep in entry_points(group="envkit.commands")]
    assert {"eval", "judge-check", "build"} <= set(plugins)
    for name in ["list", "info", "check", "replay", "new", "serve", *plugins]:
        help_ = subprocess.run([sys.executable, "-m", "envkit.cli", name, "--help"], capture_output=True, text=True,
                               cwd=ROOT, timeout=60, check=True).stdout
        options = set(re.findall(r"(--[a-z][\w-]+)", help_))
        assert f"envkit {name}" in page and options, name
        assert not [o for o in options if o not in page], (name, [o for o in options if o not in page])


def test_no_sphinx_role_reaches_a_page(site: Path):
    sources = "".join(p.read_text() for pkg in ("envkit", "generators", "trainer", "sandboxes")
                      for p in (ROOT / pkg).rglob("*.py"))
    assert len(ROLE.findall(sources)) > 300  # the docstrings use them: the API pages would show them raw
    assert to_markdown(":class:`~envkit.core.Env` and :func:`envkit.make`; see::") == "`Env` and `envkit.make`; see:"
    raw = {p.relative_to(site).as_posix(): found for p in _pages(site)
           if (found := re.findall(r":(?:class|func|meth|attr|mod|data|exc):`?", _text(p.read_text())))}
    assert not raw, raw


def test_the_api_reference_documents_every_public_name(site: Path):
    import importlib

    for package in ("envkit", "generators", "trainer", "sandboxes"):
        page = (site / f"reference/api/{package}/index.html").read_text()
        public = [name for name in importlib.import_module(package).__all__ if not name.startswith("_")]
        missing = [name for name in public if f'id="{package}.{name}"' not in page]
        assert public and not missing, (package, missing)  # e.g. a name re-exported from a module the docs missed
    assert 'id="envkit.errors.RemoteEnvError"' in (site / "reference/api/envkit/index.html").read_text()


def test_every_internal_link_and_anchor_resolves(site: Path):
    ids: dict[Path, set[str]] = {}
    broken = []
    for page in _pages(site):
        html = page.read_text()
        url = "http://site/" + page.relative_to(site).as_posix()
        for href in re.findall(r'<a [^>]*href="([^"]+)"', html):
            target = urlparse(urljoin(url, href))
            if target.netloc != "site":
                continue
            path = site / unquote(target.path).lstrip("/")
            path = path / "index.html" if path.is_dir() else path
            if not path.exists():
                broken.append(f"{page.relative_to(site)}: {href}")
            elif target.fragment and path.suffix == ".html":
                if path not in ids:
                    ids[path] = set(re.findall(r'id="([^"]+)"', path.read_text()))
                if unquote(target.fragment) not in ids[path]:
                    broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert len(_pages(site)) > 30 and not broken, broken


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The site over HTTP on loopback (search loads its index with fetch, which file:// refuses)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.mark.chromium
def test_the_site_in_a_real_browser(site: Path, served: str, record_property):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "chromium is not installed: `make test` installs it (apt-get install chromium)"
    SCREENS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=served.rstrip("/"))
        outside: list[str] = []

        def only_loopback(route) -> None:  # the built site must need nothing from the internet
            if urlparse(route.request.url).hostname == "127.0.0.1":
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", only_loopback)
        # Material draws each diagram into a closed shadow root: open it, so that the test can read the drawing
        context.add_init_script("const attach = Element.prototype.attachShadow; Element.prototype.attachShadow = "
                                "function (options) { return attach.call(this, {...options, mode: 'open'}); };")
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))

        for html in _pages(site):
            page.goto(served + html.relative_to(site).as_posix(), wait_until="load")
        assert errors == [] and outside == [], (errors, outside)

        page.goto(served)  # the home page: its diagram draws, from the vendored mermaid
        page.wait_for_selector(".mermaid svg", timeout=20_000)
        drawn = page.locator(".mermaid svg").first
        assert "trainer: GRPO family" in drawn.text_content() and drawn.bounding_box()["height"] > 100
        page.screenshot(path=str(SCREENS / "home.png"), full_page=True)
        for term, expected in (("snapshot", "guides/snapshots/"), ("gateway", "agents/"), ("LoRA", "training/lora/")):
            page.click("input.md-search__input")
            page.keyboard.press("Control+A")
            page.keyboard.type(term)  # typed, as a user does: search answers keystrokes
            # the results render as the index answers; wait until the page a user looks for is among them
            found = (f"[...document.querySelectorAll('.md-search-result__item a')]"
                     f".some(a => a.href.includes('{expected}'))")
            try:
                page.wait_for_function(found, timeout=20_000)
            except Exception:
                hrefs = page.eval_on_selector_all(".md-search-result__item a", "links => links.map(a => a.href)")
                raise AssertionError(f"searching {term!r} did not find {expected}: {hrefs}") from None
            page.keyboard.press("Escape")

        page.goto(served + "getting-started/")
        blocks = page.locator("div.highlight pre").count()
        copies = page.locator("div.highlight button[data-md-type=copy]")
        assert blocks >= 3 and copies.count() == blocks
        copies.first.click()  # the button copies its block
        copied = page.evaluate("navigator.clipboard.readText()")
        assert copied.strip() and copied.strip() in page.locator("div.highlight pre").first.inner_text()
        page.goto(served + "explanation/architecture/")
        page.wait_for_selector(".mermaid svg", timeout=20_000)
        assert "generators" in page.locator(".mermaid svg").first.text_content()
        page.screenshot(path=str(SCREENS / "architecture.png"), full_page=True)

        page.goto(served + "reference/api/envkit/#envkit.Env")
        assert page.locator("[id='envkit.Env']").is_visible()
        page.screenshot(path=str(SCREENS / "api-envkit-Env.png"))
        assert errors == [] and outside == [], (errors, outside)
        browser.close()
    shots = sorted(SCREENS.glob("*.png"))
    assert len(shots) == 3 and all(s.read_bytes()[:4] == b"\x89PNG" for s in shots)
    record_property("kept", f"docs site screenshots: {SCREENS} ({', '.join(s.name for s in shots)})")
