"""What a person sees in the dashboard, in a real headless Chromium, of a real run: the tiny model served over HTTP,
conversations through the chat API, the rule judge, real optimizer steps. ``make test-dashboard`` installs Chromium
when missing (scripts/setup_chromium.sh); without it these tests are skipped with the reason."""

from __future__ import annotations

import re

import httpx
import pytest

from browser_support import chromium_path
from dashboard_support import QUESTIONS, converse, run_config, start_run, wait_for
from known_run import LONG_SYSTEM_PROMPT, add_rejected_step, add_two_users_main_sessions, write_known_run

pytestmark = pytest.mark.browser
ADMIN_KEY = "browser-admin-77d3"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    runtime = start_run(run_config(str(tmp_path_factory.mktemp("dash") / "run"), admin_key=ADMIN_KEY))
    turns = {}
    try:
        with httpx.Client(base_url=runtime.server.base_url, timeout=120) as http:
            for i in range(2):
                turns[f"b{i}"] = converse(http, f"b{i}", QUESTIONS[i], corrected=i == 0)
            wait_for(lambda: runtime.trainer.step >= 1, what="one optimizer step")
        yield runtime, turns
    finally:
        runtime.stop()


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    if exe is None:
        pytest.skip("no Chromium found (CLAWLOOP_CHROMIUM, or chromium on PATH): run scripts/setup_chromium.sh "
                    "or `make test-dashboard`, which installs it where it can")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install -e '.[dev]')")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, run):
    runtime, _ = run
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.console_errors = []
    pg.on("console", lambda m: pg.console_errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: pg.console_errors.append(f"page error: {e}"))
    pg.goto(f"{runtime.server.base_url}/dashboard/#conversations")
    # The data needs the admin key: the page says so, takes it, and keeps it for this tab.
    pg.wait_for_selector("#key-form:not([hidden])", timeout=15000)
    assert "admin key" in pg.inner_text("#banner").lower()
    assert all("401" in e for e in pg.console_errors), pg.console_errors
    pg.fill("#key-input", ADMIN_KEY)
    pg.click("#key-form button[type=submit]")
    pg.wait_for_selector("#session-list li[data-session]", timeout=15000)
    pg.console_errors.clear()
    yield pg
    context.close()


def no_errors(pg) -> None:
    assert pg.console_errors == [], pg.console_errors


def test_conversations_list_sessions_and_their_turns(page, run):
    runtime, turns = run
    sessions = page.locator("#session-list li[data-session]").evaluate_all("els => els.map(e => e.dataset.session)")
    assert set(turns) <= set(sessions)
    page.click("#session-list li[data-session='b0']")
    page.wait_for_selector(f"article.turn[data-turn='{turns['b0']}']", timeout=10000)
    judged = runtime.server.store.get_turn(turns["b0"])
    card = page.locator(f"article.turn[data-turn='{turns['b0']}']")
    assert judged.response_text.strip() in card.inner_text()
    text = card.inner_text()
    assert "That is wrong" in text and "trained at step" in text and "Rule judge" in text
    assert "chosen (sequence_optimal)" in text  # the hint candidate the OPD branch used
    no_errors(page)


def test_a_sample_is_coloured_token_by_token(page, run):
    runtime, turns = run
    tid = turns["b0"]  # the corrected turn: it has a hint and teacher targets
    page.goto(f"{runtime.server.base_url}/dashboard/#sample/{tid}")
    page.wait_for_function(f"document.getElementById('sample-title').textContent.includes('{tid}')", timeout=10000)
    api = httpx.get(f"{runtime.server.base_url}/dashboard/api/samples/{tid}",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).json()
    spans = page.locator("#tokens .tok")
    assert spans.count() == len(runtime.server.store.get_turn(tid).response_ids) == len(api["tokens"])
    colours = spans.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
    for colour, tok in zip(colours, api["tokens"]):
        assert tok["advantage"] is not None
        r, g = (int(x) for x in re.findall(r"\d+", colour)[:2])
        assert (g > r) == (tok["advantage"] >= 0), (colour, tok["advantage"])  # green above, red below
    spans.nth(0).hover()
    tip = page.locator("#tooltip")
    tip.wait_for(state="visible", timeout=5000)
    shown = tip.text_content()
    assert "student top-k" in shown and "teacher top-k" in shown
    assert f"{api['tokens'][0]['overlap']} of {api['tokens'][0]['k']}" in shown
    assert "GRPO vote" in page.inner_text("#grpo") and "-1" in page.inner_text("#grpo")
    no_errors(page)


def test_training_charts_have_a_point_per_step(page, run):
    runtime, _ = run
    page.goto(f"{runtime.server.base_url}/dashboard/#training")
    chart = page.locator("[data-testid='chart-loss']")
    chart.wait_for(timeout=10000)
    steps = [s["step"] for s in runtime.server.store.steps()]
    assert chart.get_attribute("data-x") == ",".join(map(str, steps))
    assert chart.locator("canvas").count() == 1 and "grad_norm" in page.inner_text("#charts")
    no_errors(page)


