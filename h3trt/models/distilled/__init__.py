"""Distilled MiniMax-H3 checkpoints (--distilled FILE): the families and what each serves and refuses
(families.py), their file formats read into one fusion (files.py), the fp32 fusion into the DiT's weights, callable
per block (merge.py), the families' rungs and shifts on the sampler's one schedule core (schedule.py), a full FastH3
export's fastvideo_inference.json (contract.py), PDD's head bank fused per forward and picked per evaluation
(pdd.py), and random files in each family's format for the tests and the benches (writer.py). Importers name the
module they use; nothing is re-exported here."""
