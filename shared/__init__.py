"""What the daemon and the workers both need: the allocator, errors, protocol, config."""

from vqpool.shared.allocator import DEFAULT_HISTORY_SIZE, BlockPoolAllocator
from vqpool.shared.errors import (
    BadRequestError,
    BlockPoolExhaustedError,
    ClaimConflictError,
    DaemonRestartedError,
    DaemonUnavailableError,
    ErrorCode,
    NoSessionError,
    NotOwnerError,
    OwnerAlreadyActiveError,
    RetryLaterError,
    TooManySessionsError,
    UnauthorizedError,
    VqpoolError,
)
from vqpool.shared.pool import (
    DEFAULT_BLOCK_SIZE,
    AllocationRequest,
    AllocationResult,
    Block,
    BlockPool,
    Owner,
    PoolConfig,
)
from vqpool.shared.stats import AllocationStats

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_HISTORY_SIZE",
    "AllocationRequest",
    "AllocationResult",
    "AllocationStats",
    "BadRequestError",
    "Block",
    "BlockPool",
    "BlockPoolAllocator",
    "BlockPoolExhaustedError",
    "ClaimConflictError",
    "DaemonRestartedError",
    "DaemonUnavailableError",
    "ErrorCode",
    "NoSessionError",
    "NotOwnerError",
    "Owner",
    "OwnerAlreadyActiveError",
    "PoolConfig",
    "RetryLaterError",
    "TooManySessionsError",
    "UnauthorizedError",
    "VqpoolError",
]
