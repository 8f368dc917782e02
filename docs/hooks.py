"""Build hooks of the documentation site (``mkdocs.yml`` names this file; it is not a page).

The pages under ``docs/`` read on GitHub as well as in the site, so a link that leaves ``docs/``
is a path in the repository, e.g. ``../notebooks/01_tour.ipynb``. The site serves the walkthroughs
and the benchmark results itself, under the same paths, and such a link is pointed at the site's
copy; a link to any other file of the repository (a module, a test) goes to that file on GitHub.
A link to nothing is left as written, so that the strict build names it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, InclusionLevel

# Folders of the repository the site serves as they are: (folder, files, in the nav or not).
SERVED = (("notebooks", "*.ipynb", InclusionLevel.INCLUDED),
          ("benchmarks/results", "*.md", InclusionLevel.NOT_IN_NAV))

# A Markdown link or image target that leaves docs/: ](../path) or ](../path#anchor).
_OUT_OF_DOCS = re.compile(r"\]\((\.\./[^)\s#]*)(#[^)\s]*)?\)")


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


@event_priority(100)  # before mkdocs-jupyter turns the notebooks into pages
def on_files(files, config):
    root = _root(config)
    for folder, pattern, inclusion in SERVED:
        for path in sorted((root / folder).glob(pattern)):
            files.append(File(path.relative_to(root).as_posix(), str(root), config.site_dir,
                              config.use_directory_urls, inclusion=inclusion))
    return files


def on_page_markdown(markdown, page, config, files):
    root, docs = _root(config), Path(config.docs_dir).resolve()
    here = Path(page.file.abs_src_path).resolve().parent
    blob = config.repo_url.rstrip("/") + "/blob/main/"

    def point(match):
        target = (here / match.group(1)).resolve()
        anchor = match.group(2) or ""
        if not target.exists() or target.is_relative_to(docs) or not target.is_relative_to(root):
            return match.group(0)
        in_repo = target.relative_to(root).as_posix()
        if files.get_file_from_path(in_repo) is not None:
            return f"]({posixpath.relpath(in_repo, posixpath.dirname(page.file.src_uri) or '.')}{anchor})"
        return f"]({blob.replace('/blob/', '/tree/') if target.is_dir() else blob}{in_repo}{anchor})"

    return _OUT_OF_DOCS.sub(point, markdown)
