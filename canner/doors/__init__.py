"""The ways in: tus (``doors/tus``), seesaw's PUT (``doors/seesaw``) and the rsync intake
(``doors/rsync``); ``doors/router`` dispatches a request's body on its route's door.  A door never
imports another door."""
