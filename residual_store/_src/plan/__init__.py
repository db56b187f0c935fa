"""The planner: per residual, keep on the device, offload to host memory, or recompute.

One concept per room: :mod:`.profile` (what a device does per second), :mod:`.cost` (what each
choice of one residual costs on a profile), :mod:`.solve` (the cheapest choices under a byte
budget), :mod:`.choose` (a forward's residuals planned, as the split's min-cut carries them out),
:mod:`.request` (``rs.plan``: the public option a split takes, and ``rs.explain``).
"""
