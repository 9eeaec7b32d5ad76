-- delivery.sqlite, version 5: deliveries IA loses, and copies IA serves wrong (issue 8).
-- redeliveries: how often verify_timeout passed without the file listed at IA and the object
-- went back to be delivered (reset by an operator retry); after a few the row is flagged.
-- force_upload: 1 when a read-back found IA serving other bytes than its metadata promises;
-- the next delivery then PUTs even though the metadata API lists a matching file.
ALTER TABLE objects ADD COLUMN redeliveries INTEGER NOT NULL DEFAULT 0;
ALTER TABLE objects ADD COLUMN force_upload INTEGER NOT NULL DEFAULT 0;
