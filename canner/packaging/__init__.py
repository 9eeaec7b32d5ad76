"""Megawarc packaging: many accepted artifacts of a project become one Internet Archive item.

canner-deliver runs it (:mod:`~canner.packaging.pipeline`), off the upload path: batches and
packages live in ``delivery.sqlite`` (:mod:`~canner.packaging.batches`), packages are built and
re-read by :mod:`~canner.packaging.megawarc` and kept in ``packages/``
(:mod:`~canner.packaging.store`) until they are verified at IA and past retention.
"""
