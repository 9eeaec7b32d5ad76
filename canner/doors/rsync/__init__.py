"""The rsync door: a stock rsync daemon writes into ``incoming/``, canner-receiver adopts.

See docs/rsync.md.  :mod:`~canner.doors.rsync.incoming` knows the incoming tree's layout,
:mod:`~canner.doors.rsync.adoption` the crash-safe steps that move one file into the store, and
:mod:`~canner.doors.rsync.intake` the service that finds files (inotify and a periodic scan) and
hands each to the one acceptance.  :mod:`~canner.doors.rsync.conf` writes rsyncd.conf from the
shipped templates.
"""
