# The user's book: docs/ is an mdBook (sources in docs/src, built into docs/book).
#   make docs         build it; open docs/book/index.html
#   make docs-check   build it, then fail on any dead local link or anchor in it or in the
#                     repository's READMEs (scripts/check-book-links.py; part of `make test`)
# mdBook is installed once per version into target/tools/ (measured: 2m53s of CPU, 5-10 minutes
# on a busy 2-core machine; then `make docs` takes under a second). Its default features `serve`
# and `watch` (a web server on tokio and axum, a file watcher) are left out: nothing here uses
# them, and CI's 2 cores would compile them; `search` stays.
# Included by the top-level Makefile.

MDBOOK_VERSION := 0.5.4
MDBOOK_ROOT    := target/tools/mdbook-$(MDBOOK_VERSION)
MDBOOK         := $(MDBOOK_ROOT)/bin/mdbook

.PHONY: docs docs-check

## docs: build the book into docs/book (installs mdBook first, once)
docs: $(MDBOOK)
	$(MDBOOK) build docs

$(MDBOOK):
	$(CARGO) install --locked --no-default-features --features search \
		--root $(MDBOOK_ROOT) mdbook --version $(MDBOOK_VERSION)

# The READMEs users read on the repository's web view, beside the book (the templates' are not
# Markdown until `policy new` fills them in).
LINKED_MARKDOWN := README.md $(wildcard examples/*.md examples/*/README.md tests/fixtures/*/README.md)

## docs-check: the checker proves it catches a dead link, then every local link and anchor of
## the built book and of the READMEs must resolve (external links are not followed: CI is offline)
docs-check: docs
	$(PYTHON) scripts/check-book-links.py --self-test
	$(PYTHON) scripts/check-book-links.py docs/book $(LINKED_MARKDOWN)
