"""The memory budget above the coordinator: the byte ledger, the accounting that charges and
credits it as blocks change hands, the allocations parked until it grants them, and reclaim.

Every change of holdings goes one way through here: the ops call the budget layer, which calls
down into the coordinator (``daemon/core``) and keeps the ledger in step. See docs/budget.md.
"""
