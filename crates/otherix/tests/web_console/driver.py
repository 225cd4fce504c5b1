"""A headless Chromium for the web console's end-to-end tests.

Driven over stdin/stdout, one JSON object a line each way, so the Rust test
does the cluster's side (stopping a guest, running the CLI) between browser
steps: `{"op": "click", "page": "admin", "selector": "#x"}` in,
`{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}` out.

Chromium is Debian's (argv[1]), launched by Playwright for Python (a pinned
PyPI package; no browser download). Each named page has a browser context
of its own: its own cookies, so "admin" and "viewer" are two people.
"""

import json
import sys

from playwright.sync_api import sync_playwright


def main():
    chromium = sys.argv[1]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            # Root in CI: Chromium's sandbox needs an unprivileged user.
            # Local Network Access off: the cross-site tests' attacker page
            # is faked by Playwright (`route_html`), so Chromium takes it for
            # a public site and (since 147) stops its WebSockets and fetches
            # to the control plane's private address before they leave —
            # then the control plane's own refusal would go untested, and a
            # real attacker's page may well be on the local network too.
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-features=LocalNetworkAccessChecks,LocalNetworkAccessChecksWebSockets"],
        )
        pages = {}
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            cmd = json.loads(line)
            try:
                result = run(browser, pages, cmd)
                out = {"ok": True, "result": result}
            except Exception as e:  # said to the test, which decides
                out = {"ok": False, "error": " ".join(str(e).split())[:2000]}
            print(json.dumps(out), flush=True)
        browser.close()


def run(browser, pages, cmd):
    op = cmd["op"]
    name = cmd.get("page", "main")
    timeout = cmd.get("timeout_ms", 30000)
    if op == "open":
        # The control plane's certificate is signed by the cluster's own CA.
        ctx = browser.new_context(ignore_https_errors=True, viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        page.set_default_timeout(timeout)
        pages[name] = page
        messages = []
        page.on("console", lambda m: messages.append(m.type + ": " + m.text))
        page.on("pageerror", lambda e: messages.append("pageerror: " + str(e)))
        page.messages = messages
        return None
    page = pages[name]
    if op == "goto":
        resp = page.goto(cmd["url"])
        return resp.status if resp else None
    if op == "fill":
        page.fill(cmd["selector"], cmd["value"])
        return None
    if op == "select":
        page.select_option(cmd["selector"], cmd["value"])
        return None
    if op == "set_files":
        page.set_input_files(cmd["selector"], cmd["path"])
        return None
    if op == "click":
        page.click(cmd["selector"])
        return None
    if op == "wait":
        # Until an element matching `selector` (holding `text`, if given) is visible.
        loc = page.locator(cmd["selector"])
        if "text" in cmd:
            loc = loc.filter(has_text=cmd["text"])
        loc.first.wait_for(state="visible", timeout=timeout)
        return None
    if op == "wait_gone":
        loc = page.locator(cmd["selector"])
        if "text" in cmd:
            loc = loc.filter(has_text=cmd["text"])
        loc.first.wait_for(state="detached", timeout=timeout)
        return None
    if op == "keys":
        # Typed as keys into the focused `selector` (a terminal's textarea);
        # "\n" is Enter.
        page.focus(cmd["selector"])
        page.keyboard.type(cmd["text"])
        return None
    if op == "texts":
        return page.locator(cmd["selector"]).all_inner_texts()
    if op == "count":
        return page.locator(cmd["selector"]).count()
    if op == "eval":
        return page.evaluate(cmd["js"], cmd.get("arg"))
    if op == "download":
        with page.expect_download(timeout=timeout) as d:
            page.click(cmd["selector"])
        d.value.save_as(cmd["path"])
        return cmd["path"]
    if op == "screenshot":
        page.screenshot(path=cmd["path"], full_page=True)
        return cmd["path"]
    if op == "route_html":
        # Answers `url` (another origin, never dialed) with `html`: the
        # attacker's page of a cross-site test.
        page.context.route(cmd["url"], lambda route: route.fulfill(status=200, content_type="text/html", body=cmd["html"]))
        return None
    if op == "url":
        return page.url
    if op == "cookies":
        # The page's cookies, HttpOnly ones too: a test acts as its browser
        # from elsewhere (the browser's own network cut off).
        return page.context.cookies()
    if op == "messages":
        return page.messages
    raise ValueError("unknown op " + op)


if __name__ == "__main__":
    main()
