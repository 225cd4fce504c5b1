"""The web console at 10,000 VMs: page load and live-update latency.

    target/web-console/venv/bin/python crates/otherix/tests/web_console/bench.py \
        --otherix target/release/otherix [--vms 10000] [--runs 10]

Starts its own `otherix server` on 127.0.0.1 (SQLite, a temporary data
directory), creates the VMs through the API (16 at a time; no node, so they
stay pending, which is all the pages need), then in Debian's Chromium
(Playwright, as the browser tests) measures, `--runs` times each:

- sign-in to overview shown (the console loaded and `/ui/api/overview`
  summed over every VM);
- the VMs page (first page of 50, name order);
- the VMs page filtered by a selector only 1 VM matches (a scan of all);
- the next page of VMs;
- update latency: `PATCH /v1/vms/NAME/labels` from outside the browser
  until the open VMs page shows the new label (change log -> catalog ->
  event stream -> the page re-reads its page).

Prints a table of median and maximum milliseconds. Not a test: it asserts
nothing beyond the pages showing what they should.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import tempfile
import time
import urllib.request

from playwright.sync_api import sync_playwright


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--otherix", required=True)
    ap.add_argument("--vms", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    data = tempfile.mkdtemp(prefix="otherix-console-bench-")
    server = subprocess.Popen(
        [args.otherix, "server", "--listen", "127.0.0.1:0", "--data-dir", os.path.join(data, "data")],
        stdout=subprocess.PIPE, stderr=open(os.path.join(data, "server.log"), "w"), text=True)
    try:
        url = None
        for line in server.stdout:
            m = re.match(r"listening on\s+(\S+)", line)
            if m:
                url = m.group(1)
            if line.startswith("log in with"):
                break
        token = open(os.path.join(data, "data", "admin.token")).read().strip()
        run(args, url, token)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(data, ignore_errors=True)


def api(url, token, method, path, body=None):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", "Bearer " + token)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, context=ctx) as r:
        return json.loads(r.read() or b"null")


def run(args, url, token):
    api(url, token, "POST", "/v1/networks", {"name": "bench", "type": "overlay", "subnet": "10.200.0.0/17"})
    t = time.monotonic()
    names = ["vm%05d" % i for i in range(args.vms)]

    def create(name):
        return api(url, token, "POST", "/v1/vms", {"name": name, "network": "bench", "labels": {"app": "web", "n": name}})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(create, names))
    print("created %d VMs in %.1f s" % (args.vms, time.monotonic() - t), flush=True)

    results = {}

    def measure(what, f):
        results.setdefault(what, []).append(f())

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
        for i in range(args.runs):
            ctx = browser.new_context(ignore_https_errors=True)
            page = ctx.new_page()
            page.set_default_timeout(60000)
            page.goto(url + "/ui/")
            page.fill("#token", token)

            def signin():
                t = time.monotonic()
                page.click("#sign-in-form button")
                page.wait_for_selector("body[data-loaded=overview] #t-vms-pending")
                return time.monotonic() - t
            measure("sign-in to overview (counts over every VM)", signin)

            def go(hash_, ready):
                t = time.monotonic()
                page.evaluate("(h) => { location.hash = h; }", hash_)
                page.wait_for_selector(ready)
                return time.monotonic() - t

            def vms():
                page.evaluate("() => { location.hash = '#/overview'; }")
                page.wait_for_selector("body[data-loaded=overview]")
                return go("#/vms", "body[data-loaded=vms] #vm-table tr[data-id=vm00000]")
            measure("VMs page, first 50", vms)

            def filtered():
                target = "vm%05d" % (args.vms - 1 - i)
                page.fill("#vm-selector", "n=" + target)
                t = time.monotonic()
                page.click("#page form button")
                page.wait_for_selector("#vm-table tr[data-id=%s]" % target)
                page.wait_for_selector("#vm-table tr[data-id=vm00000]", state="detached")
                took = time.monotonic() - t
                page.fill("#vm-selector", "")
                page.click("#page form button")
                page.wait_for_selector("#vm-table tr[data-id=vm00000]")
                return took
            measure("VMs page, selector matching 1 of all", filtered)

            def next_page():
                t = time.monotonic()
                page.click("text=Next ›")
                page.wait_for_selector("#vm-table tr[data-id=vm00050]")
                took = time.monotonic() - t
                page.click("text=‹ Previous")
                page.wait_for_selector("#vm-table tr[data-id=vm00000]")
                return took
            measure("VMs page, next page", next_page)

            def update():
                name = "vm%05d" % (i % 50)
                value = "v%d" % i
                t = time.monotonic()
                api(url, token, "PATCH", "/v1/vms/%s/labels" % name, {"set": {"mark": value}, "remove": []})
                page.wait_for_selector("#vm-table tr[data-id=%s]:has-text('mark=%s')" % (name, value))
                return time.monotonic() - t
            measure("update: label written -> shown on the open page", update)
            ctx.close()
        browser.close()

    print("\n| what (%d VMs, %d runs) | median | max |" % (args.vms, args.runs))
    print("|---|---|---|")
    for what, xs in results.items():
        print("| %s | %.0f ms | %.0f ms |" % (what, statistics.median(xs) * 1000, max(xs) * 1000))


if __name__ == "__main__":
    main()
