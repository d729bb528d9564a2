"""The ``fstier demo`` scenario: a parent process (host pool + FsTier) and
synthetic rank processes that stage a KV cache in and out of shared slots.

- :mod:`~fstier.demo.scenario`: the cases, the parent's side, the report
  (``run_demo(DemoOptions) -> DemoReport``);
- :mod:`~fstier.demo.ranks`: what each spawned rank process runs.

The command itself (:mod:`fstier.cli.demo`) only prints the report.
"""
