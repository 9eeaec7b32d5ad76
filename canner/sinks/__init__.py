"""Sinks: where an accepted object leaves canner.

The outbound service sees only :mod:`canner.sinks.base` (the ``Sink`` protocol and the outcome
types).
Each destination has one module (:mod:`canner.sinks.internet_archive`,
:mod:`canner.sinks.directory`) and one entry in :mod:`canner.sinks.registry` (its name, delivery
table and factory; IA's table is :mod:`~canner.sinks.ia_config`); the modules beside them
hold what a sink is made of: destination planning (:mod:`~canner.sinks.plan`), IA metadata
headers (:mod:`~canner.sinks.metadata`), reading IA's answers (:mod:`~canner.sinks.wire`),
credentials (:mod:`~canner.sinks.credentials`), the streaming body (:mod:`~canner.sinks.body`)
and HTTP plumbing (:mod:`~canner.sinks.transport`).
"""
