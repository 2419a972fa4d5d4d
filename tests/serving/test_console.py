"""The web console (serving/console/) in a real browser: Debian's Chromium, driven by Selenium
through chromedriver, against a real server on loopback serving HTTP beside gRPC.

The server serves a copy of the demo's index root holding two versions: the demo's own, and a
newer one built with `label` filterable from a catalog copy in which one class's label is HTML
(`<img src=x onerror=alert(1)>`), with a near-duplicates run. Every answer the pages show is
compared with what the gRPC API says; every test ends by reading the browser's log and failing
on any SEVERE entry (a JavaScript error, a refused script or style, a failed request nobody
expected). Each page's screenshot is written to runs/console-screenshots/ (SIMSEARCH_SCREENSHOTS
names another folder: `SIMSEARCH_SCREENSHOTS=docs/console pytest tests/serving/test_console.py` refreshes
the README's pictures).

Waits are for a condition the page reaches (a grid answering a new request id, a status line),
bounded generously: they end a hang, they do not time a busy machine."""

from __future__ import annotations

import csv
import os
import shutil
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.data.catalog import read_catalog
from index.build.build import run_build
from index.build.config import BuildConfig
from index.build.duplicates import DuplicatesConfig, run_duplicates
from index.versions.audit import audit_entries
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient, condition
from serving.config import ServerConfig
from tests.support.index import write_tiny_text_model
from tests.support.server import SearchServer
from training.data.glyphs import character_name

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / os.environ.get("SIMSEARCH_SCREENSHOTS", "runs/console-screenshots")
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
TOKEN = "console-admin-token"
XSS = "<img src=x onerror=alert(1)>"
K = 10  # the console's default k
WAIT_S = 60.0
DESKTOP, PHONE = (1366, 900), (390, 844)

