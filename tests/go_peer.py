"""Where the Go canner built for side-by-side runs lives: the one place in the repository that
names it.

The peer (the real saveweb/canner server and a command around its unchanged client SDK) is not
part of canner; it sits in the project's shared folder beside the clone, on developers' machines
and in CI alike.  ``CANNER_GO_PEER`` names another folder.  Tests that need it fail with this
path in their message when it is absent; nothing in ``canner/`` may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]

GO_PEER = Path(os.environ.get("CANNER_GO_PEER", _REPO / "../shared/peers/go-canner")).resolve()
