#!/usr/bin/env python3
"""Every local link and anchor in the built book, and in the repository's READMEs, must resolve.

The book (docs/src, built by `make docs` into docs/book) is read two ways: as HTML built from a
checkout, and as Markdown in the repository's web view. A link is one of:

- a link inside the book: the target page must exist in the built book and, with an
  `#anchor`, have an element with that `id` (mdBook turns `page.md#a` into `page.html#a`);
- a link into the repository outside the book, such as `../../examples/slo-js/`: docs/src and
  docs/book sit at the same depth, so one relative path names the same file from the Markdown
  and from the built HTML; it must exist in the repository, carry no anchor (nothing here can
  check one) and not name a `.md` file (mdBook rewrites every `.md` link to `.html`, which
  then names nothing: link the directory, or include the file);
- external (`http:`, `https:`, `mailto:`, ...): not followed. CI reaches no web host.

The inline links of the Markdown files named after the book (README.md, the examples' READMEs)
are checked the same way from each file's directory: a path must exist; an anchor into a book
page (`docs/src/X.md#a`) must be an `id` of the built page (docs/book/X.html); an anchor into
another Markdown file (or the file itself) must be one of its headings, as a repository web
view spells them.

`--self-test` writes a small book with one dead link of each kind beside good ones, and fails
unless exactly the dead ones are reported.

Usage: scripts/check-book-links.py BOOK_DIR [MARKDOWN_FILE...] [--repo DIR]
       scripts/check-book-links.py --self-test
"""
import argparse
import html.parser
import os
import re
import sys
import tempfile
from urllib.parse import unquote, urlsplit


