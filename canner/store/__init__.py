"""The data directory's durable files, shared by both daemons: uploads (bytes, sidecar, lock),
receipts, the journal, the promises to uploads in flight, the drain marker, the sweep."""
