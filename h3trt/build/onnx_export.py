"""The DiT segments as ONNX graphs TensorRT parses and fuses, optionally with ModelOpt's FP8 / NVFP4 Q/DQ.

FP8/NVFP4 blocks are exported with the ModelOpt quantizers the builder's calibration left in them
(h3trt/calibration/calibrate.py): the Q/DQ scales are the amax the Inductor modules take theirs from.

The graphs are the segments of `segments.py` (same input names, same dynamic dimensions), with three rewrites that
change no arithmetic but the ONNX form (tensorrt_notes.md section 8, step 1):
  - RMSNorm by hand (`x * rsqrt(mean(x^2) + eps) * w`): the TorchScript exporter at opset 20 rejects aten::rms_norm;
  - RoPE from cos/sin inputs (the block segment already takes them: the 3-D frequencies stay out of the graph);
  - attention as MatMul -> Softmax -> MatMul with Q and K each pre-scaled by D^-1/4, the pattern TensorRT fuses into
    one MHA kernel (it requires the scale to be applied before the first MatMul).

Weights are ONNX initializers, not inputs: TensorRT folds a weight's Q/DQ into the FP8/FP4 GEMM only when the weight
is a constant, and a plan embeds its weights anyway. So each layer is its own graph (`block_0`, `block_1`, ...) where
the torch backends compile one block for all layers. Every graph is saved with its tensors in one external data file
beside it (`<name>.onnx.data`), so the 2 GB protobuf limit never applies.

Exporter: TorchScript (`dynamo=False`, opset 20). The dynamo exporter fails on ModelOpt's quantizer modules
(tensorrt_notes.md 0.5), and one exporter for every precision keeps the graphs comparable.
"""

from __future__ import annotations

import copy
import math
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import UserError
from ..models.dit import H3DiT
from .segments import block_segment, embed_segment, final_segment

ONNX_OPSET = 20


class ExportRMSNorm(nn.Module):
    """nn.RMSNorm written out (same weight, same eps), computed in fp32 and cast back, as torch's CPU kernel does."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, float(norm.eps)

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def fusable_attention(head_dim: int):
    """Full attention as the MatMul-Softmax-MatMul pattern TensorRT fuses, Q and K pre-scaled by D^-1/4 each.

    The scale is a Python float from the config's head dim: `shape ** 0.5` in the graph exports a bogus Cast.
    """
    scale = 1.0 / math.sqrt(math.sqrt(head_dim))

    def attention(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> torch.Tensor:
        q_BNSD = q_BSND.transpose(1, 2) * scale
        k_BNDS = k_BSND.permute(0, 2, 3, 1) * scale
        probs_BNSS = torch.softmax(torch.matmul(q_BNSD, k_BNDS), dim=-1)
        return torch.matmul(probs_BNSS, v_BSND.transpose(1, 2)).transpose(1, 2)

    return attention


def _export_norms(module: nn.Module) -> nn.Module:
    """A copy of `module` whose RMSNorms are ExportRMSNorm (weights shared, not copied). Subtrees without a norm are
    the same objects: ModelOpt's calibrated linears (and their quantizers) are exported as they are."""
    module = copy.copy(module)
    module._modules = dict(module._modules)
    for name, child in list(module._modules.items()):
        if isinstance(child, nn.RMSNorm):
            module._modules[name] = ExportRMSNorm(child)
        elif any(isinstance(m, nn.RMSNorm) for m in child.modules()):
            module._modules[name] = _export_norms(child)
    return module


class EmbedGraph(nn.Module):
    def __init__(self, model: H3DiT):
        super().__init__()
        self.model = _export_norms(model)
        # The refiner's attention runs through Attention.forward's default (SDPA); route it to the fusable form.
        for block in self.model.token_refiner.blocks:
            block.attn.forward = _with_attn(block.attn)

    def forward(self, video, audio, text, timesteps, video_index, audio_index, text_index, token_tags):
        return self.model.embed(video, audio, text, timesteps, video_index, audio_index, text_index,
                                token_tags.shape[0])


