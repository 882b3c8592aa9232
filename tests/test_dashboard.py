"""The coordinator's live dashboard: its JSON API and files, and the page itself in headless Chromium during a run.

Run as a script (`python tests/test_dashboard.py docs/dashboard.png`) it makes the README's screenshot from a
longer run; in the suite, DILOCO_SCREENSHOT=PATH saves the test's screenshot there instead of tmp_path.
"""

from __future__ import annotations

import fcntl
import http.client
import inspect
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import island_on, one_island_config, tiny_config
from coordinator.web import RunWebServer
from coordinator.snapshot import run_snapshot
from islands.client import CoordinatorClient
from islands.island import Island, IslandResult
from islands.world import IslandWorld

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _get(server: RunWebServer, path: str) -> tuple[int, bytes, str]:
    """A GET of the raw path (http.client sends it as written: no dot segments are resolved on the way)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read(), response.getheader("Content-Type", "")
    finally:
        conn.close()


def test_the_api_the_files_the_metrics_and_stop(make_coordinator):
    cfg = one_island_config("rounds.rounds=2")
    coordinator = make_coordinator(cfg)
    with island_on(coordinator, cfg) as island:
        island.run()
    server = RunWebServer(coordinator.state).start()
    try:
        status, body, kind = _get(server, "/api/run")
        assert status == 200 and kind == "application/json"
        snap = json.loads(body)
        assert snap["run"] == {"name": cfg.name, "codec": "fp32", "downlink_codec": "fp32", "fragments": 1, "total_rounds": 2,
                               "islands_min": 1, "islands_max": cfg.rounds.max_islands, "inner_steps": 2}
        assert snap["finished"] and snap["round"] == 2 and snap["next_since"] == 2
        assert [r["index"] for r in snap["rounds"]] == [0, 1] and [r["round"] for r in snap["rounds"]] == [0, 1]
        assert snap["initial_eval_loss"] is None and all(r["eval_loss"] is None for r in snap["rounds"])  # eval is off
        (only,) = snap["islands"]
        assert only["island_id"] == "island-0" and only["status"] == "departed" and only["lease_age_s"] is None
        assert only["tokens"] == sum(r["tokens"] for r in snap["rounds"]) > 0 and only["last_push"] > 0
        assert only["bytes_up"] == sum(r["bytes_up"] for r in snap["rounds"]) > 0
        assert snap["bytes_total"] == sum(r["bytes_up"] + r["bytes_down"] for r in snap["rounds"])
        assert snap["traffic_factor"] == 0.0  # one island: data-parallel would send nothing
        assert set(snap["rounds"][0]) >= {"wait_s", "fold_s", "step_s", "publish_s", "eval_s", "closed_at", "contributions", "traffic"}
        # Only the rounds asked for; the sums stay over the whole run.
        later = json.loads(_get(server, "/api/run?since=1")[1])
        assert [r["index"] for r in later["rounds"]] == [1] and later["islands"] == snap["islands"]
        assert json.loads(_get(server, "/api/run?since=5")[1])["rounds"] == []
        assert _get(server, "/api/run?since=x")[0] == 400

        status, body, kind = _get(server, "/")
        assert status == 200 and kind.startswith("text/html") and b"/static/dashboard.js" in body
        assert _get(server, "/static/dashboard.js")[2].startswith("text/javascript")
        assert _get(server, "/static/dashboard.css")[2].startswith("text/css")
        # Nothing but the dashboard's own files: no traversal, however spelled.
        for path in ("/static/../http.py", "/static/..%2Fhttp.py", "/static/%2e%2e/state.py", "/static//etc/passwd",
                     "/static/", "/static/dashboard", "/../coordinator/web.py", "/static/./dashboard.js"):
            status, body, _ = _get(server, path)
            assert status == 404 and b"def " not in body and b"root:" not in body, path
        status, body, kind = _get(server, "/metrics")
        assert status == 404 and kind.startswith("text/plain") and body.count(b"\n") == 1
        assert _get(server, "/healthz")[:2] == (200, b"ok\n")
    finally:
        server.stop()
    server.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()

    with RunWebServer(coordinator.state, metrics=lambda: (b"diloco_rounds_total 2\n", "text/plain; version=0.0.4")) as served:
        assert _get(served, "/metrics") == (200, b"diloco_rounds_total 2\n", "text/plain; version=0.0.4")
    RunWebServer(coordinator.state).stop()  # never started: closes its socket all the same


def test_a_snapshot_is_plain_json_and_cheap_to_poll(make_coordinator):
    cfg = one_island_config("rounds.rounds=3", "eval.batches=1", "eval.batch_size=2")
    coordinator = make_coordinator(cfg)
    with island_on(coordinator, cfg) as island:
        island.run()
    state = coordinator.state
    snap = run_snapshot(state)
    json.dumps(snap, allow_nan=False)  # no NaN anywhere: JSON has none
    assert snap["initial_eval_loss"] is not None and all(r["eval_loss"] is not None for r in snap["rounds"])
    # The per-island sums are folded in incrementally: a second poll with nothing new gives the same.
    assert run_snapshot(state, 3)["islands"] == snap["islands"] and run_snapshot(state, 3)["rounds"] == []


# --- the page in headless Chromium, during a run ------------------------------------------------------


@contextmanager
def held_run(coordinator, cfg, islands: int, hold_at: int) -> Iterator[tuple[threading.Event, list[IslandResult]]]:
    """`islands` CPU islands on threads of this process, training against coordinator; each waits before pushing
    round hold_at until the yielded event is set, so the page is read while the run is live and its round known.
    Heartbeats go on meanwhile (as a real island's do). Yields (release, results); joins every island after."""
    world = IslandWorld.init("cpu")
    release, results, errors = threading.Event(), [], []

    def one() -> None:
        client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
        try:
            island = Island(cfg, world, client, client.join(cfg.digest()))
            started = time.monotonic()

            def report() -> dict[str, float]:
                """What a real island reports in its heartbeats: its share of time in inner steps, throughput, loss."""
                elapsed = max(time.monotonic() - started, 1e-6)
                tokens = island.ctx.state.step * cfg.inner.batch_size * cfg.data.seq_len
                return {"utilization": min(1.0, island.ctx.timing["compute_s"] / elapsed), "tokens_per_s": tokens / elapsed,
                        "train_loss": island.losses[-1] if island.losses else 0.0}

            # Heartbeats carry a report where the client sends one (islands/client.py's report=).
            extra = {"report": report} if "report" in inspect.signature(client.start_heartbeat).parameters else {}
            client.start_heartbeat(lambda: island.ctx.state.island_id, 0.5, lambda: island.ctx.state.round, **extra)
            push = client.push

            def held(header, chunks):
                if header.round >= hold_at:
                    release.wait(120)
                return push(header, chunks)

            client.push = held
            results.append(island.run())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=one, name=f"island-thread-{i}", daemon=True) for i in range(islands)]
    for t in threads:
        t.start()
    try:
        yield release, results
    finally:
        release.set()
        for t in threads:
            t.join(120)
        world.shutdown()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "an island did not finish"