from selenium import webdriver  # noqa: E402 — the dev extra installs it; setup.sh the browser
from selenium.common.exceptions import (  # noqa: E402
    NoAlertPresentException,
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def browser_installed() -> None:
    """Not a skip: a console nobody could test is a failure (`make setup` installs both)."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    assert not missing, f"{', '.join(missing)} missing: run scripts/setup.sh (Debian chromium, chromium-driver)"


# -- the server -------------------------------------------------------------------------------


def catalog_with_html_label(demo_run: Path, out: Path) -> tuple[Path, dict[str, str], str]:
    """The demo's test split with the first row's class relabelled as HTML: (path, id → label,
    the class's original label)."""
    source = read_catalog(demo_run / "train" / "splits" / "test.csv")
    relabelled = source.labels[0]
    labels = {}
    path = out / "catalog.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "path", "label"])
        for item_id, image, label in zip(source.ids, source.paths, source.labels, strict=True):
            labels[item_id] = XSS if label == relabelled else label
            writer.writerow([item_id, image, labels[item_id]])
    return path, labels, relabelled


class Console:
    """What the tests share: the server, a gRPC client on it, the versions, the catalog."""

    def __init__(self, server: SearchServer, client: SearchClient, root: Path, versions: list[str], catalog) -> None:
        self.server = server
        self.client = client
        self.root = root
        self.old, self.new = versions
        self.catalog = catalog  # core.data.catalog of the new version
        self.labels = dict(zip(catalog.ids, catalog.labels, strict=True))
        self.paths = dict(zip(catalog.ids, catalog.paths, strict=True))
        self.url = f"http://127.0.0.1:{server.http_port}"

    def ids_of(self, label: str) -> list[str]:
        return [i for i in self.catalog.ids if self.labels[i] == label]


@pytest.fixture(scope="module")
def console(demo_run, tmp_path_factory):
    work = tmp_path_factory.mktemp("console")
    root = work / "index"
    shutil.copytree(demo_run / "index", root)
    old = artifacts.current_version(root)
    path, _, _ = catalog_with_html_label(demo_run, work)
    text = write_tiny_text_model(work / "text", demo_run / "model")  # words answered by the newer version
    run_build(
        BuildConfig(
            model=str(demo_run / "model"), index_root=str(root), catalog=str(path), filterable=["label"],
            text_model=str(text),
        ),
        progress=False,
    )  # fmt: skip
    new = artifacts.current_version(root)
    assert new != old
    run_duplicates(DuplicatesConfig(index_root=str(root), min_score=0.99), progress=False)
    server = SearchServer(
        ServerConfig.flat(
            index_root=str(root),
            port=0,
            metrics_port=None,
            http_port=0,
            admin_token=TOKEN,
            probe_interval_s=0,  # the screenshot test runs one round itself
            probe_size=100,
            ann_sample_rate=1.0,  # every query re-run exactly: the ANN fidelity row fills in
        )
    )
    server.start()
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=60.0, admin_token=TOKEN)
    client.wait_ready(60)
    yield Console(server, client, root, [old, new], read_catalog(path))
    client.close()
    server.stop(grace=1)


# -- the browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module, with a profile of its own; never Selenium Manager."""
    os.environ["SE_OFFLINE"] = "1"  # Selenium must not look for (or download) a driver or browser
    profile = tempfile.mkdtemp(prefix="console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={DESKTOP[0]},{DESKTOP[1]}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture()
def page(browser, console):
    """The browser, checked after the test: nothing SEVERE in its log. A test that provokes a
    failed request on purpose lists the URL parts it expects in `page.expected_failures`."""
    browser.get_log("browser")  # what earlier tests left
    browser.expected_failures = []
    yield browser
    severe = severe_entries(browser, browser.expected_failures)
    assert not severe, "the console logged errors:\n" + "\n".join(severe)


def severe_entries(driver, expected: list[str]) -> list[str]:
    """SEVERE log lines, less failed loads of the URLs a test expected to fail."""
    lines = []
    for entry in driver.get_log("browser"):
        if entry["level"] != "SEVERE":
            continue
        message = entry["message"]
        if "Failed to load resource" in message and any(part in message for part in expected):
            continue
        lines.append(message)
    return lines


def wait(driver, condition, what: str, timeout: float = WAIT_S):
    # A page re-rendering while a condition reads it leaves stale elements: read again.
    return WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
    ).until(lambda d: condition(d), message=what)


def open_page(driver, console: Console, name: str) -> None:
    driver.get(f"{console.url}/#{name}")
    wait(driver, lambda d: d.find_element(By.ID, f"page-{name}").is_displayed(), f"the {name} page")
    wait(driver, lambda d: "items" in d.find_element(By.ID, "live-text").text, "GetInfo in the header")


def grid_request(driver) -> str | None:
    return driver.find_element(By.ID, "results-grid").get_attribute("data-request-id")


def results(driver, after: str | None) -> list[dict]:
    """The grid's cards once it shows an answer other than `after`'s: id, score, label as shown."""
    wait(driver, lambda d: grid_request(d) not in (None, "", after) or banner(d), "a new answer in the grid")
    assert not banner(driver), banner(driver)
    # Read in one script: element by element, a re-render between two reads would leave them stale.
    return driver.execute_script(
        """return [...document.querySelectorAll("#results-grid .card")].map((card) => ({
            id: card.getAttribute("data-id"),
            score: card.querySelector(".score").innerText,
            label: card.querySelector(".card-label").textContent,
        }));"""
    )


def banner(driver) -> str:
    """The error the console shows, if any."""
    box = driver.find_element(By.ID, "banner")
    return driver.find_element(By.ID, "banner-text").text if box.is_displayed() else ""


def search_by_item(driver, console: Console, item_id: str) -> list[dict]:
    before = grid_request(driver)
    field = driver.find_element(By.ID, "item-id")
    field.clear()
    field.send_keys(item_id)
    driver.find_element(By.CSS_SELECTOR, "#item-form button").click()
    return results(driver, before)


def use_admin_token(driver) -> None:
    """Enter the admin token as a person would: the Admin panel in the header."""
    if "has-admin" in (driver.find_element(By.TAG_NAME, "body").get_attribute("class") or ""):
        return
    driver.find_element(By.ID, "admin-toggle").click()
    driver.find_element(By.ID, "admin-token").send_keys(TOKEN)
    driver.find_element(By.CSS_SELECTOR, "#admin-panel button[type=submit]").click()
    wait(driver, lambda d: not d.find_element(By.ID, "admin-panel").is_displayed(), "the token accepted")


def viewport(driver, size: tuple[int, int] | None) -> None:
    """The page's viewport exactly `size` CSS pixels (a phone's below 600 wide), or the window's again."""
    if size is None:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        return
    metrics = {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": size[0] < 600}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)


def screenshot(driver, name: str, size: tuple[int, int] = DESKTOP, full: bool = False) -> Path:
    """SHOTS/NAME.png at `size`; `full`: as tall as the page (up to twice the height)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    viewport(driver, size)
    if full:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        viewport(driver, (size[0], max(size[1], min(int(height), 2 * size[1]))))
    ActionChains(driver).move_to_element(driver.find_element(By.CLASS_NAME, "brand-mark")).perform()  # no hover
    time.sleep(0.5)  # layout and image decoding after a resize
    out = SHOTS / f"{name}.png"
    try:
        assert driver.save_screenshot(str(out)), out
    finally:
        viewport(driver, None)
    return out


def live_row(driver) -> str | None:
    rows = driver.find_elements(By.CSS_SELECTOR, "#versions-table tr.is-live")
    return rows[0].get_attribute("data-version") if rows else None


def no_alert(driver) -> bool:
    try:
        _ = driver.switch_to.alert
    except NoAlertPresentException:
        return True
    return False


def feedback_figure(console: Console, k: int = 1) -> float | None:
    figures = {(f.source, f.k): f.value for f in console.client.get_info().recall_at_k}
    return figures.get(("feedback", k))


# -- the tests --------------------------------------------------------------------------------


def test_an_upload_shows_the_grpc_answer_and_search_by_this_its_neighbours(page, console):
    open_page(page, console, "search")
    query = console.catalog.ids[len(console.catalog.ids) // 2]
    page.find_element(By.ID, "file-input").send_keys(str(console.paths[query]))
    shown = results(page, None)
    expected = console.client.search_image(console.paths[query], k=K)
    assert [c["id"] for c in shown] == [n.id for n in expected.neighbors]
    assert [c["score"] for c in shown] == [f"{n.score:.3f}" for n in expected.neighbors]
    assert [c["label"] for c in shown] == [n.label for n in expected.neighbors]
    assert "round trip" in page.find_element(By.ID, "timings").text  # the call's time

    # "Search by this" on the third result: the grid becomes that item's own neighbours.
    third = shown[2]["id"]
    before = grid_request(page)
    page.find_elements(By.CSS_SELECTOR, "#results-grid .card .by-this")[2].click()
    by_item = results(page, before)
    assert [c["id"] for c in by_item] == [n.id for n in console.client.search_item(third, k=K).neighbors]
    assert third not in [c["id"] for c in by_item]  # an item query leaves the item itself out
    assert third in page.find_element(By.ID, "query-caption").text


def test_words_show_the_grpc_answer_and_add_to_an_image_query(page, console):
    """Issue 49: the words box (shown because the live version has a text model) answers what
    gRPC answers the text; with "the words add to the image" ticked, an image query and the words
    are one query of two parts, as gRPC answers them."""
    assert console.client.get_info().text_model_id
    open_page(page, console, "search")
    wait(page, lambda d: d.find_element(By.ID, "text-form").is_displayed(), "the words box")
    before = grid_request(page)
    page.find_element(By.ID, "text-query").send_keys("latin capital letter a")
    page.find_element(By.CSS_SELECTOR, "#text-form button").click()
    shown = results(page, before)
    expected = console.client.search(pb.SearchRequest(text="latin capital letter a", k=K))
    assert [c["id"] for c in shown] == [n.id for n in expected.neighbors]
    assert "latin capital letter a" in page.find_element(By.ID, "query-caption").text
    screenshot(page, "search-text")

    query = console.catalog.ids[3]
    before = grid_request(page)
    page.find_element(By.ID, "file-input").send_keys(str(console.paths[query]))
    results(page, before)
    page.find_element(By.ID, "text-with-image").click()
    field = page.find_element(By.ID, "text-query")
    field.clear()
    field.send_keys("bold")
    before = grid_request(page)
    page.find_element(By.CSS_SELECTOR, "#text-form button").click()
    mixed = results(page, before)
    parts = [pb.QueryPart(image=Path(console.paths[query]).read_bytes()), pb.QueryPart(text="bold")]
    expected = console.client.search(pb.SearchRequest(parts=parts, k=K))
    assert [c["id"] for c in mixed] == [n.id for n in expected.neighbors]
    assert "+ “bold”" in page.find_element(By.ID, "query-caption").text


# In the page: fetch an item's thumbnail, wrap it as a File and hand it over as a drop on the drop
# zone or as a paste on the page, as a person's drag or Ctrl+V would.
HAND_OVER = """
const [url, how, done] = arguments;
fetch(url).then((r) => r.blob()).then((blob) => {
  const data = new DataTransfer();
  data.items.add(new File([blob], "handed.img", { type: blob.type }));
  const init = { bubbles: true, cancelable: true };
  if (how === "drop") {
    document.getElementById("dropzone").dispatchEvent(new DragEvent("drop", { ...init, dataTransfer: data }));
  } else {
    document.dispatchEvent(new ClipboardEvent("paste", { ...init, clipboardData: data }));
  }
  done(true);
}, (err) => done(String(err)));
"""


def test_a_dropped_or_pasted_image_shows_the_grpc_answer(page, console):
    open_page(page, console, "search")
    for how, item_id in (("drop", console.catalog.ids[11]), ("paste", console.catalog.ids[12])):
        url = f"{console.url}/v1/items/{urllib.parse.quote(item_id, safe='')}/thumbnail"
        image = urllib.request.urlopen(url, timeout=WAIT_S).read()
        before = grid_request(page)
        assert page.execute_async_script(HAND_OVER, url, how) is True
        shown = results(page, before)
        assert [c["id"] for c in shown] == [n.id for n in console.client.search_image(image, k=K).neighbors], how
        assert page.find_element(By.ID, "query-preview").is_displayed()


def test_bad_input_is_refused_in_the_page_or_shows_the_servers_message(page, console):
    open_page(page, console, "search")
    search_by_item(page, console, console.catalog.ids[0])
    answered = grid_request(page)
    # A min score outside [-1, 1]: the form refuses it, no request leaves.
    page.find_element(By.ID, "min-score").send_keys("5")
    page.find_element(By.ID, "search-button").click()
    assert page.execute_script("return document.getElementById('min-score').matches(':invalid')")
    time.sleep(0.5)
    assert grid_request(page) == answered and not banner(page)
    page.find_element(By.ID, "min-score").clear()

    # An unknown item id: the server's error, as it words it.
    page.expected_failures += ["/v1/search", "/thumbnail"]  # the 400 (and the missing preview) are the point
    field = page.find_element(By.ID, "item-id")
    field.clear()
    field.send_keys("no/such-item")
    page.find_element(By.CSS_SELECTOR, "#item-form button").click()
    wait(page, banner, "the error banner")
    assert banner(page) == "search: INVALID_ARGUMENT: unknown item id 'no/such-item'"
    assert page.find_elements(By.CSS_SELECTOR, "#results-grid .card") == []


def test_a_filter_narrows_the_grid(page, console):
    open_page(page, console, "search")
    query = console.catalog.ids[0]
    others = sorted({label for label in console.labels.values() if label not in (console.labels[query], XSS)})
    wanted = others[len(others) // 2]
    unfiltered = search_by_item(page, console, query)
    assert {c["label"] for c in unfiltered} != {wanted}

    field = page.find_element(By.ID, "filter-label")  # built from GetInfo.filterable
    field.send_keys(wanted)
    before = grid_request(page)
    page.find_element(By.ID, "search-button").click()
    narrowed = results(page, before)
    expected = console.client.search_item(query, k=K, filter=pb.Filter(must=[condition("label", wanted)]))
    assert len(narrowed) == K and {c["label"] for c in narrowed} == {wanted}
    assert [c["id"] for c in narrowed] == [n.id for n in expected.neighbors]
    field.clear()


def test_a_label_holding_html_shows_as_text(page, console):
    open_page(page, console, "search")
    marked = console.ids_of(XSS)
    shown = search_by_item(page, console, marked[0])
    assert XSS in [c["label"] for c in shown]
    for card in page.find_elements(By.CSS_SELECTOR, "#results-grid .card"):
        if card.get_attribute("data-id") in marked:
            assert card.find_element(By.CSS_SELECTOR, ".card-label").text == XSS
    assert page.find_elements(By.CSS_SELECTOR, 'img[src="x"]') == []  # nothing parsed it as HTML
    assert no_alert(page)


def test_feedback_marks_move_the_feedback_recall(page, console):
    open_page(page, console, "search")
    assert feedback_figure(console) is None  # no feedback yet on this server

    # Relevant on the first result: a hit at rank 1.
    search_by_item(page, console, console.catalog.ids[3])
    page.find_element(By.CSS_SELECTOR, "#results-grid .card .mark-yes").click()
    wait(page, lambda d: "Feedback recorded" in d.find_element(By.ID, "search-status").text, "feedback recorded")
    wait(page, lambda d: feedback_figure(console) == 1.0, "feedback Recall@1 at 1.0")
    assert page.find_element(By.CSS_SELECTOR, "#results-grid .card").get_attribute("class").split().count("marked-yes")

    # Not relevant on another answer: a miss, Recall@1 over the two answers is 0.5.
    search_by_item(page, console, console.catalog.ids[4])
    page.find_element(By.CSS_SELECTOR, "#results-grid .card .mark-no").click()
    wait(page, lambda d: feedback_figure(console) == 0.5, "feedback Recall@1 at 0.5")

    # The Health page shows the same figure.
    open_page(page, console, "health")
    cell = '#recall-table tr[data-source="feedback"] td[data-k="1"]'
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, cell), "the feedback row")
    assert float(page.find_element(By.CSS_SELECTOR, cell).get_attribute("data-value")) == 0.5
    assert page.find_element(By.CSS_SELECTOR, cell).text.startswith("50.0%")


def test_search_versions_and_duplicates_pages_are_screenshotted(page, console):
    """Each page with its data, at desktop width (and Search at 390 px): the README's pictures.
    (Health's is the last test's, once the module's traffic has filled its charts.)"""
    client = console.client
    open_page(page, console, "search")
    query = next(i for i in console.catalog.ids if console.labels[i] != XSS)
    page.find_element(By.ID, "file-input").send_keys(str(console.paths[query]))
    results(page, None)
    screenshot(page, "search")
    screenshot(page, "search-390", PHONE, full=True)
    # At 390 px the grid is two columns and nothing runs off the side.
    viewport(page, PHONE)
    try:
        widths = page.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert widths == [PHONE[0], PHONE[0]], widths
        columns = page.execute_script(
            "return getComputedStyle(document.getElementById('results-grid')).gridTemplateColumns.split(' ').length"
        )
        assert columns == 2
    finally:
        viewport(page, None)

    info = client.get_info()
    open_page(page, console, "versions")
    use_admin_token(page)
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#versions-table tbody tr")) == 2, "two versions")
    assert live_row(page) == info.index_version == console.new
    wait(page, lambda d: d.find_element(By.ID, "neighbours-figure").is_displayed(), "the live neighbours.png")
    decoded = "const i = document.getElementById('neighbours-image'); return i.complete && i.naturalWidth > 0"
    wait(page, lambda d: d.execute_script(decoded), "neighbours.png decoded")
    screenshot(page, "versions")

    open_page(page, console, "duplicates")
    shown = "#duplicate-groups .dup-group, #duplicate-groups .notice"
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, shown), "the groups")
    groups = page.find_elements(By.CSS_SELECTOR, "#duplicate-groups .dup-group")
    assert groups, "the fixture's duplicates run found no groups: pick a lower min_score"
    first = groups[0].find_elements(By.CSS_SELECTOR, ".dup-member")
    assert first and first[0].get_attribute("data-id")
    screenshot(page, "duplicates")
    assert no_alert(page)


def test_versions_show_the_probe_interval_and_never_round_a_lesser_recall_up_to_exact(page, console):
    """An ANN recall of 0.9995 (a Flat index counting ties by identity read that) is 99.95%, not
    100.0%; each probe Recall@K shows its 95% interval beneath it."""
    manifest = artifacts.version_dir(console.root, console.old) / artifacts.MANIFEST
    kept = manifest.read_text()
    data = artifacts.read_manifest(manifest.parent)
    data["quality"]["ann_recall_at_k"] = 0.9995
    artifacts.write_json_atomic(manifest, data)
    try:
        open_page(page, console, "versions")
        use_admin_token(page)
        wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#versions-table tbody tr")) == 2, "two versions")
        cells = {
            v: page.find_elements(By.CSS_SELECTOR, f'#versions-table tr[data-version="{v}"] td')
            for v in (console.old, console.new)
        }
        assert cells[console.old][4].text == "99.95%"
        # The text model answering each version's words (issue 49), under its model: the demo's
        # LiT tower for the demo's version, the tiny one for the newer.
        demo_text = IndexManifest.read(artifacts.version_dir(console.root, console.old)).text_model_id
        model_id = console.client.get_info().model_id
        assert cells[console.new][3].text.splitlines() == [model_id, "words: tinytext00000000"]
        assert cells[console.old][3].text.splitlines() == [model_id, f"words: {demo_text}"]
        probe = cells[console.new][5]  # Probe R@1
        interval = probe.find_element(By.CSS_SELECTOR, ".probe-interval").text
        low, high = (float(p.rstrip("%")) for p in interval.split("–"))
        assert low <= float(probe.text.splitlines()[0].rstrip("%")) <= high
        assert probe.get_attribute("title").startswith("95% confidence interval (Wilson) of ")
    finally:
        manifest.write_text(kept)


def test_making_another_version_live_changes_getinfo(page, console):
    open_page(page, console, "versions")
    use_admin_token(page)
    for target, was in ((console.old, console.new), (console.new, console.old)):
        row = f'#versions-table tr[data-version="{target}"]'
        wait(page, lambda d, row=row: d.find_elements(By.CSS_SELECTOR, f"{row} .make-live"), f"{target}'s row")
        button = page.find_element(By.CSS_SELECTOR, f"{row} .make-live")
        button.click()
        assert "Confirm" in button.text and console.client.get_info().index_version == was  # one click: no switch
        button.click()
        wait(page, lambda d, t=target: f"Now live: {t}" in d.find_element(By.ID, "versions-status").text, "the switch")
        assert console.client.get_info().index_version == target
        assert artifacts.current_version(console.root) == target  # what `index rollback --to` does
        wait(page, lambda d, t=target: live_row(d) == t, "the live row moved")
        assert target in page.find_element(By.ID, "live-text").text  # the header's GetInfo


def test_a_takedown_leaves_the_next_search_and_is_audited(page, console):
    client = console.client
    assert client.get_info().index_version == console.new
    query = console.catalog.ids[7]
    open_page(page, console, "search")
    answer = [c["id"] for c in search_by_item(page, console, query)]
    size = client.get_info().index_size

    open_page(page, console, "duplicates")
    use_admin_token(page)
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#duplicate-groups .dup-select"), "selectable groups")
    member = page.find_element(By.CSS_SELECTOR, "#duplicate-groups .dup-member.selectable")
    ticked = member.get_attribute("data-id")
    top = next(i for i in answer if i != ticked)
    member.find_element(By.CSS_SELECTOR, ".dup-select").click()
    ids = page.find_element(By.ID, "takedown-ids")
    assert ids.get_attribute("value").split("\n") == [ticked]
    ids.send_keys("\n" + top + "\nno-such-item")
    page.find_element(By.ID, "takedown-reason").send_keys("console test: a notice")
    # After the takedown the live version is a new one with no duplicates run yet: the page says so.
    page.find_element(By.ID, "takedown-button").click()
    wait(page, lambda d: "Removed 2 of 3" in d.find_element(By.ID, "takedown-result").text, "the takedown")

    info = client.get_info()
    assert info.index_version not in (console.old, console.new) and info.index_size == size - 2
    assert top not in [n.id for n in client.search_item(query, k=K).neighbors]
    entry = page.find_element(By.CSS_SELECTOR, "#audit-list .audit-entry")  # newest first
    assert "console test: a notice" in entry.text and top in entry.text and ticked in entry.text
    # The ids removed, then the one not found, each named as what it is.
    line = entry.find_element(By.CSS_SELECTOR, ".audit-ids").text
    assert line == f"2 of 3 removed: {ticked}, {top}; 1 not found: no-such-item", line

    # The next search in the browser no longer shows the item.
    open_page(page, console, "search")
    after = search_by_item(page, console, query)
    assert top not in [c["id"] for c in after]
    assert [c["id"] for c in after] == [n.id for n in client.search_item(query, k=K).neighbors]


def audit_head(driver) -> tuple[str, str]:
    """The newest audit entry on the Duplicates page: its action and its ids line."""
    entry = driver.find_element(By.CSS_SELECTOR, "#audit-list .audit-entry")
    return entry.get_attribute("data-action"), entry.find_element(By.CSS_SELECTOR, ".audit-ids").text


def make_live(driver, version: str) -> str:
    """Click Make live on `version`'s row, then its confirm: the confirm button's text."""
    row = f'#versions-table tr[data-version="{version}"]'
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, f"{row} .make-live"), f"{version}'s row")
    button = driver.find_element(By.CSS_SELECTOR, f"{row} .make-live")
    button.click()
    confirm = button.text
    button.click()
    return confirm