def _with_attn(attn):
    def forward(x_BSH, rope=None):
        q, k, v = attn.qkv(x_BSH, rope)
        return attn.out_proj(fusable_attention(attn.head_dim)(q, k, v).flatten(2).to(x_BSH.dtype))
    return forward


class BlockGraph(nn.Module):
    """One layer with its weights; `mod` is the layer's [3T, 6, H] modulation table (baked or live AdaLN)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = _export_norms(block)
        self.attention = fusable_attention(block.attn.head_dim)

    def forward(self, x, mod, adaln_index, cos, sin):
        return self.block(x, mod, adaln_index, (cos, sin), self.attention)


class FinalGraph(nn.Module):
    def __init__(self, final: nn.Module):
        super().__init__()
        self.final = _export_norms(final)

    def forward(self, x, mod, timestep_index, video_index, audio_index):
        return self.final(x, mod, timestep_index, video_index, audio_index)


def segment_graphs(model: H3DiT) -> dict[str, tuple[nn.Module, object]]:
    """{graph name: (module, SegmentSpec)}: embed, block_0 .. block_{L-1}, final. The spec supplies input and
    output names and dynamic dimensions; its weight list is unused (weights are initializers here)."""
    cfg, dtype = model.cfg, model.dtype
    graphs = {"embed": (EmbedGraph(model), embed_segment(cfg, dtype))}
    block = block_segment(cfg, dtype)
    for i, layer in enumerate(model.blocks):
        graphs[f"block_{i}"] = (BlockGraph(layer), block)
    graphs["final"] = (FinalGraph(model.final_layer), final_segment(cfg, dtype))
    return graphs


def export_graph(module: nn.Module, spec, example: list[torch.Tensor], path: Path, nvfp4: bool = False) -> Path:
    """Export one graph to `path` (+ `path.name + '.data'`). Returns `path`."""
    # onnx and ModelOpt belong to the TensorRT backend's optional extra: imported when a tensorrt build runs.
    try:
        import onnx
    except ImportError as e:
        raise UserError(f"--backend tensorrt exports ONNX graphs, and onnx does not import here ({e}): pip install "
                        "'onnx>=1.21'.") from e

    dynamic_axes = {name: dict(dims) for name, dims in spec.dynamic.items()}
    for out, dims in _output_dynamic_axes(spec).items():
        dynamic_axes[out] = dims
    if nvfp4:
        from modelopt.torch.quantization.export_onnx import configure_linear_module_onnx_quantizers

        context = configure_linear_module_onnx_quantizers(module)
    else:
        context = nullcontext()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="h3trt-onnx-") as tmp, torch.inference_mode(), context:
        raw = Path(tmp) / "raw.onnx"
        torch.onnx.export(module, tuple(example), str(raw), input_names=list(spec.inputs),
                          output_names=onnx_output_names(spec), dynamic_axes=dynamic_axes, opset_version=ONNX_OPSET,
                          dynamo=False, do_constant_folding=True)
        model = onnx.load(str(raw), load_external_data=True)
    if nvfp4:
        from modelopt.onnx.export import NVFP4QuantExporter

        model = NVFP4QuantExporter.process_model(model)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx.save appends to an existing data file
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
              size_threshold=1024)
    return path


def _output_dynamic_axes(spec) -> dict[str, dict[int, str]]:
    """Outputs vary with the rows they hold: x and the block output with S, the heads with V and A."""
    return {"embed": {"x": {1: "S"}, "temb": {0: "T"}}, "block": {"x_out": {1: "S"}},
            "final": {"video": {1: "V"}, "audio": {1: "A"}}}[spec.name]


def onnx_output_names(spec) -> list[str]:
    """ONNX names must be unique across inputs and outputs: the block's output `x` becomes `x_out`."""
    return [f"{n}_out" if n in spec.inputs else n for n in spec.outputs]
