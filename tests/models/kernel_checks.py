"""What the attention kernels' tests share: an exact-tie routing case (the torch routers and the Triton one keep the
same blocks), the FP8 kernels' arithmetic replayed step by step in torch (the sparse and the VSA FP8 kernels run the
same online softmax), and a test file run as a script under Triton's interpreter (TRITON_INTERPRET=1), which is how
the CPU runs the Triton kernels."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, TESTS


def tie_case():
    """24 key blocks of constant rows (exact in binary, so equal blocks score bit-identically): 4 high-scoring ones,
    6 copies of a middling one, the rest low. With 8 kept (sparsity 0.7, scale 0.25), the copies straddle the
    threshold: a router keeps the 4 high blocks and the 4 lowest-numbered copies, as a stable descending sort does.
    Returns (q, k, the copies, the index every router must give): test_sparse_attention.py's torch paths and
    test_sparse_router.py's Triton router route it."""
    high, copies = [3, 10, 15, 20], [1, 5, 7, 8, 12, 22]
    k = -torch.ones(1, 64 * 24, 2, 16)
    for j in high:
        k[:, 64 * j:64 * (j + 1)] = 2.0
    for j in copies:
        k[:, 64 * j:64 * (j + 1)] = 1.0
    q = torch.ones(1, 64 * 3, 2, 16)
    return q, k, copies, torch.tensor([1, 3, 5, 7, 8, 10, 15, 20], dtype=torch.int32).expand(1, 2, 3, 8)


def online_reference(ops, index, sparse_G, block, block_n, key_sizes=None):
    """The kernel's arithmetic step by step in torch fp32 (its online softmax over `block_n` key rows a step, P
    rounded to e4m3 times 448 against the running max): what the kernel computes up to the order of fp32 additions.
    `key_sizes` [K]: key block j's first key_sizes[j] rows are its keys (VSA's ragged tiles). [B, S, N, D] fp32, mu
    added."""
    B, N, _, D = ops.q8.shape
    S, Sk = ops.rows, ops.key_rows
    q_scale, k_scale, v_scale = ops.scales.tolist()
    padded = -(-Sk // block) * block + block
    dropped = torch.arange(padded) >= Sk
    if key_sizes is not None:
        dropped[:Sk] |= torch.arange(Sk) % block >= key_sizes.repeat_interleave(block)[:Sk]
    out = torch.zeros(B, S, N, D)
    for b in range(B):
        for n in range(N):
            q8, k8, v8 = ops.q8[b, n].float(), ops.k8[b, n].float(), ops.v8t[b, n].float().T
            for g in range(-(-S // block)):
                blocks = index[b, n, g].tolist() if sparse_G[g] else list(range(-(-Sk // block)))
                keys = torch.cat([torch.arange(j * block, (j + 1) * block) for j in blocks])  # padded rows zero
                rows = slice(g * block, min(S, (g + 1) * block))
                m = torch.full((rows.stop - rows.start,), -torch.inf)
                l, acc = torch.zeros_like(m), torch.zeros(len(m), D)
                for step in range(0, len(keys), block_n):
                    cols = keys[step:step + block_n]
                    s = q8[rows] @ k8[cols].T * (q_scale * k_scale * D ** -0.5 * 1.4426950408889634)
                    s = s.masked_fill(dropped[cols][None], -torch.inf)
                    m_new = torch.maximum(m, s.amax(1))
                    alpha = torch.exp2(m - m_new)
                    p = torch.exp2(s - (m_new - torch.log2(torch.tensor(448.0)))[:, None])
                    l = l * alpha + p.sum(1)
                    acc = acc * alpha[:, None] + p.to(torch.float8_e4m3fn).float() @ v8[cols]
                    m = m_new
                out[b, rows, n] = acc / l[:, None] * v_scale
    return out + (ops.mu[:, None] if ops.mu is not None else 0)


def interpreted(test_file) -> dict:
    """Run `test_file` as a script under TRITON_INTERPRET=1 (its __main__ prints its checks as one JSON line)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, test_file], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