def test_making_a_version_live_keeps_what_was_taken_down_since_unless_restored(page, console):
    """After the takedown above, making the version it was made on live again re-applies it; the
    Restore box republishes the items, and says so before and after."""
    taken = sorted({i for e in audit_entries(console.root) if e["action"] == "remove" for i in e["ids"]})
    assert len(taken) == 2 and console.client.get_info().index_version not in (console.old, console.new)
    open_page(page, console, "versions")
    use_admin_token(page)
    assert make_live(page, console.new) == "Confirm: make live"
    status = "versions-status"
    wait(page, lambda d: "takedowns made since" in d.find_element(By.ID, status).text, "the rollback")
    derived = console.client.get_info().index_version
    assert derived not in (console.old, console.new) and artifacts.current_version(console.root) == derived
    said = page.find_element(By.ID, status).text
    assert f"Now live: {derived}" in said
    assert f"2 takedowns made since {console.new} re-applied ({', '.join(taken)})" in said
    for item_id in taken:  # still down
        assert item_id not in [n.id for n in console.client.search_item(console.catalog.ids[7], k=K).neighbors]
    open_page(page, console, "duplicates")
    wait(page, lambda d: audit_head(d)[0] == "rollback", "the rollback in the audit log")
    assert audit_head(page)[1] == f"re-applied 2 takedowns: {', '.join(taken)}"

    open_page(page, console, "versions")
    page.find_element(By.ID, "restore-taken-down").click()
    assert make_live(page, console.new) == "Confirm: make live, restoring taken-down items"
    wait(page, lambda d: "taken-down items restored" in d.find_element(By.ID, status).text, "the restore")
    assert f"2 taken-down items restored ({', '.join(taken)})" in page.find_element(By.ID, status).text
    assert console.client.get_info().index_version == console.new == artifacts.current_version(console.root)
    assert not page.find_element(By.ID, "restore-taken-down").is_selected()  # one restore per tick
    screenshot(page, "versions-restored")
    open_page(page, console, "duplicates")
    wait(page, lambda d: audit_head(d)[0] == "restore", "the restore in the audit log")
    assert audit_head(page)[1] == f"restored 2 taken-down items: {', '.join(taken)}"


