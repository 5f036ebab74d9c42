"""Elementwise decode glue of the hybrid models as layers see it (docs/ARCHITECTURE.md §6.3):
the fused Triton kernels of `kernels.hybrid_glue` with their torch references behind one
name, so that model files import layers only (tests/unit/test_worker_seams.py)."""

from __future__ import annotations

from kernels.hybrid_glue import shared_expert_combine, sigmoid_gate_mul

__all__ = ["shared_expert_combine", "sigmoid_gate_mul"]
