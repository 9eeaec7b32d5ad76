-- delivery.sqlite, version 6: megawarc packages and ledgers IA loses or serves wrong (issue 24),
-- as objects got in version 5.
-- redeliveries: how often verify_timeout passed without a package file listed at IA and the
-- package went back to be delivered (reset by an operator retry); after a few it is flagged.
-- force_upload: 1 when a read-back found IA serving other bytes; the next delivery then PUTs
-- every file even though the metadata API lists matching ones.
ALTER TABLE packages ADD COLUMN redeliveries INTEGER NOT NULL DEFAULT 0;
ALTER TABLE packages ADD COLUMN force_upload INTEGER NOT NULL DEFAULT 0;
-- The same mark for a ledger whose whole-file read-back found other bytes at IA: its next
-- upload goes through even though the listing matches (an operator's retry keeps it).
ALTER TABLE ledgers ADD COLUMN force_upload INTEGER NOT NULL DEFAULT 0;