def test_health_shows_the_live_figures_and_the_last_hour(page, console):
    """Last: by now the module's traffic spans several of the history's intervals."""
    server, client = console.server, console.client
    server.monitor.run_probe(server.run_probe)  # one probe round: the probe row
    for item_id in console.catalog.ids[::40][:20]:  # labelled traffic: the traffic row
        client.search_image(console.paths[item_id], k=8, label=console.labels[item_id])
    glyphs = [i for i in console.catalog.ids if console.labels[i].startswith("U+")]  # not the HTML label
    for item_id in glyphs[::80][:10]:  # labelled words: the text row, apart
        name = character_name(console.labels[item_id])  # what the demo's text tower was trained on
        client.search(pb.SearchRequest(text=name, k=8, label=console.labels[item_id]))
    open_page(page, console, "health")
    for source in ("probe", "traffic", "text", "ann"):
        cell = f'#recall-table tr[data-source="{source}"] td[data-k="1"][data-value]'
        wait(page, lambda d, cell=cell: d.find_elements(By.CSS_SELECTOR, cell), f"{source} Recall@1 on Health")
        shown = float(page.find_element(By.CSS_SELECTOR, cell).get_attribute("data-value"))
        figures = {
            (f.source, f.k): f.value for f in [*client.get_info().recall_at_k, *client.get_info().ann_recall_at_k]
        }
        assert shown == pytest.approx(figures[(source, 1)], abs=0.05)  # the figure can move between the two reads
    for chart in ("chart-qps", "chart-latency"):
        series = f"#{chart} polyline, #{chart} circle"
        wait(page, lambda d, series=series: d.find_elements(By.CSS_SELECTOR, series), f"the {chart} series")
    info = client.get_info()
    live = page.find_element(By.ID, "health-live").text
    assert info.index_version in live and info.model_id in live and f"{info.index_size:,}" in live
    screenshot(page, "health", full=True)


