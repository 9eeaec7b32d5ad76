"""The ways in: tus (``doors/tus``), seesaw's PUT (``doors/seesaw``) and the rsync intake
(``doors/rsync``).  A door never imports another door."""
