"""mkdocs hooks (mkdocs.yml ``hooks:``): the repository's root pages in the site.

The site is built from ``docs/``, but its home page is the root ``README.md`` and the guides link
to root files (``CONTRIBUTING.md``, ``LICENSE``, ``CITATION.cff``). They are added to the site as
if they were in ``docs/`` (``README.md`` as ``index.md`` unless ``docs/index.md`` exists), and the
links between them and ``docs/*.md`` are rewritten for that layout: ``docs/x.md`` from a root
page becomes ``x.md``, ``../CONTRIBUTING.md`` from a guide becomes ``CONTRIBUTING.md``.

``mkdocs build --strict`` fails on every warning, griffe's docstring warnings included, except
those listed in ``KNOWN_GRIFFE_WARNINGS`` (by file and message, not line): they are logged at
INFO, marked as known, until the docstring is fixed; then the build says to drop the entry.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
#: root file -> its name in the site
ROOT_FILES = {
    "README.md": "index.md",
    "CONTRIBUTING.md": "CONTRIBUTING.md",
    "LICENSE": "LICENSE",
    "CITATION.cff": "CITATION.cff",
}
_LINK = re.compile(r"(\]\()([^)\s#]+)")

#: griffe warnings tolerated until the docstring is fixed (Google style wants one name per
#: parameter line: ``device:`` and ``dtype:``, ``*args:`` and ``**kwargs:``, not ``a, b:``)
KNOWN_GRIFFE_WARNINGS: set[tuple[str, str]] = set()
_GRIFFE = re.compile(r"(?:griffe: )?(\S+?):\d+: (.+)", re.S)
_seen: set[tuple[str, str]] = set()
log = logging.getLogger("mkdocs.hooks.api")


class _KnownWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        m = _GRIFFE.fullmatch(record.getMessage())
        if record.levelno == logging.WARNING and m and (m.group(1), m.group(2)) in KNOWN_GRIFFE_WARNINGS:
            _seen.add((m.group(1), m.group(2)))
            record.msg, record.args = f"{record.getMessage()} (known: docs/api/hooks.py)", ()
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_FILTER = _KnownWarnings()


def on_config(config):
    logging.getLogger("mkdocs.plugins.griffe").addFilter(_FILTER)  # once: addFilter skips a filter it has
    _seen.clear()
    return config


def on_post_build(config):
    for path, message in sorted(KNOWN_GRIFFE_WARNINGS - _seen):
        log.info("known griffe warning no longer seen, drop it from docs/api/hooks.py: %s: %s", path, message)


def on_files(files, config):
    for name, site_name in ROOT_FILES.items():
        if (ROOT / name).is_file() and files.get_file_from_path(site_name) is None:
            files.append(File.generated(config, site_name, abs_src_path=str(ROOT / name)))
    return files


def on_page_markdown(markdown, page, config, files):
    from_root = page.file.abs_src_path and Path(page.file.abs_src_path).parent == ROOT
    depth = len(Path(page.file.src_uri).parts) - 1  # folders below docs/

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        if from_root:  # a root page: docs/x -> x, README.md -> index.md
            if target.startswith("docs/"):
                target = target[len("docs/") :]
            elif target in ROOT_FILES:
                target = ROOT_FILES[target]
        else:  # a page of docs/: ../../README.md (climbing out of docs/) -> the root page's site name
            up = "../" * (depth + 1)
            if target.startswith(up) and target[len(up) :] in ROOT_FILES:
                target = "../" * depth + ROOT_FILES[target[len(up) :]]
        return match.group(1) + target

    return _LINK.sub(rewrite, markdown)
