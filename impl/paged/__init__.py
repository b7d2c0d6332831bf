"""Paged K/V on real tensors: the Triton kernels beside their torch references, and the replay of
a trace against dense attention (``kvspec replay``)."""
