"""vqpoold: the coordinator daemon that owns the block bookkeeping."""