def test_pages_update_live_after_a_new_turn(page, run):
    runtime, _ = run
    page.goto(f"{runtime.server.base_url}/dashboard/#overview")
    page.wait_for_selector("[data-testid='ov-turns-total'] .card-value", timeout=10000)
    before = int(page.inner_text("[data-testid='ov-turns-total'] .card-value"))
    page.click("#tabs a[data-view='conversations']")
    page.wait_for_selector("#session-list li[data-session]", timeout=10000)
    assert page.locator("#session-list li[data-session='fresh']").count() == 0
    with httpx.Client(base_url=runtime.server.base_url, timeout=120) as http:
        converse(http, "fresh", QUESTIONS[2], corrected=False, end=False)
    page.wait_for_selector("#session-list li[data-session='fresh']", timeout=15000)  # no reload: the page polls
    page.click("#tabs a[data-view='overview']")
    page.wait_for_function(f"+document.querySelector(\"[data-testid='ov-turns-total'] .card-value\").textContent "
                           f">= {before + 2}", timeout=15000)
    page.click("#tabs a[data-view='versions']")
    page.wait_for_selector("#version-list [data-version]", timeout=10000)
    assert "trained by step" in page.inner_text("#version-list")
    no_errors(page)


def rgb(colour: str) -> tuple[int, int, int]:
    r, g, b = (int(x) for x in re.findall(r"\d+", colour)[:3])
    return r, g, b


def test_a_rejected_steps_turns_and_the_version_list(browser, make_server, tmp_path):
    """Step 2 was rejected by the gate (tests/dashboard/known_run.py): its turn says so, not a green "trained";
    v3 lists step 3 only; step 2 is listed in no version. The session's long system prompt is folded."""
    run_dir = tmp_path / "run"
    write_known_run(run_dir)
    ids = add_rejected_step(run_dir)
    srv = make_server(run_dir=run_dir)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        pg.goto(f"{srv.base_url}/dashboard/#conversations/s3")
        rejected = pg.locator(f"article.turn[data-turn='{ids['t4']}']")
        rejected.wait_for(timeout=15000)
        fate = rejected.locator(".turn-head .chip[class*='fate-']")
        assert fate.inner_text() == "trained at step 2, rejected by the gate, not in any served version"
        r, g, _ = rgb(fate.evaluate("e => getComputedStyle(e).color"))
        assert r > g  # red, not the green of a published step
        published = pg.locator(f"article.turn[data-turn='{ids['t5']}'] .turn-head .chip[class*='fate-']")
        assert published.inner_text() == "trained at step 3, published in v3"
        r, g, _ = rgb(published.evaluate("e => getComputedStyle(e).color"))
        assert g > r

        # The system prompt (8,714 characters) shows one line until it is opened.
        fold = rejected.locator(".msg.role-system details")
        assert fold.count() == 1 and not fold.evaluate("d => d.open")
        assert f"{len(LONG_SYSTEM_PROMPT):,} characters" in fold.locator("summary").inner_text()
        assert "END OF THE SYSTEM PROMPT" not in rejected.inner_text()
        assert rejected.bounding_box()["height"] < 900  # the turn fits on one screen
        fold.locator("summary").click()
        assert "END OF THE SYSTEM PROMPT" in rejected.inner_text()

        pg.click("#tabs a[data-view='versions']")
        pg.wait_for_selector("#version-list [data-version='3']", timeout=10000)
        assert "trained by step 3 on 1 sample" in pg.inner_text("#version-list [data-version='3']")
        assert "trained by step 1 on 1 sample" in pg.inner_text("#version-list [data-version='1']")
        assert pg.locator("#no-version li").count() == 1
        assert "step 2, rejected by the gate" in pg.inner_text("#no-version li[data-step='2']")
        assert errors == [], errors
    finally:
        context.close()


def test_two_users_sessions_of_one_name_open_apart(browser, make_server, tmp_path):
    """alice and bob both call their session "main": the list shows two, each opens its owner's turns, and an
    assistant message that only called a tool shows the call, not "null"."""
    run_dir = tmp_path / "run"
    write_known_run(run_dir)
    add_two_users_main_sessions(run_dir, tool_call_for="bob")
    srv = make_server(run_dir=run_dir)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        pg.goto(f"{srv.base_url}/dashboard/#conversations")
        items = pg.locator("#session-list li[data-session='main']")
        items.nth(1).wait_for(timeout=15000)
        assert sorted(items.all_inner_texts())[0].startswith("main · alice")
        pg.locator("#session-list li[data-session='main']", has_text="alice").click()
        pg.wait_for_selector("#session-detail h3:has-text('Session main of alice')", timeout=10000)
        assert "answer to alice" in pg.inner_text("#session-detail")
        assert "answer to bob" not in pg.inner_text("#session-detail")
        assert pg.evaluate("location.hash") == "#conversations/main/alice"
        pg.locator("#session-list li[data-session='main']", has_text="bob").click()
        pg.wait_for_selector("#session-detail h3:has-text('Session main of bob')", timeout=10000)
        shown = pg.inner_text("#session-detail")
        assert "answer to bob" in shown and "answer to alice" not in shown
        assert 'web_search({"q":"tides"})' in shown and "null" not in shown
        assert errors == [], errors
    finally:
        context.close()


def test_every_page_of_an_empty_run_renders_without_errors(browser, make_server):
    srv = make_server()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        pg.goto(f"{srv.base_url}/dashboard/")
        pg.wait_for_function("document.getElementById('status-text').textContent.includes('live')", timeout=10000)
        expected = {"overview": "[data-testid='ov-steps']", "conversations": "#session-list li.muted",
                    "sample": "#sample-meta p", "training": "#charts p", "versions": "#version-list p"}
        for view, selector in expected.items():
            pg.click(f"#tabs a[data-view='{view}']")
            pg.wait_for_selector(selector, timeout=10000)
        assert "No conversation yet" in pg.inner_text("#session-list")
        assert "No optimizer step yet" in pg.inner_text("#charts")
        assert errors == [], errors
    finally:
        context.close()
