"""The daemon client: a pool session that behaves as a local BlockPool (calls, retries, re-sync
after a daemon restart, heartbeat, waiting allocations, reclaim asks)."""
