"""The documentation site's generated reference pages (mkdocs.yml ``hooks:``, ``make docs``).

Every page here is written at build time from the code itself: the scripts' argparse parsers, the
algorithm registry and each algorithm's ``Settings``, every study kind's schema and key types, and the
task, encoder, partition-scheme, skew, data-family and mask-rule registries. So a reference page cannot
fall behind the code: a new flag, setting, key or registry entry is on the next build's pages, and an
entry the generator cannot describe stops the build with an error naming it.

This package sits above every library layer (it imports ``pipeline`` and ``steps``); no library module
imports it.
"""
