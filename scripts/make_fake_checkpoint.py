"""Write a random-weight MiniMax-H3 transformer checkpoint in the official layout (FL2VA/ and Ref2VA/ partitions,
native names, QKV interleaved per head, sharded safetensors), or in the diffusers or Comfy layout.

    python scripts/make_fake_checkpoint.py OUT_DIR [--size tiny|full] [--layout official|diffusers|comfy] [--seed 0]

Real MiniMax-H3 weights are not available in this environment; tests load checkpoints written by this script.
"""

import argparse
import sys
from pathlib import Path

import torch

from h3trt.models.checkpoint.writer import random_state_dict, save_comfy, save_diffusers, save_official
from h3trt.models.config import H3Config

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output folder (a .safetensors file path for --layout comfy)")
    p.add_argument("--layout", choices=["official", "diffusers", "comfy"], default="official")
    p.add_argument("--size", choices=["tiny"], default="tiny",
                   help="only tiny: a full-size random checkpoint is 66 GB")
    p.add_argument("--seed", type=int, default=0, help="weights seed (the Ref2VA partition uses seed + 1)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="dtype of the non-fp32 tensors (the checkpoint's fp32 islands stay fp32)")
    p.add_argument("--shards", type=int, default=2)
    args = p.parse_args(argv)

    cfg = H3Config.tiny()
    fl2va, ref2va = random_state_dict(cfg, args.seed), random_state_dict(cfg, args.seed + 1)
    dtype = DTYPES[args.dtype]
    if args.layout == "official":
        save_official(args.out, cfg, {"FL2VA": fl2va, "Ref2VA": ref2va}, dtype, args.shards)
    elif args.layout == "diffusers":
        save_diffusers(args.out, cfg, {"transformer": fl2va, "transformer_ref": ref2va}, dtype, args.shards)
    else:
        save_comfy(args.out, cfg, fl2va, dtype)
    print(f"wrote a tiny {args.layout} H3 checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
