"""What a door is to the receiver's site: :class:`Door`, and :class:`DoorParts`, what one is built
from.

A door over HTTP is a module (or folder) of ``canner/doors/`` with a factory ``door(parts) ->
Door``, named in :data:`canner.doors.router.DOORS`.  It reads its protocol from the request and
hands the body to the door-neutral intake (:mod:`canner.accept.intake`), which admits, streams and
accepts it; it answers through the one renderer (:mod:`canner.web.answer`).  Doors import this
module, never each other.
"""

from __future__ import annotations

from collections.abc import Callable

from attrs import frozen
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import IResource

from canner.accept.intake import UploadIntake
from canner.config import Config
from canner.web.channel import BodyRouter
from canner.web.routing import DoorPath, Surface


@frozen
class DoorParts:
    """What every door is built from: the receiver's config, the door-neutral intake and the
    clock."""

    config: Config
    intake: UploadIntake
    clock: IReactorTime


@frozen
class Door:
    """One way in over HTTP: the routes that are its, how their upload bodies open, what
    answers them.

    ``serves`` is the surface :mod:`canner.web.routing` gives its routes (the doors it knows:
    tus, seesaw) or, for any other door, the :class:`~canner.web.routing.DoorPath` it declares.
    ``body`` opens the stream of each of its routes that carries an upload (None for the others);
    ``resource`` (a leaf) renders every one of its routes from ``request.route``, once the body
    is in.
    """

    name: str
    serves: Surface | DoorPath
    body: BodyRouter
    resource: IResource


DoorFactory = Callable[[DoorParts], Door]
