"""The ``canner`` command (:func:`canner.cli.main.main`)."""