class Page(html.parser.HTMLParser):
    """The ids a page defines and the links it makes (value, line)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []
        self.base = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "base":
            self.base = attrs.get("href")
            return
        for name in ("href", "src"):
            if attrs.get(name) is not None:
                self.links.append((attrs[name], self.getpos()[0]))

    handle_startendtag = handle_starttag


def parse_page(path):
    page = Page()
    with open(path, encoding="utf-8") as f:
        page.feed(f.read())
    page.close()
    return page


def is_external(link):
    parts = urlsplit(link)
    return bool(parts.scheme or parts.netloc)


def inside(path, root):
    return os.path.commonpath([path, root]) == root


class Checker:
    def __init__(self, book, repo):
        self.book = os.path.realpath(book)
        self.repo = os.path.realpath(repo)
        self.pages = {}
        self.errors = []
        self.checked = 0

    def page(self, path):
        if path not in self.pages:
            self.pages[path] = parse_page(path)
        return self.pages[path]

    def fail(self, where, message):
        self.errors.append(f"{where}: {message}")

    def check_target(self, where, link, target, anchor):
        """`target`: the absolute path a link names; `anchor`: its fragment, or None."""
        self.checked += 1
        if inside(target, self.book):
            if os.path.isdir(target):
                target = os.path.join(target, "index.html")
            if not os.path.isfile(target):
                return self.fail(where, f"dead link {link!r}: no {os.path.relpath(target, self.book)} in the book")
            if anchor and target.endswith(".html") and anchor not in self.page(target).ids:
                return self.fail(where, f"dead anchor {link!r}: {os.path.relpath(target, self.book)} has no id {anchor!r}")
            return None
        if not inside(target, self.repo):
            return self.fail(where, f"link {link!r} leaves the repository")
        shown = os.path.relpath(target, self.repo)
        if target.endswith(".md") or target.endswith(".html") and os.path.isfile(target[:-5] + ".md"):
            return self.fail(where, f"link {link!r} names the Markdown file {shown}, which mdBook "
                                    "rewrites to .html: link its directory, or include it")
        if not os.path.exists(target):
            return self.fail(where, f"dead link {link!r}: no {shown} in the repository")
        if anchor:
            return self.fail(where, f"link {link!r}: an anchor into {shown} cannot be checked")
        return None

    def check_book(self):
        for directory, _, files in os.walk(self.book):
            for name in sorted(files):
                if name.endswith(".html"):
                    self.check_html(os.path.join(directory, name))

    def check_html(self, path):
        page = self.page(path)
        here = os.path.dirname(path)
        # mdBook's 404 page sets <base href="/">: its links are from the book's root.
        base = self.book if page.base == "/" else here
        shown = self.shown(path)
        for link, line in page.links:
            if is_external(link):
                continue
            parts = urlsplit(link)
            anchor = unquote(parts.fragment) or None
            if not parts.path:
                self.checked += 1
                if anchor and anchor not in page.ids:
                    self.fail(f"{shown}:{line}", f"dead anchor {link!r}: no id {anchor!r} on this page")
                continue
            path_part = unquote(parts.path)
            start = self.book if path_part.startswith("/") else base
            target = os.path.normpath(os.path.join(start, path_part.lstrip("/")))
            self.check_target(f"{shown}:{line}", link, target, anchor)

    def shown(self, path):
        """A built page's name, with the source it was built from when there is one."""
        relative = os.path.relpath(path, self.book)
        shown = os.path.relpath(path, self.repo)
        source = os.path.join(os.path.dirname(self.book), "src", relative[:-5] + ".md")
        if os.path.isfile(source):
            return f"{shown} ({os.path.relpath(source, self.repo)})"
        return shown

    def check_markdown(self, path):
        """The inline links of a Markdown file of the repository (README.md, an example's)."""
        path = os.path.realpath(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        here = os.path.dirname(path)
        sources = os.path.join(os.path.dirname(self.book), "src")
        for line_no, link in markdown_links(text):
            where = f"{os.path.relpath(path, self.repo)}:{line_no}"
            if is_external(link):
                continue
            parts = urlsplit(link)
            anchor = unquote(parts.fragment) or None
            target = os.path.normpath(os.path.join(here, unquote(parts.path))) if parts.path else path
            shown = os.path.relpath(target, self.repo)
            if inside(target, sources) and target.endswith(".md") and os.path.isfile(target):
                # A book page: its anchors are the ids mdBook gave the built page.
                built = os.path.join(self.book, os.path.relpath(target, sources)[:-3] + ".html")
                self.check_target(where, link, built, anchor)
                continue
            self.checked += 1
            if not inside(target, self.repo):
                self.fail(where, f"link {link!r} leaves the repository")
            elif not os.path.exists(target):
                self.fail(where, f"dead link {link!r}: no {shown}")
            elif anchor and not target.endswith(".md"):
                self.fail(where, f"link {link!r}: an anchor into {shown} cannot be checked")
            elif anchor and anchor not in heading_slugs(read(target)):
                self.fail(where, f"dead anchor {link!r}: no such heading in {shown}")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def markdown_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def markdown_links(text):
    for number, line in markdown_lines(text):
        for match in INLINE_LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def heading_slugs(text):
    """The anchors a repository web view gives a Markdown file's headings: lower case, spaces
    to hyphens, punctuation dropped, a repeated heading numbered -1, -2, ..."""
    seen = {}
    slugs = set()
    for _, line in markdown_lines(text):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def run(book, markdown, repo):
    checker = Checker(book, repo)
    if not os.path.isfile(os.path.join(checker.book, "index.html")):
        return [f"{book}: no index.html: build the book first (make docs)"], 0
    checker.check_book()
    for path in markdown:
        checker.check_markdown(path)
    return checker.errors, checker.checked


def self_test():
    """A book with every kind of dead link beside good ones: exactly the dead ones fail."""
    files = {
        "docs/book/index.html": '<h1 id="top">t</h1><a href="#top">self</a><a href="#nowhere">x</a>'
                                '<a href="guide/a.html#usage">ok</a><a href="guide/a.html#gone">x</a>'
                                '<a href="guide/missing.html">x</a><a href="https://example.com/x">ext</a>'
                                '<link href="css/site.css"><script src="site.js"></script>',
        "docs/book/guide/a.html": '<h2 id="usage">u</h2><a href="../index.html">ok</a>'
                                  '<a href="../../../examples/slo-js/">ok</a>'
                                  '<a href="../../../examples/slo-js/README.html">x</a>'
                                  '<a href="../../../examples/gone/">x</a>'
                                  '<a href="../../../examples/slo-js/build.mjs#L3">x</a>'
                                  '<a href="../../../../outside">x</a>',
        "docs/book/404.html": '<base href="/"><a href="guide/a.html">ok</a><a href="css/site.css">ok</a>',
        "docs/book/css/site.css": "",
        "docs/book/site.js": "",
        "docs/src/guide/a.md": "# a",
        "examples/slo-js/build.mjs": "",
        "examples/slo-js/README.md": "# slo-js\n[ok](../../README.md#two-commands) [x](../../README.md#nope)\n"
                                     "[ok](../../docs/src/guide/a.md#usage) [ok](#slo-js)\n",
        "README.md": "# Top\n## Two commands\n[ok](docs/src/guide/a.md#usage) [x](docs/src/guide/a.md#gone)\n"
                     "[ok](#two-commands) [x](#three-commands) [ok](examples/slo-js/) [x](docs/src/b.md)\n"
                     "[x](examples/none.txt) `[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n",
    }
    expected = [
        "dead anchor '#nowhere'",
        "dead anchor 'guide/a.html#gone'",
        "dead link 'guide/missing.html'",
        "link '../../../examples/slo-js/README.html' names the Markdown file",
        "dead link '../../../examples/gone/'",
        "link '../../../examples/slo-js/build.mjs#L3': an anchor",
        "link '../../../../outside' leaves the repository",
        "dead anchor 'docs/src/guide/a.md#gone'",
        "dead anchor '#three-commands'",
        "dead link 'docs/src/b.md'",
        "dead link 'examples/none.txt'",
        "dead anchor '../../README.md#nope'",
    ]
    # The good links above, each of which must be followed rather than skipped: 4 on the
    # index page, 2 on guide/a.html, 2 on the 404 page, 3 in the README, 3 in the example's.
    good = 14
    with tempfile.TemporaryDirectory() as repo:
        for name, content in files.items():
            path = os.path.join(repo, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
        markdown = [os.path.join(repo, "README.md"), os.path.join(repo, "examples/slo-js/README.md")]
        errors, checked = run(os.path.join(repo, "docs/book"), markdown, repo)
    missed = [m for m in expected if sum(m in error for error in errors) != 1]
    if missed or len(errors) != len(expected) or checked != len(expected) + good:
        print("self-test failed: the checker missed a dead link or flagged a good one", file=sys.stderr)
        for error in errors:
            print(f"  reported: {error}", file=sys.stderr)
        for message in missed:
            print(f"  missed:   {message}", file=sys.stderr)
        print(f"  {checked} links checked, {len(expected) + good} expected", file=sys.stderr)
        return 1
    print(f"self-test: the {len(expected)} dead links and anchors are caught, the {good} good ones pass")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("book", nargs="?", help="the built book (docs/book)")
    parser.add_argument("markdown", nargs="*", help="Markdown files of the repository whose links are checked too")
    parser.add_argument("--repo", default=".", help="the repository root (default: .)")
    parser.add_argument("--self-test", action="store_true", help="prove the check catches dead links")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    if not args.book:
        parser.error("BOOK_DIR is required")
    errors, checked = run(args.book, args.markdown, args.repo)
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        print(f"{len(errors)} dead links or anchors", file=sys.stderr)
        return 1
    print(f"{checked} local links and anchors checked: all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
