"""A source archive from the package registry, taken by its pinned sha256 and never built by pip.

`pip download` of an sdist runs the sdist's build backend to read its metadata, i.e. it executes code from
the archive. An engine's sdist is only a carrier for the engine's C++ source, so spectrain asks the
index pip is configured with (PEP 503 / 691 "simple" API: ``index-url`` and ``extra-index-url`` from pip's
own configuration and ``PIP_INDEX_URL``) for the file's address, downloads the bytes itself, checks them
against the pinned sha256 and unpacks only the members it needs, with tarfile's ``data`` filter (no links
leaving the tree, no absolute paths, no device files).
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

_JSON = "application/vnd.pypi.simple.v1+json"
_TIMEOUT = 60.0


@dataclass(frozen=True)
class PinnedFile:
    """One file of one release on the registry, and the only bytes spectrain accepts for it."""

    project: str
    filename: str
    sha256: str
    size: int


def index_urls() -> list[str]:
    """The simple-API indexes pip would ask, in pip's order (its default index unless configured away)."""
    try:
        from pip._internal.configuration import Configuration
        from pip._internal.models.index import PyPI
    except ImportError as e:  # pip moved its internals: PIP_INDEX_URL still works
        env = os.environ.get("PIP_INDEX_URL")
        if env:
            return [env]
        raise OSError("cannot read pip's index configuration; set PIP_INDEX_URL to a simple index") from e
    conf = Configuration(isolated=False)
    conf.load()
    values = dict(conf.items())

    def pick(key: str) -> list[str]:
        hits = [v for k, v in values.items() if k.split(".", 1)[-1] == key]
        return hits[-1].split() if hits else []  # env variables are listed last and win, as in pip

    return (pick("index-url") or [PyPI.simple_url]) + pick("extra-index-url")


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def _listing(index: str, project: str) -> dict[str, str]:
    """filename -> absolute URL of every file the index lists for `project`."""
    base = index.rstrip("/") + "/" + re.sub(r"[-_.]+", "-", project).lower() + "/"
    url = base
    # A file:// index is a directory tree (pip reads <project>/index.html there); urllib cannot open a directory.
    if base.startswith("file:") and os.path.isdir(urllib.request.url2pathname(urllib.parse.urlparse(base).path)):
        url = base + "index.html"
    req = urllib.request.Request(url, headers={"Accept": f"{_JSON}, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=_TIMEOUT) as r:
        body = r.read(64 << 20).decode("utf-8", "replace")
        kind = r.headers.get("Content-Type", "") if hasattr(r, "headers") and r.headers else ""
    if _JSON in kind or body.lstrip().startswith("{"):
        return {f["filename"]: urllib.parse.urljoin(base, f["url"]) for f in json.loads(body).get("files", [])}
    parser = _Links()
    parser.feed(body)
    return {name: urllib.parse.urljoin(base, href) for name, href in parser.links}


def locate(pin: PinnedFile) -> str:
    """The URL of the pinned file on the first configured index that lists it."""
    tried = []
    for index in index_urls():
        try:
            found = _listing(index, pin.project).get(pin.filename)
        except (OSError, ValueError) as e:  # an index that is down or does not carry the project
            tried.append(f"{index} ({type(e).__name__})")
            continue
        if found:
            return found
        tried.append(f"{index} (not listed)")
    raise OSError(f"{pin.filename} was not found on any configured package index: {', '.join(tried)}; "
                  "check pip's index-url / PIP_INDEX_URL")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(pin: PinnedFile, dest: Path) -> Path:
    """`dest` holding exactly the pinned bytes: reused when its hash matches, else fetched and checked."""
    if dest.is_symlink():
        raise OSError(f"{dest} is a symbolic link; remove it (spectrain writes its downloads itself)")
    if dest.is_file() and sha256_of(dest) == pin.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    url = locate(pin)
    fd, tmp = tempfile.mkstemp(prefix=".part-", dir=dest.parent)
    h = hashlib.sha256()
    bar = tqdm(total=pin.size, unit="B", unit_scale=True, desc=f"download {pin.filename}", dynamic_ncols=True)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=_TIMEOUT) as r:
            for block in iter(lambda: r.read(1 << 20), b""):
                if out.tell() + len(block) > pin.size:
                    raise OSError(f"{url} sent more than the pinned {pin.size} bytes of {pin.filename}; refused")
                out.write(block)
                h.update(block)
                bar.update(len(block))
        if h.hexdigest() != pin.sha256:
            raise OSError(f"{pin.filename} from {url} has sha256 {h.hexdigest()}, not the pinned {pin.sha256}; "
                          "refused (the index serves other bytes under this name)")
        os.replace(tmp, dest)
    finally:
        bar.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def unpack(archive: Path, member_prefix: str, dest: Path) -> Path:
    """Extract the members under `member_prefix` of a .tar.gz into `dest` (atomically, safely filtered)."""
    if dest.is_dir():
        return dest
    prefix = member_prefix.rstrip("/") + "/"
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise OSError(f"{archive.name} holds no {prefix}; is this the pinned archive?")
            for m in members:
                m.name = m.name[len(prefix):] or "."
            tar.extractall(tmp, members=members, filter="data")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