# -- a catalog of items: grouped answers, query parts, regions -----------------------------------


@pytest.fixture(scope="module")
def catalog_console(demo_run, tmp_path_factory):
    """A server over the demo's test split indexed with its label as the item field (a glyph
    set's character is the item; its faces are the item's images)."""
    work = tmp_path_factory.mktemp("catalog-console")
    root = work / "index"
    split = read_catalog(demo_run / "train" / "splits" / "test.csv")
    characters = set(split.classes[:16])  # a few thousand images: the build stays short
    catalog = split.subset(i for i, label in enumerate(split.labels) if label in characters).write(work / "catalog.csv")
    cfg = BuildConfig(model=str(demo_run / "model"), index_root=str(root), catalog=str(catalog), item_field="label")
    run_build(cfg, progress=False)
    config = ServerConfig.flat(index_root=str(root), port=0, metrics_port=None, http_port=0, probe_interval_s=0)
    server = SearchServer(config)
    server.start()
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=60.0)
    client.wait_ready(60)
    version = artifacts.current_version(root)
    yield Console(server, client, root, [version, version], read_catalog(catalog))
    client.close()
    server.stop(grace=1)


@pytest.fixture()
def catalog_page(browser, catalog_console):
    browser.get_log("browser")
    yield browser
    severe = severe_entries(browser, [])
    assert not severe, "the console logged errors:\n" + "\n".join(severe)


