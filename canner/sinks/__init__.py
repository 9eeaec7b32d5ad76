"""Sinks: where an accepted object leaves canner.

The outbound service sees only :mod:`canner.sinks.base` (the ``Sink`` protocol and the outcome
types).  Each destination is one module or folder (:mod:`canner.sinks.directory`,
:mod:`canner.sinks.ia`) and one entry in :mod:`canner.sinks.registry` (its name, delivery table
and factory).  Beside them: destination planning (:mod:`~canner.sinks.plan`) and HTTP plumbing
(:mod:`~canner.sinks.transport`).
"""
