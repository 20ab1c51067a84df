"""Measuring devices and links for real (NVML facts, torch microbenchmarks, send/recv between devices)
and building the cluster profile the planner reads: measured, declared, or both merged."""
