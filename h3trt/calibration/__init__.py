"""Low-precision DiT blocks: the recipe (what is quantized, how it was calibrated), FP8 and NVFP4 weight formats,
the quantized linear and attention modules the compiled block runs, and max calibration over real trajectories."""
