"""The router of doors: the site's one body router, dispatching each request on its route's door.

The site routes each request once, from its head (:mod:`canner.web.routing`, under the paths
doors declared: :attr:`DoorRouter.paths`); the router finds the route's door, opens its upload
body there (:meth:`DoorRouter.open_body`, the :class:`~canner.web.channel.BodyRouter` of the
site) and names the resource that answers it (:meth:`DoorRouter.resource_of`).  Adding a door is
its module in ``doors/`` and one entry in :data:`DOORS`.
"""

from __future__ import annotations

from collections.abc import Iterable

from attrs import define
from twisted.web.resource import IResource

from canner.doors import seesaw
from canner.doors.base import Door, DoorFactory, DoorParts
from canner.doors.tus import routes as tus
from canner.web.channel import BodySink, ReceiverRequest
from canner.web.routing import DoorPath, Route, Surface

# Every door of the receiver over HTTP (the rsync intake comes in through the filesystem).
DOORS: tuple[DoorFactory, ...] = (
    tus.door,
    seesaw.door,
)


@define(eq=False)
class DoorRouter:
    """The doors of one receiver, by what each serves."""

    _doors: dict[Surface | str, Door]

    @classmethod
    def build(cls, parts: DoorParts, factories: Iterable[DoorFactory] = DOORS) -> DoorRouter:
        """Every door ``factories`` make from ``parts``; ValueError when two serve the same
        routes."""
        doors: dict[Surface | str, Door] = {}
        for factory in factories:
            door = factory(parts)
            key = _key(door.serves)
            if key is Surface.DOOR:
                raise ValueError(
                    f"door {door.name!r}: a door routing does not know declares a path"
                )
            if key in doors:
                raise ValueError(f"door {door.name!r} serves what {doors[key].name!r} serves")
            doors[key] = door
        return cls(doors)

    @property
    def paths(self) -> tuple[DoorPath, ...]:
        """The paths the doors declared, for the site's routing."""
        return tuple(d.serves for d in self._doors.values() if isinstance(d.serves, DoorPath))

    def door_of(self, route: Route) -> Door | None:
        """The door serving ``route``; None for a route of no door (receipts, HQ, ...)."""
        return self._doors.get(route.door if route.surface is Surface.DOOR else route.surface)

    def open_body(
        self, request: ReceiverRequest, route: Route, length: int | None
    ) -> BodySink | None:
        door = self.door_of(route)
        return None if door is None else door.body.open_body(request, route, length)

    def resource_of(self, route: Route) -> IResource | None:
        door = self.door_of(route)
        return None if door is None else door.resource


def _key(serves: Surface | DoorPath) -> Surface | str:
    return serves.prefix if isinstance(serves, DoorPath) else serves
