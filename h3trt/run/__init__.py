"""`h3trt run`'s front door: one clip or a requests file (the batch, what it may replace in its output folder, and
its timeline)."""
