"""The ``fstier`` command (placeholder entry point; the CLI helper owns this file)."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="fstier")
def main() -> None:
    """fstier: a filesystem tier for LLM KV caches."""
