"""The adapters' ``installed()`` blocks: install for a block, then back as it was."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def installed_for_block(state: dict, is_installed, install, uninstall):
    """Run ``install()`` for the block; after it, ``state["options"]`` as they were where
    ``is_installed()`` said so before, else ``uninstall()``."""
    was, before = is_installed(), state["options"]
    install()
    try:
        yield
    finally:
        if was:
            state["options"] = before
        else:
            uninstall()
