"""Hand-written decision sequences shared by the tests: the seed's and the review's scenarios.

``SEED`` is PR 43569's bug in its plainest form (block size 4, six blocks, priority preemption):
A is admitted first, X (more important) later; A is scheduled for the token that completes its
block 1, which eager policies publish at once; X lacks a block and PRIORITY preempts A, already in
the step's output, so block 1 is never written; a later request hits it and reads it.
"""

A = (1, 2, 3, 4, 5, 6, 7, 8, 9)
X = (9, 9, 9, 9, 9, 9, 9, 9)

SEED = [
    ("arrive", 1, A + (10, 11), 4, 5),  # A, the future victim: least important, arrives first
    ("begin", 0),
    ("schedule", 1, 3, 0),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ()),
    ("arrive", 2, X + (9, 9, 9, 9), 1, 0),  # X, important, admitted after A
    ("begin", 1),
    ("schedule", 1, 1, 0),
    ("schedule", 2, 8, 0),
    ("submit", 1),
    ("execute", 1, ()),
    ("commit", 1, ()),
    ("begin", 2),
    ("schedule", 1, 6, 0),  # completes A's block 1: eager policies publish it now
    ("preempt", 1),  # X needs a block: PRIORITY takes A, already in this step's output
    ("schedule", 2, 4, 0),  # X reuses A's partial block; A's block 1 stays cached
    ("submit", 2),
    ("execute", 2, ()),
    ("commit", 2, ((2, 3),)),  # X finishes
    ("arrive", 3, A[:8] + (3,), 4, 0),
    ("begin", 3),
    ("schedule", 3, 1, 0),  # hits A's published blocks; block 1 was never written
    ("submit", 3),
    ("execute", 3, ()),  # ... and reads it (eager-unsafe: the zombie)
]

CONSUMER = [
    ("arrive", 1, (1, 2, 3, 4, 5), 4, 0),
    ("begin", 0),
    ("schedule", 1, 5, 0),  # A: blocks 0 and 1 full, published at once by eager policies
    ("arrive", 2, (1, 2, 3, 4, 9), 1, 0),
    ("schedule", 2, 1, 0),  # B hits them in the same step: A's pending writes will fill them
    ("preempt", 1),  # `general` takes A out of the step: the writes B counted on are withdrawn
]
"""The review's consumer scenario (block size 2, policy ``eager-rollback-fifo``, discipline
``general``): the rollback unpublishes A's blocks, but B already holds them, so its read is
unwritten. Only a content change (A's withdrawn writes) breaks the invariant, not a new entry."""