def grouped_results(driver, after: str | None) -> list[tuple[str, str]]:
    results(driver, after)
    pairs = driver.execute_script(
        """return [...document.querySelectorAll("#results-grid .card")].map(
            (card) => [card.getAttribute("data-id"), card.getAttribute("data-group")]);"""
    )
    return [tuple(p) for p in pairs]


def answer_of(response: pb.SearchResponse) -> list[tuple[str, str]]:
    return [(n.id, n.group) for n in response.neighbors]


def test_grouped_answers_query_parts_and_a_dragged_region(catalog_page, catalog_console):
    page, console = catalog_page, catalog_console
    open_page(page, console, "search")
    select = page.find_element(By.ID, "group-by")
    assert select.get_attribute("value") == "label"  # the index's item field, chosen by default
    query = console.catalog.ids[7]
    image = console.paths[query].read_bytes()
    page.find_element(By.ID, "file-input").send_keys(str(console.paths[query]))
    shown = grouped_results(page, None)
    expected = console.client.search(pb.SearchRequest(image=image, k=K))
    assert shown == answer_of(expected) and len({g for _, g in shown}) == K
    assert f"{K} label groups" in page.find_element(By.ID, "search-status").text

    # Two images per group.
    per_group = page.find_element(By.ID, "per-group")
    per_group.clear()
    per_group.send_keys("2")
    before = grid_request(page)
    page.find_element(By.ID, "search-button").click()
    shown = grouped_results(page, before)
    assert shown == answer_of(console.client.search(pb.SearchRequest(image=image, k=K, per_group=2)))
    assert len(shown) == 2 * K

    # "+ like" the second group's first image, "− not like" the third's: both join the query.
    cards = {c["id"]: i for i, c in enumerate(results(page, None))}
    liked, unliked = shown[2][0], shown[4][0]
    before = grid_request(page)
    page.find_elements(By.CSS_SELECTOR, "#results-grid .card .like")[cards[liked]].click()
    grouped_results(page, before)
    before = grid_request(page)
    index = {c["id"]: i for i, c in enumerate(results(page, None))}[unliked]
    page.find_elements(By.CSS_SELECTOR, "#results-grid .card .unlike")[index].click()
    shown = grouped_results(page, before)
    parts = [pb.QueryPart(image=image), pb.QueryPart(item_id=liked), pb.QueryPart(item_id=unliked, negative=True)]
    assert shown == answer_of(console.client.search(pb.SearchRequest(parts=parts, k=K, per_group=2)))
    chips = [c.text.replace("\n", "") for c in page.find_elements(By.CSS_SELECTOR, "#query-parts .part")]
    assert chips == [f"+ like {liked}✕", f"− not like {unliked}✕"]
    weights = page.find_elements(By.CSS_SELECTOR, "#query-parts .part-weight")
    assert [w.get_attribute("value") for w in weights] == ["1", "0.2"]  # the server's defaults, shown

    # The "not like" part pushing as hard as the others pull: its weight box, then Enter.
    before = grid_request(page)
    weights[1].send_keys(Keys.CONTROL, "a")
    weights[1].send_keys("1", Keys.TAB)  # leaving the box commits it
    shown = grouped_results(page, before)
    parts[2].weight = 1.0
    assert shown == answer_of(console.client.search(pb.SearchRequest(parts=parts, k=K, per_group=2)))

    # A region dragged over the query image: the answer is the crop's.
    page.find_element(By.ID, "region-button").click()
    preview = page.find_element(By.ID, "query-preview")
    size = preview.size
    before = grid_request(page)
    drag = ActionChains(page).move_to_element_with_offset(preview, -size["width"] // 4, -size["height"] // 4)
    drag.click_and_hold().move_by_offset(size["width"] // 2, size["height"] // 2).release().perform()
    shown = grouped_results(page, before)
    text = page.find_element(By.ID, "region-text").text  # "region X,Y W×H px"
    x, y = (int(v) for v in text.split()[1].split(","))
    width, height = (int(v) for v in text.split()[2].split("×"))
    assert 8 <= width <= 28 and 8 <= height <= 28
    assert page.find_element(By.ID, "region-box").is_displayed()
    parts[0].region.CopyFrom(pb.Region(x=x, y=y, width=width, height=height))
    assert shown == answer_of(console.client.search(pb.SearchRequest(parts=parts, k=K, per_group=2)))
    screenshot(page, "search-grouped")


def box_against_picture(driver) -> dict:
    """The region box's rect, and where the region (from the page's "region X,Y W×H px") falls on
    the picture as it is laid out now (object-fit: contain letterboxes it)."""
    return driver.execute_script(
        """const img = document.getElementById('query-preview');
        const box = document.getElementById('region-box');
        const [xy, wh] = document.getElementById('region-text').textContent.split(' ').slice(1, 3);
        const [x, y] = xy.split(',').map(Number);
        const [w, h] = wh.split('×').map(Number);
        const r = img.getBoundingClientRect();
        const scale = Math.min(r.width / img.naturalWidth, r.height / img.naturalHeight);
        const left = r.left + (r.width - img.naturalWidth * scale) / 2;
        const top = r.top + (r.height - img.naturalHeight * scale) / 2;
        const b = box.getBoundingClientRect();
        return {box: [b.left, b.top, b.width, b.height],
                region: [left + x * scale, top + y * scale, w * scale, h * scale], shown: !box.hidden};"""
    )


def cut_marks(driver) -> list[str]:
    """The relevance buttons whose text does not fit them, or that run past their card."""
    return driver.execute_script(
        """return [...document.querySelectorAll('#results-grid .card')].flatMap((card) => {
            const body = card.querySelector('.card-body').getBoundingClientRect();
            return [...card.querySelectorAll('.mark')]
                .filter((b) => b.scrollWidth > b.clientWidth || b.getBoundingClientRect().right > body.right + 0.5)
                .map((b) => `${card.getAttribute('data-id')}: ${b.textContent} ${b.scrollWidth}/${b.clientWidth}`);
        });"""
    )


def test_relevance_buttons_fit_and_the_region_box_follows_the_picture(catalog_page, catalog_console):
    page, console = catalog_page, catalog_console
    open_page(page, console, "search")
    query = console.catalog.ids[3]
    page.find_element(By.ID, "file-input").send_keys(str(console.paths[query]))
    results(page, None)
    for width in (1366, 1280, 1100, 1000, 900, 800, 600, 390):  # the grid's columns, and the cards, change
        viewport(page, (width, 900))
        try:
            wait(page, lambda d, w=width: d.execute_script("return window.innerWidth") == w, f"{width} px")
            assert not cut_marks(page), (width, cut_marks(page))
        finally:
            viewport(page, None)
    assert "✓ Yes" in [b.text for b in page.find_elements(By.CSS_SELECTOR, "#results-grid .mark-yes")]

    page.find_element(By.ID, "region-button").click()
    preview = page.find_element(By.ID, "query-preview")
    size = preview.size
    before = grid_request(page)
    drag = ActionChains(page).move_to_element_with_offset(preview, -size["width"] // 4, -size["height"] // 4)
    drag.click_and_hold().move_by_offset(size["width"] // 2, size["height"] // 2).release().perform()
    results(page, before)

    def box_on_region(d) -> bool:
        placed = box_against_picture(d)
        return placed["shown"] and all(abs(a - b) < 0.75 for a, b in zip(placed["box"], placed["region"], strict=True))

    wait(page, box_on_region, "the box on the region")
    original = page.get_window_size()
    try:
        page.set_window_size(700, 900)  # the narrow layout: a smaller picture
        wait(page, box_on_region, "the box on the region after a window resize")
        # Resized while another page shows (the search page hidden): redrawn on coming back.
        page.get(f"{console.url}/#health")
        wait(page, lambda d: d.find_element(By.ID, "page-health").is_displayed(), "the health page")
        page.set_window_size(original["width"], original["height"])
        page.get(f"{console.url}/#search")
        wait(page, lambda d: d.find_element(By.ID, "page-search").is_displayed(), "the search page again")
        wait(page, box_on_region, "the box on the region after a resize on another page")
    finally:
        page.set_window_size(original["width"], original["height"])
    screenshot(page, "search-region")


def test_versions_show_how_their_rows_lie_in_segments(page, console):
    """Issue 48: a takedown writes tombstones and an ingest a segment; the Versions page says how
    many segments (and shards) each version's rows lie in, as its manifest does."""
    dim = console.client.get_info().embedding_dim
    vector = pb.Embedding(values=[1.0] + [0.0] * (dim - 1))
    added = console.client.add_items([pb.NewItem(id="console-added", embedding=vector, label="console")])
    open_page(page, console, "versions")
    use_admin_token(page)
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, f'#versions-table tr[data-version="{added.index_version}"]'),
         "the ingested version")  # fmt: skip
    for version in artifacts.list_versions(console.root):
        manifest = IndexManifest.read(artifacts.version_dir(console.root, version))
        cell = page.find_elements(By.CSS_SELECTOR, f'#versions-table tr[data-version="{version}"] td')[2]
        layout = cell.find_elements(By.CLASS_NAME, "version-layout")
        if manifest.segments:
            count = len(manifest.segments)
            assert layout and layout[0].text == f"{count} segment{'s' if count > 1 else ''}", version
        else:
            assert not layout, version
    assert len(IndexManifest.read(artifacts.version_dir(console.root, added.index_version)).segments) >= 2
    screenshot(page, "versions-segments")
