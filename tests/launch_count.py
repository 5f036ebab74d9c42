"""`LaunchCount`: a stand-in for a Triton kernel that counts its launches, for the kernel tests
(under the interpreter and on the GPU) that check how many second launches a path makes."""

from __future__ import annotations


class LaunchCount:
    """Stands in for a Triton kernel and counts its launches (kernel[grid](...)): put it where
    the module looks the kernel up, read `n`, put the kernel back."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]
