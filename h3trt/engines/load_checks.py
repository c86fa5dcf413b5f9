"""Step 1 of a bundle's load, before any file is read: the environment it was built for (torch, GPU architecture,
the process's cuda:0, the mesh), the kernels it serves runnable on this device, and every file there at its size."""

from __future__ import annotations

from pathlib import Path

import torch

from ..calibration.fp8_attention import check_attention_kernel
from ..models.attention import check_attention_record
from ..models.sparse.kernels import check_sparse_kernel
from ..models.vsa.fp8 import vsa_problem
from .bundle_files import mismatch, structure_problems
from .environment import device_arch
from .manifest import BundleError, Manifest


def check_load(root: Path, manifest: Manifest, device: torch.device, mesh=None) -> None:
    """Step 1 of a load, before any file is read: the environment (check_environment), the kernels the bundle
    serves can run on `device`, and every file is there at its size."""
    check_environment(manifest, device, mesh)
    quant = manifest.quant or {}
    attention = manifest.attention  # absent: a bundle from before kernels were recorded (bf16 SDPA)
    try:
        if attention is not None:
            check_attention_record(attention, device)
        elif quant.get("fp8_attention"):
            check_attention_kernel(quant["attention_kernel"], device)
        if manifest.sparse is not None:
            check_sparse_kernel(manifest.sparse.kernel, device)
        if manifest.vsa is not None and vsa_problem(manifest.vsa.kernel, device) is not None:
            raise ValueError(f"{vsa_problem(manifest.vsa.kernel, device)} (this FastH3-VSA bundle serves the "
                             f"{manifest.vsa.kernel} VSA kernel: serve it where it was built, or rebuild it here)")
    except ValueError as e:  # the user's: this device cannot run its kernel (a broken CUDA keeps its trace)
        raise BundleError(f"{root}: {e}") from e
    problems = structure_problems(root, manifest)
    if problems:
        raise mismatch(root, problems)


def check_environment(manifest: Manifest, device: torch.device, mesh=None) -> None:
    """Refuse a bundle built for another GPU, torch version or mesh (`mesh`: the launched MeshConfig; None: one
    process)."""
    built = manifest.versions.get("torch")
    if built != torch.__version__:
        raise BundleError(f"This bundle was built with torch {built}; this process runs torch {torch.__version__}. "
                          "Compiled code is specific to the torch version: rebuild the bundle on this image "
                          "(h3trt build ...).")
    check_process_gpu(device)
    arch = device_arch(device)
    if manifest.arch != arch:
        raise BundleError(f"This bundle was built for {manifest.arch}; this device is {arch} ({device}). Rebuild "
                          f"it on a {arch} machine, or run it on {manifest.arch}.")
    want = manifest.mesh
    replica, cfg, sp = (mesh.replica, mesh.cfg, mesh.sp) if mesh is not None else (1, 1, 1)
    if (want.sp, want.cfg) != (sp, cfg):
        group = want.sp * want.cfg
        raise BundleError(f"This bundle was built for sp={want.sp} x cfg={want.cfg} ({group} rank(s) per "
                          f"replica, {want.heads_per_rank} heads per rank); the job was launched as "
                          f"replica({replica}) x cfg({cfg}) x sp({sp}). Launch a multiple of {group} ranks (h3trt "
                          f"run --gpus {group}, or torchrun) with --sp {want.sp} --cfg {want.cfg}, or rebuild "
                          f"with h3trt build --sp {sp} --cfg {cfg}.")


def check_process_gpu(device: torch.device) -> None:
    """Compiled code runs on the process's cuda:0 only: Inductor's saved wrapper names the device it was compiled on,
    and h3trt always compiles and serves on cuda:0, making each rank's own GPU its cuda:0 (h3trt/parallel/devices.py).
    Refuse any other device index rather than launch kernels on the wrong GPU."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != 0:
        raise BundleError(f"A bundle serves on its process's cuda:0, not cuda:{index}: its compiled code launches on "
                          "device 0. Use `h3trt run --device cuda:N` or --gpus/torchrun (they make the chosen GPU the "
                          "process's cuda:0), or start the process with CUDA_VISIBLE_DEVICES listing that GPU first.")
