"""The ledger: released records leave the node in compressed files verified remotely."""
