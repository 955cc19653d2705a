"""``kvtier demo``: a multi-round chat workload run with and without kvtier.

:mod:`~kvtier.demo.workload` makes the conversations, :mod:`~kvtier.demo.runner` runs them
under each configuration, :mod:`~kvtier.demo.report` prints the table and
:mod:`~kvtier.demo.plot` draws TTFT per round.
"""
