"""The research simulator's core side: cost models, calibration, the timed driver, validation.

The `sim` worker itself is a plugin (plugins/workers/sim.py); nothing in the core imports it.
"""
