"""A real browser (Playwright driving Debian's Chromium): an organizer creates a run on the new-run form, uploading
its text, and a run's dashboard lists its checkpoints and charts their evaluation loss."""

from __future__ import annotations

import hashlib
import io
import tarfile

from app.runs import checkpoints, registry
from tests.support.browsers import needs_chromium

pytestmark = needs_chromium
TEXT = "\n".join(f"the quick brown fox {i} jumps over the lazy dog, line {i * 7}" for i in range(200)).encode()


def test_an_organizer_creates_a_run_in_the_browser(start_portal, page, output_dir):
    portal = start_portal(organizers=["olivia"])
    page.goto(f"{portal.url}/signin")
    page.fill("#username", "olivia")
    page.click("#signin-dev")
    page.wait_for_url(f"{portal.url}/")
    page.click("#new-run-link")
    assert "DEDLOC_ORGANIZERS" in page.locator("main").inner_text()
    page.fill("#slug", "web-albert")
    page.fill("#title", "A small ALBERT from the web")
    assert page.locator("#task").input_value() == "masked-lm"  # the example's options stay as offered
    page.set_input_files("#files", files=[{"name": "train.txt", "mimeType": "text/plain", "buffer": TEXT}])
    page.fill("#target_epochs", "100")
    page.screenshot(path=str(output_dir / "new-run.png"), full_page=True)
    page.click("#create-run")
    page.wait_for_url(f"{portal.url}/runs/web-albert")
    assert page.locator("h1").inner_text() == "A small ALBERT from the web"

    page.goto(f"{portal.url}/")
    page.click("text=A small ALBERT from the web")
    page.wait_for_url(f"{portal.url}/runs/web-albert")
    assert page.locator("#organize-link").is_visible()  # the creator organizes the run
    with portal.db() as session:
        assert registry.organizers(session, registry.get_run(session, "web-albert")) == ["olivia"]


def tar_of(name: str, body: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def test_the_dashboard_lists_checkpoints_and_charts_their_evaluation_loss(start_portal, page, tmp_path,
                                                                          output_dir):
    portal = start_portal()
    folder = checkpoints.checkpoints_dir(tmp_path, "saved")  # the portal's data folder is tmp_path
    folder.mkdir(parents=True)
    with portal.db() as session:
        run = registry.create_run(session, slug="saved", title="A run with checkpoints")
        for epoch, loss in ((5, 6.25), (10, 5.5)):
            archive = tar_of("config.json", b'{"model_type": "albert"}')
            (folder / f"epoch-{epoch}.tar").write_bytes(archive)
            checkpoints.store_archive(session, tmp_path, run, epoch=epoch, samples=epoch * 256, eval_loss=loss,
                                      sha256=hashlib.sha256(archive).hexdigest(), size=len(archive),
                                      file_name=f"epoch-{epoch}.tar", final=False, keep=5)
        session.commit()

    page.goto(f"{portal.url}/runs/saved")
    table = page.locator("table#checkpoints").inner_text()
    assert "10" in table and "5.5000" in table and "6.2500" in table and "2,560" in table
    page.wait_for_function("Chart.getChart('chart-eval').data.datasets[0].data.length === 2")
    assert page.evaluate("Chart.getChart('chart-eval').data.datasets[0].data") == [  # oldest first
        {"x": 5, "y": 6.25}, {"x": 10, "y": 5.5}]
    page.screenshot(path=str(output_dir / "dashboard-checkpoints.png"), full_page=True)
    link = page.locator("table#checkpoints a").first.get_attribute("href")
    download = page.request.get(link)
    assert download.ok and hashlib.sha256(download.body()).hexdigest() == hashlib.sha256(
        (folder / "epoch-10.tar").read_bytes()).hexdigest()
