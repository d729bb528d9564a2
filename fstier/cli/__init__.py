"""The ``fstier`` command: a thin shell over the library.

Commands: ``demo`` (the end-to-end tour: tp=2 stores, tp=4 loads, every
fail-closed case), ``inspect`` (one row per namespace), ``verify`` (check
every block, ``--fix`` removes bad ones), ``gc`` (LRU eviction and temp sweep
with FsTier's own capacity code), ``bench`` (fstier vs raw O_DIRECT), and
``config validate|show``.

Conventions every command follows:

- exit 0 ok, 1 runtime failure (or something bad was found and not fixed),
  2 usage or configuration error with ONE line naming the field;
- ``--json`` prints one JSON document on stdout for scripts; people get rich
  tables and progress bars (progress goes to stderr, and only to a terminal);
- ``fstier --help`` never imports torch: torch-heavy modules (layout,
  gpu_copy, manager, the demo) are imported inside the commands that need
  them. ``tests/test_cli.py`` checks ``sys.modules`` in a real subprocess.
"""

from __future__ import annotations

import click

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fstier")
def main() -> None:
    """fstier: a filesystem tier for LLM KV caches.

    \b
    Start with `fstier demo`: tp=2 ranks store a prompt's KV blocks, tp=4
    ranks load them back, and every case that must fail closed is shown.
    Exit codes: 0 ok, 1 failure, 2 usage or configuration error.
    """


def _register() -> None:
    # One module per command; each keeps torch-heavy imports inside its body.
    from fstier.cli import bench, config, demo, gc, inspect, verify

    main.add_command(demo.demo_cmd)
    main.add_command(inspect.inspect_cmd)
    main.add_command(verify.verify_cmd)
    main.add_command(gc.gc_cmd)
    main.add_command(bench.bench_cmd)
    main.add_command(config.config_group)


_register()
