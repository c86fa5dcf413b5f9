"""Block-sparse attention as SubBlock routes it: the router (attention.py: pooled sub-block scores and each query
block's top-k key blocks; router.py: which router a device runs; router_triton.py: the router fused in Triton for
CUDA), where it applies (plan.py), one request's run over its evaluations (run.py), the custom op
`h3trt::sparse_attention` and its bf16 kernels (kernels.py; the masked oracle, reference.py), and FP8 block-sparse
attention with a layer's q/k/v scales (fp8.py; its Triton kernel for Hopper, fp8_triton.py). Importers name the
module they use; nothing is re-exported here."""
