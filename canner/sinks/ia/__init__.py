"""The Internet Archive sink, and what it is made of.

:mod:`~canner.sinks.ia.sink` adapts :mod:`~canner.sinks.ia.client` (the IA HTTP client) to the
``Sink`` protocol; one delivery is an :mod:`~canner.sinks.ia.attempt`.  Beside them: the
delivery table (:mod:`~canner.sinks.ia.config`), IA metadata headers
(:mod:`~canner.sinks.ia.metadata`), reading IA's answers (:mod:`~canner.sinks.ia.wire`),
credentials (:mod:`~canner.sinks.ia.credentials`), the streaming body
(:mod:`~canner.sinks.ia.body`), multipart uploads (:mod:`~canner.sinks.ia.multipart`), pacing by
``check_limit`` (:mod:`~canner.sinks.ia.pacing`) and the read-back
(:mod:`~canner.sinks.ia.readback`).
"""
