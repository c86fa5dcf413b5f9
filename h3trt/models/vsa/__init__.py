"""FastH3's Video Sparse Attention (VSA): the tiles of the packed sequence (tiles.py), the tile routing, the coarse
(gated) branch and one block's attention (routing.py), the kernels attending the kept tiles in bf16 (kernels.py) and
in FP8 (fp8.py), and where a FastH3-VSA model runs sparse with one request's run over its evaluations (plan.py).
Importers name the module they use; nothing is re-exported here."""
