"""What a saved page would fetch from the network: the check behind "opens offline"."""

from html.parser import HTMLParser
from typing import List

FETCHING = {"script": "src", "link": "href", "img": "src", "iframe": "src"}


class _Fetches(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: List[str] = []

    def handle_starttag(self, tag, attrs):
        url = dict(attrs).get(FETCHING.get(tag, ""), "") or ""
        if "://" in url or url.startswith("//"):
            self.urls.append(url)


def external_resources(page: str) -> List[str]:
    """URLs of scripts, stylesheets, images and frames the page's tags load (script text is not
    parsed as tags, so links inside plotly.js do not count)."""
    parser = _Fetches()
    parser.feed(page)
    return parser.urls
