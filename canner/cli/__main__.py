"""``python -m canner.cli``: the ``canner`` command."""

from __future__ import annotations

from canner.cli.main import main

raise SystemExit(main())
