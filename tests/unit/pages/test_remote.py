"""One normaliser of exporter addresses and one fetch, with one-line errors (rankscope.pages.remote)."""

from __future__ import annotations

import pytest

from rankscope import pages


def test_page_url_normalises_addresses_and_urls():
    assert pages.page_url("node1:9400") == "http://node1:9400/metrics"
    assert pages.page_url(" https://node1:9400/ ") == "https://node1:9400/metrics"
    assert pages.page_url("http://node1:9400/metrics") == "http://node1:9400/metrics"
    assert pages.page_url("http://[::1]:9400") == "http://[::1]:9400/metrics"
    assert pages.page_url("https://exporter.example/x/metrics") == "https://exporter.example/x/metrics"
    for bad, why in (("ftp://example/metrics", r"not an http\(s\) URL"), ("http://", r"not an http\(s\) URL"),
                     ("node1:http", "the port is not a number")):
        with pytest.raises(ValueError, match=why):
            pages.page_url(bad)
    with pytest.raises(ValueError, match="no port"):
        pages.page_url("node1", port_required=True)


def test_fetch_errors_are_one_line_naming_the_url():
    with pytest.raises(pages.FetchError, match=r"^ftp://x/metrics: not an http\(s\) URL$"):
        pages.fetch("ftp://x/metrics", 1.0)
    with pytest.raises(pages.FetchError, match=r"^http://127\.0\.0\.1:1/metrics: cannot connect"):
        pages.fetch("http://127.0.0.1:1/metrics?x=1", 1.0)
