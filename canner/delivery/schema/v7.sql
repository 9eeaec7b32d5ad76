-- delivery.sqlite, version 7: where an object came from, by worker (issue 25).  Only adds; it
-- applies on top of version 6 (and renumbers without harm: nothing else refers to it).
-- downloader: the worker that uploaded the object, when its intake door names one
-- (PUT /seesaw/<project>/<downloader>/<filename>, an rsync module's downloader directory);
-- NULL for tus uploads and for every row written before this version.
ALTER TABLE objects ADD COLUMN downloader TEXT;
-- "Where is item X?" (HQ) and the idempotency of a worker's retry: objects by origin.
CREATE INDEX objects_origin ON objects (project, filename, downloader);