def wait_for_summaries(state, n: int, timeout_s: float = 60.0) -> None:
    with state.cond:
        assert state.cond.wait_for(lambda: len(state.summaries) >= n, timeout_s), f"{n} rounds did not close in time"


def chromium(url: str, *args: str, profile: Path, timeout_s: float = 90.0) -> str:
    """Runs headless Chromium on url (as root here: no sandbox) and returns its stdout. Its whole process group
    (renderers, GPU process) is killed if it overruns."""
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--disable-extensions", "--mute-audio", "--hide-scrollbars", f"--user-data-dir={profile}",
           "--virtual-time-budget=8000", *args, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"chromium did not finish within {timeout_s:.0f}s") from None
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {err[-2000:]}"
    return out


class DevTools:
    """Headless Chromium driven over its DevTools pipe (it reads commands on fd 3 and answers on fd 4, JSON ended by
    NUL: no websocket library needed), for what --dump-dom cannot show: computed styles, what is painted on top.
    A context manager: the browser's whole process group is killed on the way out."""

    def __init__(self, profile: Path):
        commands, self._to = (_high_fd(fd) for fd in os.pipe())
        self._from, answers = (_high_fd(fd) for fd in os.pipe())
        cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--disable-extensions", "--mute-audio", "--hide-scrollbars", "--remote-debugging-pipe",
               f"--user-data-dir={profile}", "--window-size=1400,1000", "about:blank"]
        # bash moves the pipes to fds 3 and 4 before it execs Chromium (a preexec_fn would be unsafe: island threads
        # run; dash, Debian's sh, takes no fd above 9).
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{commands} 4>&{answers}', "bash", *cmd],
                                     pass_fds=(commands, answers), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(commands)
        os.close(answers)  # ours closed, a Chromium that dies reads as the end of the pipe
        self._buffer, self._sent = b"", 0

    def __enter__(self) -> DevTools:
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        os.close(self._to)
        os.close(self._from)

    def send(self, method: str, session: str | None = None, timeout_s: float = 30.0, **params) -> dict:
        """The result of one DevTools command (in session, a page's, where given); the events between are skipped."""
        self._sent += 1
        message = {"id": self._sent, "method": method, "params": params} | ({"sessionId": session} if session else {})
        os.write(self._to, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                assert left > 0 and select.select([self._from], [], [], left)[0], f"chromium did not answer {method}"
                chunk = os.read(self._from, 1 << 16)
                assert chunk, f"chromium exited ({self.proc.poll()}) before answering {method}"
                self._buffer += chunk
            line, _, self._buffer = self._buffer.partition(b"\0")
            answer = json.loads(line)
            if answer.get("id") == self._sent:
                assert "error" not in answer, f"{method}: {answer['error']}"
                return answer["result"]

    def evaluate(self, session: str, expression: str):
        """The JSON value of a JavaScript expression in the page."""
        result = self.send("Runtime.evaluate", session, expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def open(self, url: str, until: str, timeout_s: float = 60.0) -> str:
        """A new tab on url, once the JavaScript condition until holds there; returns its session for evaluate."""
        target = self.send("Target.createTarget", url=url)["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + timeout_s
        # Polled: until may throw while the page is still loading (or still about:blank), which is a no for now.
        while not self.evaluate(session, f"(() => {{ try {{ return !!({until}); }} catch (e) {{ return false; }} }})()"):
            assert time.monotonic() < deadline, f"{url}: {until} did not hold within {timeout_s:.0f}s"
            time.sleep(0.1)
        return session


def _high_fd(fd: int) -> int:
    """fd moved to 10 or above, so that bash's `3<&A 4>&B` cannot overwrite one pipe with the other."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class PageParser(HTMLParser):
    """The dumped DOM's elements (tag, attributes) and the text inside each element with an id."""

    def __init__(self):
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: dict[str, str] = {}
        self._open: list[str | None] = []  # the ids of the elements open now (None: no id)

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a))
        if tag not in VOID:  # a void element has no end tag to pop it
            self._open.append(a.get("id"))
            if a.get("id"):
                self.text.setdefault(a["id"], "")

    def handle_data(self, data):
        for i in filter(None, self._open):
            self.text[i] += data

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def find(self, tag: str, cls: str = "", attr: str = "") -> list[dict[str, str]]:
        """The attributes of every <tag> with class cls and attribute attr (either may be left out)."""
        return [a for t, a in self.elements if t == tag and (not cls or cls in a.get("class", "").split())
                and (not attr or attr in a)]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def screenshot(url: str, path: Path, profile: Path, size: str = "1400,1000") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    chromium(url, f"--screenshot={path.resolve()}", f"--window-size={size}", profile=profile)
    width, height = png_size(path)
    assert (width, height) == tuple(int(v) for v in size.split(",")) and path.stat().st_size > 20_000


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_the_dashboard_shows_a_live_run_in_headless_chromium(make_coordinator, tmp_path):
    islands, rounds, hold_at = 3, 10, 6
    # min_islands: every round waits for all three, so each island's curve has a point every round.
    cfg = tiny_config(f"rounds.rounds={rounds}", f"rounds.min_islands={islands}", "eval.batches=2", "eval.batch_size=4")
    coordinator = make_coordinator(cfg)
    state = coordinator.state
    server = RunWebServer(state).start()
    try:
        with held_run(coordinator, cfg, islands, hold_at) as (release, results):
            wait_for_summaries(state, hold_at)
            page = PageParser()
            page.feed(chromium(server.url, "--dump-dom", profile=tmp_path / "profile"))
            with state.cond:
                closed, members = len(state.summaries), sorted(state.islands)
            assert closed == hold_at and len(members) == islands  # held: the run is live, its round known
            rows = page.find("tr", attr="data-island")
            assert sorted(a["data-island"] for a in rows) == members
            assert {a["data-status"] for a in rows} == {"live"}
            (curve,) = page.find("path", "eval-loss")
            assert int(curve["data-points"]) == closed  # every round closed so far, evaluated
            trains = page.find("path", "train-loss")
            assert sorted(a["data-island"] for a in trains) == members and {int(a["data-points"]) for a in trains} == {closed}
            assert page.text["round"].strip() == str(closed) and page.text["status-text"].strip() == "live"
            assert page.text["codec"].strip() == "fp32 ↑↓" and "less" in page.text["traffic-factor"]
            assert page.text["run-quorum"] == f"{islands} to {cfg.rounds.max_islands} islands per round"
            assert len(page.find("g", "round-bar")) == closed

            shot = Path(os.environ.get("DILOCO_SCREENSHOT") or tmp_path / "dashboard.png")
            screenshot(server.url, shot, tmp_path / "profile")
            release.set()
        assert len(results) == islands and all(r.rounds == rounds for r in results)
        # The run over, the page says so (and stops polling: the coordinator's history is complete).
        page = PageParser()
        page.feed(chromium(server.url, "--dump-dom", profile=tmp_path / "profile"))
        assert page.text["status-text"].strip() == "finished" and page.text["round"].strip() == str(rounds)
        assert {a["data-status"] for a in page.find("tr", attr="data-island")} == {"departed"}
        assert int(page.find("path", "eval-loss")[0]["data-points"]) == rounds
    finally:
        server.stop()


# What the page shows, read in the browser: the shards card's rows and whether it takes any room; each bandwidth
# curve's points and computed stroke; at how many downlink dots' centres a downlink dot is what is painted (nothing
# else covers them; two rounds closed a few ms apart may overlap their own dots); the legend's swatches; the run's
# island bounds as worded, and their tooltip.
SEEN = """(() => {
  const style = (e) => getComputedStyle(e), card = document.getElementById("shards-card");
  const curve = (cls) => {
    const e = document.querySelector(`#bandwidth-chart path.${cls}`), s = style(e);
    return { points: +e.dataset.points, stroke: s.stroke, width: parseFloat(s.strokeWidth), dash: s.strokeDasharray };
  };
  const dots = [...document.querySelectorAll("#bandwidth-chart circle.bw-down-point")];
  const onTop = dots.filter((c) => {
    const b = c.getBoundingClientRect();
    return document.elementFromPoint(b.x + b.width / 2, b.y + b.height / 2).classList.contains("bw-down-point");
  });
  const swatches = [...document.querySelectorAll("#bandwidth-legend .item")].map((i) => {
    const s = style(i.querySelector(".swatch"));
    return { label: i.textContent, color: s.backgroundColor, mask: s.maskImage };
  });
  const quorum = document.getElementById("run-quorum");
  return {
    shards_shown: card.getClientRects().length > 0, shard_rows: [...card.querySelectorAll("tbody tr")].map((r) => r.dataset.shard),
    up: curve("bw-up"), down: curve("bw-down"), dots: dots.length, dots_on_top: onTop.length, swatches,
    details: document.getElementById("run-details").textContent,
    quorum: quorum && { text: quorum.textContent, title: quorum.title, shown: quorum.getClientRects().length > 0 },
  };
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_the_page_of_a_one_process_run_has_no_shards_card_both_bandwidth_curves_and_its_island_bounds_in_words(
        make_coordinator, tmp_path, monkeypatch):
    rounds = 4
    cfg = one_island_config(f"rounds.rounds={rounds}", "rounds.min_islands=1", "rounds.max_islands=64")
    coordinator = make_coordinator(cfg)
    with island_on(coordinator, cfg) as island:
        island.run()
    finished = "document.getElementById('status').dataset.state === 'finished'"
    with RunWebServer(coordinator.state) as server, DevTools(tmp_path / "profile") as browser:
        seen = browser.evaluate(browser.open(server.url, finished), SEEN)
        # One process: no shards card at all (it was shown, empty: .card's display won over the hidden attribute).
        assert not seen["shards_shown"] and seen["shard_rows"] == []
        # fp32 both ways: the curves all but coincide (it was drawn 1 px dashed over the uplink's 1 px). Both are drawn,
        # a point a round; the downlink, dashed and narrower than the solid uplink, is painted over it (each of its
        # dots on top) and the uplink shows at its edges.
        up, down = seen["up"], seen["down"]
        assert up["points"] == down["points"] == rounds and seen["dots"] == seen["dots_on_top"] == rounds
        assert up["stroke"] != down["stroke"] and up["dash"] == "none" and down["dash"] != "none"
        assert up["width"] >= down["width"] + 1, (up, down)
        # The legend names both, in their colours, the downlink's swatch dashed as its curve.
        (up_key, down_key) = seen["swatches"]
        assert "uplink" in up_key["label"] and "downlink" in down_key["label"]
        assert (up_key["color"], down_key["color"]) == (up["stroke"], down["stroke"])
        assert up_key["mask"] == "none" and "repeating-linear-gradient" in down_key["mask"]
        # The island bounds in words (the header said "islands 1–64"), and what they are on hover.
        assert seen["quorum"]["shown"] and seen["quorum"]["text"] == "1 to 64 islands per round"
        assert "1 to 64 islands per round" in seen["details"] and "islands 1–64" not in seen["details"]
        for words in ("at least 1", "rounds.min_islands", "as soon as 64", "rounds.max_islands"):
            assert words in seen["quorum"]["title"], (words, seen["quorum"]["title"])

        # A sharded coordinator's leader lists its shards (rows as coordinator/gather.py's rows() gives them): the card
        # is there, a row each.
        rows = [{"shard": i, "address": f"127.0.0.1:{9000 + i}", "round": rounds, "bytes_up": 10 * (i + 1), "bytes_down": 20}
                for i in range(2)]
        monkeypatch.setattr("coordinator.web.run_snapshot", lambda state, since=0, totals=None: run_snapshot(state, since, totals) | {"shards": rows})
        seen = browser.evaluate(browser.open(server.url, finished), SEEN)
        assert seen["shards_shown"] and seen["shard_rows"] == ["0", "1"]


def main(path: str) -> None:
    """The README's screenshot: 4 islands, 4-bit + zstd on the wire (the demo's codec), 40 rounds, read at round 32 while the run goes on."""
    import logging
    import tempfile

    from coordinator.server import start_coordinator

    logging.basicConfig(level=logging.WARNING)
    cfg = tiny_config("rounds.rounds=40", "rounds.min_islands=4", "eval.batches=4", "eval.batch_size=8", "wire.codec=e3m0", "wire.zstd=true",
                      "inner.steps_per_round=8", "model.d_model=64", "model.d_ff=128", "model.n_layers=2", "name=demo-4-islands")
    with tempfile.TemporaryDirectory() as tmp:
        coordinator = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=f"{tmp}/spool")
        server = RunWebServer(coordinator.state).start()
        try:
            with held_run(coordinator, cfg, 4, 32) as (release, _):
                wait_for_summaries(coordinator.state, 32, 600)
                screenshot(server.url, Path(path), Path(tmp) / "profile", "1400,1120")
                release.set()
        finally:
            server.stop()
            coordinator.stop(0.5)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/dashboard.png")
