"""The plan of ``canner adopt-go``: one step per object of a Go canner's data directory.

Pure apart from reading the Go directory.  A step is ``delivered``, ``deliver``, ``in_flight``
or ``problem`` (see :mod:`canner.go_canner.adopt` for what each does); the plan is JSON, saved
before any step runs, so a run killed anywhere is finished from the same decisions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import attrs
from attrs import frozen

from canner.go_canner.godir import GoArtifact, GoDataDir, GoPackage
from canner.store.receipts import parse_receipt

GO_ID = re.compile(r"[0-9a-f]{32}")
DELIVERED, DELIVER, IN_FLIGHT, PROBLEM = "delivered", "deliver", "in_flight", "problem"
# Payload sources of a "deliver" step.
FROM_UPLOAD, FROM_PACKAGE, FROM_MEMBER = "upload", "identity_package", "mergewarc_member"


@frozen
class Step:
    """What adoption does with one object (JSON-serializable: it is saved in the plan)."""

    object_id: str
    action: str
    note: str
    project: str | None = None
    filename: str | None = None
    checksum: str | None = None
    size_bytes: int = 0
    accepted_at: int = 0
    has_receipt: bool = False
    # deliver: where the payload comes from (a path relative to the Go directory) and its
    # byte range there; whether the Go package was rebuilt rather than used.
    source: str | None = None
    source_file: str | None = None
    source_offset: int = 0
    rebuilt: bool = False
    # delivered: where and when.
    identifier: str | None = None
    remote_name: str | None = None
    delivered_at: int | None = None
    purge_after: int | None = None
    purged_at: int | None = None


@frozen
class Plan:
    go_dir: str
    steps: tuple[Step, ...]
    packages: tuple[str, ...] = ()  # one note per Go package not delivered (used or rebuilt)

    def to_json(self) -> bytes:
        doc = {
            "go_dir": self.go_dir,
            "packages": list(self.packages),
            "steps": [attrs.asdict(s) for s in self.steps],
        }
        return json.dumps(doc, indent=0).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Plan:
        doc = json.loads(data)
        steps = tuple(Step(**s) for s in doc["steps"])
        return cls(doc["go_dir"], steps, tuple(doc["packages"]))

    def count(self, action: str) -> int:
        return sum(1 for s in self.steps if s.action == action)


# -- planning ----------------------------------------------------------------------------------


def make_plan(
    go: GoDataDir, projects: Iterable[str], taken: Callable[[str], bool] = lambda _oid: False
) -> Plan:
    """Decide every object's step from the Go directory as it is (reads only).  ``taken``
    says whether canner already has an object or upload of that id (never overwritten)."""
    artifacts, packages = go.read_index()
    known = set(projects)
    ids = set(go.receipt_ids()) | set(artifacts) | set(go.upload_ids())
    steps = [
        Step(oid, PROBLEM, "canner already has an object or upload with this id; left")
        if taken(oid)
        else _plan_one(go, oid, artifacts.get(oid), packages, known)
        for oid in sorted(ids)
    ]
    notes = []
    for pkg in sorted(packages.values(), key=lambda p: p.package_id):
        if pkg.delivered or not pkg.members:
            continue
        mine = [s for s in steps if s.object_id in {m.object_id for m in pkg.members}]
        used = [s for s in mine if s.source in (FROM_PACKAGE, FROM_MEMBER)]
        how = (
            f"delivered by canner from the Go package file packages/{pkg.filename}"
            if used and len(used) == len(mine)
            else "rebuilt: canner delivers its members from their uploads under its own config"
        )
        notes.append(f"package {pkg.package_id[:24]} ({pkg.packager}, {pkg.state}): {how}")
    return Plan(str(go.root), tuple(steps), tuple(notes))


def _plan_one(
    go: GoDataDir,
    oid: str,
    art: GoArtifact | None,
    packages: Mapping[str, GoPackage],
    known: set[str],
) -> Step:
    if not GO_ID.fullmatch(oid):
        return Step(oid, PROBLEM, "not a 32-hex tus id: canner cannot serve it; files left")
    try:
        info = go.read_info(oid)
    except (OSError, ValueError) as e:
        return Step(oid, PROBLEM, f"unreadable .info ({e}); files left")
    meta: dict[str, Any] = info["MetaData"] if info else {}
    try:
        data = go.receipt_path(oid).read_bytes()
    except FileNotFoundError:
        data = None
    if data is None:
        if info is None:
            return Step(oid, PROBLEM, "an artifacts row with no receipt and no upload; left")
        return _plan_upload(go, oid, info, known)
    try:
        receipt = parse_receipt(data)
    except ValueError as e:
        return Step(oid, PROBLEM, f"receipt unreadable ({e}); left")
    project = art.project if art else meta.get("project")
    filename = art.filename if art else (meta.get("filename") or oid)
    base = Step(
        oid,
        DELIVER,
        "",
        project=project,
        filename=filename,
        checksum=str(receipt.checksum),
        size_bytes=receipt.size_bytes,
        accepted_at=receipt.accepted_at,
        has_receipt=True,
    )
    if project is None:
        where = (
            f"; its bytes stay at uploads/{oid} in the Go directory"
            if go.data_path(oid).exists()
            else ""
        )
        return attrs.evolve(
            base,
            action=PROBLEM,
            note=f"receipt kept, but no project is known for it: canner cannot deliver it{where}",
        )
    pkg = packages.get(art.package_id) if art and art.package_id else None
    if pkg is not None and pkg.delivered:
        return attrs.evolve(
            base,
            action=DELIVERED,
            note=f"delivered to {pkg.remote_id} ({pkg.packager} package {pkg.package_id[:24]},"
            f" {'purged' if pkg.purged_at else 'Go package file left'}): not sent again",
            identifier=pkg.remote_id,
            remote_name=pkg.remote_name,
            delivered_at=pkg.delivered_at or receipt.accepted_at,
            purge_after=pkg.purge_after,
            purged_at=pkg.purged_at,
        )
    unknown = "" if project in known else f"; project {project} is not in canner's config yet"
    cut = ""
    if pkg is not None and pkg.delivery_state == "delivering":
        cut = f"; Go's attempt to {(pkg.plan or {}).get('identifier')} was cut short"
    if go.data_path(oid).exists() and go.data_path(oid).stat().st_size == receipt.size_bytes:
        rebuilt = pkg is not None
        what = "rebuilt by canner" if rebuilt else "delivered by canner"
        return attrs.evolve(
            base,
            note=f"{what} from its upload{cut}{unknown}",
            source=FROM_UPLOAD,
            source_file=f"uploads/{oid}",
            rebuilt=rebuilt,
        )
    if pkg is not None and pkg.state == "sealed" and pkg.purged_at is None:
        path = go.packages / pkg.filename
        member = next((m for m in pkg.members if m.object_id == oid), None)
        if path.exists() and member is not None:
            kind = FROM_PACKAGE if pkg.packager == "identity" else FROM_MEMBER
            return attrs.evolve(
                base,
                note=f"delivered by canner from the Go package file packages/{pkg.filename}"
                f"{cut}{unknown}",
                source=kind,
                source_file=f"packages/{pkg.filename}",
                source_offset=member.offset_bytes if kind == FROM_MEMBER else 0,
            )
    return attrs.evolve(
        base,
        action=PROBLEM,
        note="receipt kept, but no upload or package file holds its bytes: nothing to deliver",
    )


def _plan_upload(go: GoDataDir, oid: str, info: dict[str, Any], known: set[str]) -> Step:
    meta = info["MetaData"]
    size = info.get("Size")
    project = meta.get("project")
    if not isinstance(size, int) or size < 1 or not isinstance(project, str):
        return Step(oid, PROBLEM, "an upload whose .info has no size or project; left")
    try:
        offset = go.data_path(oid).stat().st_size
    except FileNotFoundError:
        return Step(oid, PROBLEM, "an upload whose data file is missing; left")
    unknown = "" if project in known else f"; project {project} is not in canner's config yet"
    return Step(
        oid,
        IN_FLIGHT,
        f"resumable at /files/{oid}: {offset}/{size} bytes{unknown}",
        project=project,
        filename=meta.get("filename"),
        checksum=meta.get("checksum"),
        size_bytes=size,
    )


def print_plan(plan: Plan, out: TextIO) -> None:
    for s in plan.steps:
        out.write(f"{s.object_id}  {s.action:<9}  {s.project or '-'}  {s.note}\n")
    for note in plan.packages:
        out.write(f"{note}\n")
