"""The rsync door: a stock rsync daemon writes into ``incoming/``, canner-receiver adopts.

See docs/rsync.md.  :mod:`~canner.rsync.incoming` knows the incoming tree's layout,
:mod:`~canner.rsync.adoption` the crash-safe steps that move one file into the store, and
:mod:`~canner.rsync.intake` the service that finds files (inotify and a periodic scan) and
hands each to the one acceptance.  :mod:`~canner.rsync.conf` writes rsyncd.conf from the shipped
templates.
"""
